"""What a client sends: each engine call's message, built for a call id and its deadline, and the check of its reply.

Both clients (client.py's :class:`~kvxferd.engine.client.Client`, async_client.py's
:class:`~kvxferd.engine.async_client.AsyncClient`) build every call here, so the two
send the same frames: a ``Build`` is ``(call id, deadline_unix_ms) -> message``; the
client that sends it picks the call id (``call_ids``, process-wide, never reused, so a
late reply can never match another call) and computes the deadline before sending
(``deadline_ms``). ``check_reply`` turns an Error reply into :class:`EngineRejected` and
any other unexpected reply into :class:`EngineError` (malformed).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.engine.errors import EngineError, EngineRejected

DEFAULT_TIMEOUT_S = 5.0  # a round trip to a local daemon; waits add their own timeout
call_ids = itertools.count(1)  # process-wide, never reused: a late reply can never match

R = TypeVar("R", bound=ep._Msg)


@dataclass(frozen=True, slots=True)
class Published:
    """A publish's handle and what the decode side needs to fetch it (pass these to ``fetch``)."""

    handle_id: int
    sender_endpoint: str
    sender_key: str  # the sender's CURVE public key (Z85); "" with security off
    token: str  # the fetch token; "" when none was asked for

    @classmethod
    def of(cls, reply: ep.Handle) -> Published:
        return cls(reply.handle_id, reply.sender_endpoint or "", reply.sender_key, reply.token)


def ms(seconds: float) -> int:
    return max(0, min(int(seconds * 1000), 3_600_000))


def block_list(block_ids: Sequence[int] | np.ndarray) -> list[int]:
    return np.asarray(block_ids, dtype=np.int64).reshape(-1).tolist()  # type: ignore[no-any-return]


def check_reply(reply: ep.ToEngine, expected: type[R] | tuple[type[Any], ...]) -> Any:
    if isinstance(reply, ep.Error):
        raise EngineRejected(reply.reason, reply.detail)
    if not isinstance(reply, expected):
        raise EngineError(EngineReason.MALFORMED, f"unexpected reply {type(reply).__name__}")
    return reply


def deadline_ms(bound_s: float) -> int:
    """When a call that waits ``bound_s`` from now gives up, as Unix ms (the daemon shares the clock)."""
    return time.time_ns() // 1_000_000 + int(bound_s * 1000)


Build = Callable[[int, int], ep._Msg]  # (call id, deadline_unix_ms) -> the request
# A prefill instance: (sender endpoints, tokens, sender keys), each indexed by prefill rank.
Instance = tuple[Sequence[str], Sequence[str], Sequence[str]]


def publish_msg(
    request_id: str,
    block_ids: Sequence[int] | np.ndarray,
    aux: bytes | None,
    expected_fetches: int,
    token: bool | str = False,
    allowed_receivers: Sequence[str] = (),
    wait_ms: int = 0,
    close: bool = False,
    streamed: bool = False,
) -> Build:
    """The Publish message for a call id (block ids converted and checked once, here).

    ``token``: True to have the daemon issue a fetch token, or the token itself.
    ``wait_ms`` > 0: answered once, at the outcome (closed when ``close``).
    """
    if streamed and wait_ms:
        raise ValueError(
            "a streamed publish cannot wait: its handle id (for progress) comes only with the"
            " outcome; use publish or publish_for"
        )
    blocks = block_list(block_ids)
    allowed = list(allowed_receivers)
    return lambda call_id, deadline: ep.Publish(
        wait_ms=wait_ms,
        close=close,
        call_id=call_id,
        request_id=request_id,
        block_ids=blocks,
        aux=aux,
        expected_fetches=expected_fetches,
        deadline_unix_ms=deadline,
        token=token is True,
        fetch_token=token if isinstance(token, str) else "",
        allowed_receivers=allowed,
        streamed=streamed,
    )


def fetch_msg(
    request_id: str,
    sender_endpoint: str,
    block_ids: Sequence[int] | np.ndarray,
    layers: tuple[int, int] | None,
    timeout_ms: int | None,
    want_aux: bool,
    token: str = "",
    sender_key: str = "",
    instance: Instance = ((), (), ()),
    wait_ms: int = 0,
    close: bool = False,
    digest: bool | None = None,
) -> Build:
    lb, le = layers if layers is not None else (0, 0)
    blocks = block_list(block_ids)
    endpoints, tokens, keys = (list(x) for x in instance)
    return lambda call_id, deadline: ep.Fetch(
        wait_ms=wait_ms,
        close=close,
        digest=digest,
        token=token,
        sender_key=sender_key,
        sender_endpoints=endpoints,
        tokens=tokens,
        sender_keys=keys,
        call_id=call_id,
        request_id=request_id,
        sender_endpoint=sender_endpoint,
        block_ids=blocks,
        layer_begin=lb,
        layer_end=le,
        timeout_ms=timeout_ms or 0,
        want_aux=want_aux,
        deadline_unix_ms=deadline,
    )


def lookup_msg(
    request_id: str, sender_endpoint: str | None, layers: tuple[int, int] | None
) -> Build:
    lb, le = layers if layers is not None else (0, 0)
    return lambda call_id, deadline: ep.Lookup(
        call_id=call_id,
        request_id=request_id,
        sender_endpoint=sender_endpoint,
        layer_begin=lb,
        layer_end=le,
        deadline_unix_ms=deadline,
    )


def wait_msg(handle: int, timeout: float, close: bool) -> Build:
    return lambda call_id, deadline: ep.Wait(
        call_id=call_id,
        handle_id=handle,
        timeout_ms=ms(timeout),
        deadline_unix_ms=deadline,
        close=close,
    )


def found(reply: ep.ToEngine) -> int | None:
    """A Lookup's handle id, or None when nothing is open under that key."""
    if isinstance(reply, ep.Error) and reply.reason is EngineReason.UNKNOWN_HANDLE:
        return None
    return check_reply(reply, ep.Handle).handle_id  # type: ignore[no-any-return]
