"""The scheduler side of the connector: which requests save or load, and their kv_transfer_params.

It never touches KV memory and never blocks on a daemon during a step: it only
plans, and the worker side carries the plan out (metadata.StepPlan).

Prefill (producer) request, ``{"do_remote_decode": true}``::

    update_state_after_alloc   -> tracked (_to_save); decode-first (the router chose
                               kvxferd_transfer_id and kvxferd_token): both checked,
                               a malformed one -> refused (_refused: never published,
                               its output says why in kvxferd_error)
    build_connector_meta       the step that completes its prompt -> Save(block ids, transfer
                               id: the router's in decode-first, else a fresh one)
                               -> _published (the worker copies and publishes after the forward;
                               with "kvxferd_stream": true it publishes before the forward and
                               marks each layer ready in it: Save.stream, streams.py)
    request_finished           length-capped or stopped -> kv_transfer_params (RemoteKv), blocks
                               freed at once (the KV is in the daemon's pool by then);
                               aborted after its save -> unpublish (the sender's blocks are freed).
                               Zero copy: the published blocks are vLLM's own, freed late
                               (True) once the worker reports them in finished_sending

Decode (consumer) request, kv_transfer_params from a prefill output::

    get_num_new_matched_tokens prompt tokens not computed locally, loaded asynchronously
                               (decode-first params without a token count: the prompt's)
    update_state_after_alloc   -> Load(local block ids) (or release, if nothing is to load)
    update_connector_output    the workers' receipts of ended loads -> _receipts (merged)
    request_finished           aborted while loading -> cancel_loads; never allocated -> release;
                               its receipt, if any, into the output's kv_transfer_params

Everything here runs on vLLM's scheduler thread; no lock is needed.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import replace
from typing import Any

from kvxferd.integrations.vllm.geometry import blocks_for
from kvxferd.integrations.vllm.metadata import (
    DECODE_FIRST,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    ERROR,
    NUM_BLOCKS,
    NUM_TOKENS,
    RECEIPT,
    STREAM,
    Load,
    ParamsError,
    Receipt,
    RemoteKv,
    Save,
    StepPlan,
    chosen_transfer,
)

log = logging.getLogger("kvxferd.integrations.vllm")

# vLLM's RequestStatus names for a request that ran to its end (its KV is complete).
_COMPLETED = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


def transfer_id(req_id: str) -> str:
    """A request id for the daemons: unique across instances and restarts, printable, short."""
    safe = "".join(c for c in req_id if c.isascii() and c.isprintable() and c != " ")[:64]
    return f"{uuid.uuid4().hex}-{safe}"


class SchedulerSide:
    """Plans saves and loads; ``sender`` is the local sender daemon's endpoint (producers)."""

    def __init__(
        self,
        *,
        producer: bool,
        consumer: bool,
        block_size: int,
        sender: str | None,
        zero_copy: bool = False,
        sender_key: str = "",
        senders: list[str] | None = None,
        sender_keys: list[str] | None = None,
        recompute: bool = False,
    ) -> None:
        if producer and sender is None:
            raise ValueError("a producer needs its sender daemon's endpoint")
        self.producer = producer
        self.consumer = consumer
        self.block_size = block_size
        self.sender = sender
        self.sender_key = sender_key
        # Every prefill rank's sender endpoint and key, rank order (rank 0: sender).
        self.senders = list(senders or ([sender] if sender else []))
        self.sender_keys = list(sender_keys or [sender_key] * len(self.senders))
        self.zero_copy = zero_copy
        # kv_load_failure_policy "recompute": vLLM prefills a request whose load failed here.
        self.recompute = recompute
        self._kv_cache_manager: Any = None
        self._to_save: dict[str, Any] = {}  # req id -> vLLM Request, prompt not yet complete
        self._published: dict[str, RemoteKv] = {}  # req id -> what its Save published
        self._loading: set[str] = set()  # req ids handed to the worker, not reported finished
        self._refused: dict[str, str] = {}  # req id -> why its router-chosen transfer was refused
        self._receipts: dict[str, Receipt] = {}  # req id -> its load's receipt (ranks merged)
        self._mismatched = 0  # requests computed here because their params did not fit, unreported
        self._plan = StepPlan()

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    # -- decode side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = self._remote(request) if self.consumer else None
        if remote is None:
            return 0, False
        if not self._matches(request, remote):
            return 0, False
        count = remote.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _remote(self, request: Any) -> RemoteKv | None:
        """The request's remote KV; decode-first params without a token count get the
        prompt's (the prefill computes the same prompt in blocks of the same size)."""
        params = request.kv_transfer_params
        if params and params.get(DECODE_FIRST) is True and NUM_TOKENS not in params:
            n = len(request.prompt_token_ids or ())
            params[NUM_TOKENS], params[NUM_BLOCKS] = n, blocks_for(n, self.block_size)
        return RemoteKv.from_params(params)

    def _matches(self, request: Any, remote: RemoteKv) -> bool:
        n = len(request.prompt_token_ids or ())
        return remote.num_tokens == n and remote.num_blocks == blocks_for(n, self.block_size)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if (
            self.producer
            and params.get(DO_REMOTE_DECODE)
            and rid not in self._published
            and rid not in self._refused
        ):
            try:
                chosen_transfer(params)
            except ParamsError as e:
                log.error("request %s: kv_transfer_params refused, not published: %s", rid, e)
                self._refused[rid] = str(e)
            else:
                self._to_save[rid] = request
        remote = self._remote(request) if self.consumer else None
        if remote is None:
            return
        params[DO_REMOTE_PREFILL] = False  # load once, even if this is called again
        if num_external_tokens <= 0 or not self._matches(request, remote):
            if not self._matches(request, remote):
                log.warning(
                    "request %s: kv_transfer_params describe %d tokens in %d blocks, the prompt "
                    "has %d tokens; computing it here",
                    rid,
                    remote.num_tokens,
                    remote.num_blocks,
                    len(request.prompt_token_ids or ()),
                )
            self._plan.release.append(remote)
            # Not loaded: the prompt was cached here already, or the params describe another.
            matched = self._matches(request, remote)
            why = "prefix_cached" if matched else "mismatch"
            self._receipts[rid] = Receipt(False, not matched, why, source=remote.sender)
            self._mismatched += not matched
            return
        block_ids = blocks.get_block_ids()[0][: remote.num_blocks]
        skip = (remote.num_tokens - num_external_tokens) // self.block_size
        self._plan.loads.append(Load(rid, remote, tuple(block_ids), skip))
        self._loading.add(rid)

    # -- prefill side ----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        if self._to_save:
            self._plan_saves(scheduler_output)
        plan, self._plan = self._plan, StepPlan()
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if total is None:
            total = sum((scheduler_output.num_scheduled_tokens or {}).values())
        plan.idle = total == 0  # no forward this step: the worker may wait for a load
        return plan

    def _plan_saves(self, scheduler_output: Any) -> None:
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens or {}
        for rid, n in scheduled.items():
            req = self._to_save.get(rid)
            if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # not ours, or a chunked prefill with chunks to go
            del self._to_save[rid]
            num_tokens = req.num_prompt_tokens
            num_blocks = blocks_for(num_tokens, self.block_size)
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0][:num_blocks]
            assert self.sender is not None
            params = req.kv_transfer_params or {}
            # Decode-first: the router's transfer id and token (checked at allocation; the
            # decode side fetches under exactly these). Otherwise a fetch token per
            # transfer: only who holds this request's params may fetch it.
            chosen = chosen_transfer(params)
            tid, token = chosen if chosen else (transfer_id(rid), secrets.token_urlsafe(16))
            stream = params.get(STREAM) is True
            remote = RemoteKv(
                tid,
                self.sender,
                num_tokens,
                num_blocks,
                token,
                self.sender_key,
                tuple(self.senders),
                tuple(self.sender_keys),
                decode_first=chosen is not None,
                stream=stream,
            )
            self._plan.saves.append(Save(rid, tid, tuple(block_ids), token, stream))
            self._published[rid] = remote

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if self.consumer:
            if rid in self._loading:
                self._loading.discard(rid)
                self._plan.cancel_loads.append(rid)
            elif (remote := RemoteKv.from_params(params)) is not None:
                params[DO_REMOTE_PREFILL] = False
                self._plan.release.append(remote)  # aborted before it was scheduled
            receipt = self._receipts.pop(rid, None)
            return False, (None if receipt is None else {RECEIPT: receipt.to_params()})
        self._to_save.pop(rid, None)
        refused = self._refused.pop(rid, None)
        if refused is not None:
            return False, {ERROR: refused}
        published = self._published.pop(rid, None)
        if published is None:
            return False, None
        if request.status.name in _COMPLETED:
            return self.zero_copy, published.to_params()
        self._plan.unpublish.append(published.transfer_id)
        return self.zero_copy, None

    def take_counts(self) -> dict[str, int]:
        """Requests recomputed because their params did not fit, since the last call."""
        n, self._mismatched = self._mismatched, 0
        return {"recomputed": n, "recomputed{mismatch}": n} if n else {}

    def sender_moved(self, rank: int, endpoint: str) -> None:
        """Rank ``rank``'s sender daemon restarted on ``endpoint``: later params name it."""
        if 0 <= rank < len(self.senders):
            self.senders[rank] = endpoint
        if rank == 0:
            self.sender = endpoint

    def update_connector_output(
        self, finished_recving: set[str] | None, receipts: dict[str, Receipt] | None = None
    ) -> None:
        for rid, r in (receipts or {}).items():
            if rid not in self._loading:
                continue  # already finished (failed under policy "fail"): nobody reads it
            if not r.loaded and self.recompute:  # vLLM prefills it here (failed_recving)
                r = replace(r, recomputed=True)
            have = self._receipts.get(rid)
            self._receipts[rid] = r if have is None else have.merge(r)
        for rid in finished_recving or ():
            self._loading.discard(rid)
