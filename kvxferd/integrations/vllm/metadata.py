"""What crosses between the connector's parts: kv_transfer_params, plans, reports.

kv_transfer_params (the standard vLLM P/D flow; a proxy forwards them unchanged)::

    prefill request   {"do_remote_decode": true}
                      (+ "kvxferd_stream": true: publish before the forward that completes
                      the prompt and mark each layer ready as it is computed)
    prefill output    {"do_remote_prefill": true, "do_remote_decode": false,
                       "kvxferd_transfer_id": "...",   the request id on the sender daemon
                       "kvxferd_sender": "tcp://...",  the sender daemon's listen endpoint
                       "kvxferd_num_tokens": P,        prompt tokens whose KV was published
                       "kvxferd_num_blocks": B,        vLLM blocks (ceil(P / block_size))
                       "kvxferd_token": "...",         the fetch token the publish requires
                       "kvxferd_sender_key": "...",    the sender's CURVE key ("" when off)
                       "kvxferd_senders": [...],       every prefill rank's sender endpoint,
                                                       rank order (rank 0 = kvxferd_sender)
                       "kvxferd_sender_keys": [...]}   their CURVE keys, same order
    decode request    the prefill output's params, unchanged

Decode-first (the router chooses the transfer before prefill runs and sends both
requests at once; docs/vllm.md)::

    prefill request   {"do_remote_decode": true,
                       "kvxferd_transfer_id": X,       published under exactly X
                       "kvxferd_token": T,             with fetch token T
                       "kvxferd_stream": true}         optional, kept in the plan (Save.stream)
    prefill output    as above (X and T), with "kvxferd_decode_first": true; a malformed
                      X or T is refused: {"kvxferd_error": "..."} and nothing published
    decode request    {"do_remote_prefill": true, "kvxferd_decode_first": true, X, T,
                       the prefill instance's kvxferd_sender(s) and kvxferd_sender_key(s)}
                      kvxferd_num_tokens / kvxferd_num_blocks may be left out: the decode
                      side takes its own prompt's (both instances tokenize the same prompt
                      with the same model and block size); given, they are checked as above
    decode output     {"kvxferd_receipt": {...}}       whether its KV was loaded (Receipt)

Every worker declares its rank's topology to its daemon; a decode worker fetches
naming the whole prefill instance (``kvxferd_senders``) and its daemon reads from
each prefill rank what the reshard mapping gives it (docs/topology.md). Params
without ``kvxferd_senders`` (an older connector) are fetched from ``kvxferd_sender``
alone, which serves equal parallelism only.

The scheduler side tells the worker side what to do in one :class:`StepPlan`
per engine step (vLLM's connector metadata); the worker reports completions
through vLLM's own fields (finished_sending, finished_recving, failed_recving).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvxferd.engine.engine_protocol import MIN_TOKEN_CHARS
from kvxferd.transfer.protocol import REQUEST_ID_PATTERN

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
TRANSFER_ID = "kvxferd_transfer_id"
SENDER = "kvxferd_sender"
NUM_TOKENS = "kvxferd_num_tokens"
NUM_BLOCKS = "kvxferd_num_blocks"
TOKEN = "kvxferd_token"
SENDER_KEY = "kvxferd_sender_key"
SENDERS = "kvxferd_senders"
SENDER_KEYS = "kvxferd_sender_keys"
DECODE_FIRST = "kvxferd_decode_first"
STREAM = "kvxferd_stream"
RECEIPT = "kvxferd_receipt"
ERROR = "kvxferd_error"
MAX_RANKS = 4096  # prefill ranks a params may list
# A router-chosen transfer id and fetch token, as the engine protocol bounds them (a
# RequestId; a FetchToken an engine chooses): checked here so that a bad one is refused
# with a message naming it, before any publish.
_TRANSFER_ID = re.compile(REQUEST_ID_PATTERN)
_TOKEN = re.compile(rf"^[A-Za-z0-9_-]{{{MIN_TOKEN_CHARS},128}}$")


class ParamsError(ValueError):
    """kv_transfer_params that name a transfer this connector must refuse (the message says why)."""


def chosen_transfer(params: dict[str, Any] | None) -> tuple[str, str] | None:
    """Decode-first: the (transfer id, fetch token) the router chose for this prefill request.

    None when it chose neither (the prefill draws its own); ParamsError when only one is
    given or either is malformed. Never replaced silently: the decode side already
    fetches under exactly these.
    """
    if not params or (TRANSFER_ID not in params and TOKEN not in params):
        return None
    tid, token = params.get(TRANSFER_ID), params.get(TOKEN)
    if not isinstance(tid, str) or not _TRANSFER_ID.fullmatch(tid):
        raise ParamsError(
            f"{TRANSFER_ID} must be 1 to 256 printable ASCII characters without spaces "
            f"(got {str(tid)[:80]!r})"
        )
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        got = f"{len(token)} characters" if isinstance(token, str) else type(token).__name__
        raise ParamsError(
            f"{TOKEN} must be {MIN_TOKEN_CHARS} to 128 characters of [A-Za-z0-9_-] (got {got})"
        )
    return tid, token


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """A decode request's source: the published transfer named by its kv_transfer_params."""

    transfer_id: str
    sender: str
    num_tokens: int
    num_blocks: int
    token: str = ""  # the fetch token the sender requires for this transfer
    sender_key: str = ""  # the sender daemon's CURVE public key (Z85); "" with security off
    senders: tuple[str, ...] = ()  # every prefill rank's endpoint (a topology was declared)
    sender_keys: tuple[str, ...] = ()  # their keys, same order
    decode_first: bool = False  # the router chose the transfer before prefill ran
    stream: bool = False  # ... and asked for layer streaming (kvxferd_stream)

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemoteKv | None:
        """The source, or None when the params ask for no remote prefill (or are not ours)."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return None
        try:
            tid, sender = params[TRANSFER_ID], params[SENDER]
            num_tokens, num_blocks = int(params[NUM_TOKENS]), int(params[NUM_BLOCKS])
        except (KeyError, TypeError, ValueError):
            return None
        token, key = params.get(TOKEN, ""), params.get(SENDER_KEY, "")
        senders, keys = params.get(SENDERS, []), params.get(SENDER_KEYS, [])
        if not all(isinstance(v, str) for v in (tid, sender, token, key)):
            return None
        if not (isinstance(senders, list | tuple) and isinstance(keys, list | tuple)):
            return None
        if len(senders) > MAX_RANKS or not all(isinstance(v, str) for v in (*senders, *keys)):
            return None
        if senders and (senders[0] != sender or len(keys) != len(senders)):
            return None
        return cls(
            tid,
            sender,
            num_tokens,
            num_blocks,
            token,
            key,
            tuple(senders),
            tuple(keys),
            params.get(DECODE_FIRST) is True,
            params.get(STREAM) is True,
        )

    def to_params(self) -> dict[str, Any]:
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            TRANSFER_ID: self.transfer_id,
            SENDER: self.sender,
            NUM_TOKENS: self.num_tokens,
            NUM_BLOCKS: self.num_blocks,
            TOKEN: self.token,
            SENDER_KEY: self.sender_key,
            **(
                {SENDERS: list(self.senders), SENDER_KEYS: list(self.sender_keys)}
                if self.senders
                else {}
            ),
            **({DECODE_FIRST: True} if self.decode_first else {}),
            **({STREAM: True} if self.stream else {}),
        }


@dataclass(frozen=True, slots=True)
class Receipt:
    """What became of one decode request's remote KV: loaded, or not and why (its output's
    ``kvxferd_receipt``; docs/vllm.md).

    Each worker writes its own (its shard: its blocks, its bytes); the scheduler side
    merges the ranks' receipts of a request (:meth:`merge`). ``reason`` is the fetch
    outcome's reason (``expired``, ``timeout``, ``not_authorized``, ``peer_lost``, ...) or
    the connector's own (``no_room``, ``daemon_restarted``, ``not_answered``,
    ``mismatch``); ``recomputed``: vLLM prefills the prompt locally instead
    (``kv_load_failure_policy = "recompute"``).
    """

    loaded: bool
    recomputed: bool = False
    reason: str | None = None
    blocks: int = 0  # blocks the receiver daemon wrote (the prompt's, prefix hits included)
    nbytes: int = 0  # bytes it wrote: its outcome's count
    source: str = ""  # the prefill instance: its first sender endpoint
    ms: float = 0.0  # from the fetch call to its outcome (decode-first: prefill's time too)
    streamed: bool = False  # loaded by a decode-first fetch that asked for layer streaming
    detail: str = ""

    def merge(self, other: Receipt) -> Receipt:
        """Two ranks' receipts of one request: loaded only if both loaded; their bytes
        summed; the slower rank's time."""
        loaded = self.loaded and other.loaded
        return Receipt(
            loaded=loaded,
            recomputed=not loaded and (self.recomputed or other.recomputed),
            reason=self.reason or other.reason,
            blocks=max(self.blocks, other.blocks),
            nbytes=self.nbytes + other.nbytes,
            source=self.source or other.source,
            ms=max(self.ms, other.ms),
            streamed=loaded and self.streamed and other.streamed,
            detail=self.detail or other.detail,
        )

    def to_params(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "recomputed": self.recomputed,
            "reason": self.reason,
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "from": self.source,
            "ms": round(self.ms, 3),
            "streamed": self.streamed,
            **({"detail": self.detail} if self.detail else {}),
        }


@dataclass(frozen=True, slots=True)
class Save:
    """Prefill side: copy these vLLM blocks into the pool and publish them as ``transfer_id``."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    token: str = ""  # the fetch token to publish with (the decode side gets it in the params)
    # kvxferd_stream: published before this step's forward and marked ready layer by layer
    # in it (streams.py); else copied and published after the forward (wait_for_save).
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Load:
    """Decode side: fetch ``remote`` and copy its blocks into ``block_ids``.

    The first ``skip`` blocks are already computed locally (a prefix-cache hit):
    they are fetched with the rest but not copied.
    """

    req_id: str
    remote: RemoteKv
    block_ids: tuple[int, ...]
    skip: int = 0


@dataclass(slots=True)
class StepPlan:
    """The scheduler side's orders for one engine step (vLLM's KVConnectorMetadata)."""

    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    unpublish: list[str] = field(default_factory=list)  # transfer ids whose request was aborted
    cancel_loads: list[str] = field(default_factory=list)  # req ids aborted while loading
    release: list[RemoteKv] = field(default_factory=list)  # remote KV never loaded: free it there
    # The step runs no forward (nothing scheduled): the worker may wait a moment for a load
    # in flight, so that it is reported in this step instead of the next (issue 22).
    idle: bool = False

    def empty(self) -> bool:
        return not (self.saves or self.loads or self.unpublish or self.cancel_loads or self.release)
