"""What the engine gateway does differently for a sender and a receiver: one adapter per role.

The gateway serves both roles through the same calls (calls.py), handle table
(handles.py) and waiting calls (waits.py); everything that depends on the role sits
here, so none of them asks which service it serves:

=====================  ==================================  ==================================
                       SenderRole (Sender)                 ReceiverRole (Receiver)
=====================  ==================================  ==================================
opens a transfer       Publish -> ``Sender.publish``       Fetch -> ``Receiver.fetch``
key of an open call    ("publish", request id)             ("fetch", request id, sender
                                                           endpoint, layer range)
what a retry repeats   blocks, aux, expected fetches;      blocks, want_aux; token and key,
(``digest``)           token, fetch token, allowed         the other senders' endpoints,
                       receivers when given                tokens and keys when given
refused at once        a waiting publish asking for a      -
                       token; a fetch token too short
fetch token            the engine's, or minted (128 bits)  -
                       when it asks for one
Lookup                 by request id                       needs ``sender_endpoint`` too
open state             ``published``                       ``requested``
Handle reply           sender endpoint, key and token      the handle id
                       when the publish restricts fetchers
close needs no wait    the session drained                 the fetch ended, its fence settled
Outcome                bytes of every slice; reusable      bytes and aux; in doubt while the
                       once drained                        fence is; reusable once released
PoolInfo identity      listen endpoint, ``sender_id``      result endpoint, ``receiver_id``
Progress               marks the streamed publish          refused (``wrong_role``), counted
Links                  each receiver's link, as its probe  each sender link, "unmeasured"
                       measured it (link_probes.py)        (a receiver measures none)
its engine connection  a stream still open is cancelled    nothing
closed (no owner left)
=====================  ==================================  ==================================

:func:`role_for` is the one place that looks at the service's type.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Callable
from typing import Literal

import msgspec

from kvxferd.engine import engine_protocol as ep
from kvxferd.errors import RejectedError
from kvxferd.transfer import views
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender, TxHandle
from kvxferd.transfer.session import Fence, RxOutcome, TxOutcome

Key = tuple[str, str, str, int, int]  # (kind, request id, sender endpoint, layer begin, end)


class SenderRole:
    """The gateway of a sender: engines publish."""

    name: Literal["sender"] = "sender"
    opens = "publish"
    opened = "published"
    open_state: Literal["published"] = "published"

    def __init__(self, sender: Sender) -> None:
        self.service = sender

    def serves(self, msg: ep.Publish | ep.Fetch) -> bool:
        return isinstance(msg, ep.Publish)

    def key(self, msg: ep.Publish | ep.Fetch | ep.Lookup) -> Key:
        return ("publish", msg.request_id, "", 0, 0)

    def digest(self, msg: ep.Publish | ep.Fetch) -> bytes:
        """What a retry must repeat to get the same handle: blocks and aux."""
        assert isinstance(msg, ep.Publish)
        params: list[object] = [msg.block_ids, msg.aux, msg.expected_fetches]
        if msg.token or msg.fetch_token or msg.allowed_receivers:
            params += [msg.token, msg.fetch_token, sorted(msg.allowed_receivers)]
        if msg.streamed:
            params.append("streamed")
        return _digest(params)

    def malformed(self, msg: ep.Publish | ep.Fetch) -> str | None:
        """Why the call is refused whatever its key (None: it is not); checked first."""
        assert isinstance(msg, ep.Publish)
        if msg.wait_ms and msg.token:
            return "a waiting publish cannot ask for a token: pass fetch_token"
        if msg.wait_ms and msg.streamed:
            return "a streamed publish cannot wait: its handle id must be known for Progress"
        return None

    def mark(self, handle: TxHandle | RxHandle, layers_ready: int) -> str | None:
        """A Progress of ``handle``; None, or why the gateway counts it refused (the sender
        counts its own refusals, and a refused mark fails the publish: streams.py)."""
        assert isinstance(handle, TxHandle)
        with contextlib.suppress(RejectedError):
            handle.progress(layers_ready)
        return None

    def orphaned(self, handle: TxHandle | RxHandle) -> None:
        """No engine connection holds ``handle`` any more: a stream still open is aborted."""
        assert isinstance(handle, TxHandle)
        if handle.session.streaming:
            handle.cancel("abandoned (its engine connection closed mid-stream)")

    def token_problem(self, msg: ep.Publish | ep.Fetch) -> str | None:
        """Why a new publish is refused for its fetch token (None: it is not)."""
        assert isinstance(msg, ep.Publish)
        if msg.fetch_token and len(msg.fetch_token) < ep.MIN_TOKEN_CHARS:
            return f"fetch_token shorter than {ep.MIN_TOKEN_CHARS} characters"
        return None

    def new_token(self, msg: ep.Publish | ep.Fetch) -> str:
        """The fetch token of a new publish: the engine's, a new one if it asks, else ""."""
        assert isinstance(msg, ep.Publish)
        # 128 random bits, URL-safe: it travels in the engine's transfer parameters.
        return msg.fetch_token or (secrets.token_urlsafe(16) if msg.token else "")

    def lookup_problem(self, msg: ep.Lookup) -> str | None:
        return None

    def start(self, msg: ep.Publish | ep.Fetch, token: str) -> Callable[[], TxHandle | RxHandle]:
        assert isinstance(msg, ep.Publish)
        sender = self.service
        return lambda: sender.publish(
            msg.request_id,
            msg.block_ids,
            aux=msg.aux,
            expected_fetches=msg.expected_fetches,
            token=token or None,
            allowed_receivers=msg.allowed_receivers,
            streamed=msg.streamed,
        )

    def handle_reply(self, msg: ep.Publish | ep.Fetch, hid: int, token: str) -> ep.Handle:
        """A Handle; a Publish that restricted its fetchers also gets the sender's description.

        (Only then: an engine that never asks keeps reading the Handle it always got.)
        """
        if not (
            isinstance(msg, ep.Publish) and (msg.token or msg.fetch_token or msg.allowed_receivers)
        ):
            return ep.Handle(call_id=msg.call_id, handle_id=hid)
        return ep.Handle(
            call_id=msg.call_id,
            handle_id=hid,
            sender_endpoint=self.service.endpoint,
            # The sender's CURVE public key once security is configured ("" while off).
            sender_key=getattr(self.service, "public_key", "") or "",
            token=token,
        )

    def closes_at_once(self, handle: TxHandle | RxHandle) -> bool:
        """True when ``close`` needs no wait: every write of the request has drained."""
        assert isinstance(handle, TxHandle)
        return handle.session.drained_event.is_set()

    def outcome(
        self,
        call_id: int,
        handle: TxHandle | RxHandle,
        value: TxOutcome | RxOutcome,
        handle_id: int = 0,
    ) -> ep.Outcome:
        assert isinstance(handle, TxHandle) and isinstance(value, TxOutcome)
        tx = handle.session
        return ep.Outcome(
            call_id=call_id,
            state=value.state.value,  # type: ignore[arg-type]
            reason=ep.engine_reason(value.reason),
            detail=value.detail[:1024],
            nbytes=sum(sl.nbytes for sl in tx.slices()),
            in_doubt=value.in_doubt,
            reusable=tx.drained,
            handle_id=handle_id,
        )

    def identity(self) -> tuple[str, str]:
        """(endpoint, daemon id) for PoolInfo: where receivers reach this sender."""
        return self.service.endpoint, self.service.sender_id

    def links(self, call_id: int) -> ep.LinksReply:
        """Each registered receiver's link as its last probe measured it."""
        links = [
            ep.LinkInfo(
                peer=f.peer,
                state=f.state,  # type: ignore[arg-type]
                gbps=f.gbps,
                transport=f.transport[:1024],
                measured_at=0.0 if f.state == "probing" else f.measured_at,
                nbytes=f.nbytes,
                peer_id=f.receiver_id,
            )
            for f in self.service.probes.figures()
        ]
        return ep.LinksReply(call_id=call_id, links=links)


class ReceiverRole:
    """The gateway of a receiver: engines fetch."""

    name: Literal["receiver"] = "receiver"
    opens = "fetch"
    opened = "fetched"
    open_state: Literal["requested"] = "requested"

    def __init__(self, receiver: Receiver) -> None:
        self.service = receiver

    def serves(self, msg: ep.Publish | ep.Fetch) -> bool:
        return isinstance(msg, ep.Fetch)

    def key(self, msg: ep.Publish | ep.Fetch | ep.Lookup) -> Key:
        assert not isinstance(msg, ep.Publish)
        end = msg.layer_end or self.service.pool.layout.num_layers
        return ("fetch", msg.request_id, msg.sender_endpoint or "", msg.layer_begin, end)

    def digest(self, msg: ep.Publish | ep.Fetch) -> bytes:
        """What a retry must repeat to get the same handle: blocks and aux wanted."""
        assert isinstance(msg, ep.Fetch)
        params: list[object] = [msg.block_ids, msg.want_aux]
        if msg.token or msg.sender_key:
            params += [msg.token, msg.sender_key]
        if msg.sender_endpoints:
            params += [msg.sender_endpoints, msg.tokens, msg.sender_keys]
        return _digest(params)

    def malformed(self, msg: ep.Publish | ep.Fetch) -> str | None:
        return None

    def token_problem(self, msg: ep.Publish | ep.Fetch) -> str | None:
        return None

    def new_token(self, msg: ep.Publish | ep.Fetch) -> str:
        return ""

    def lookup_problem(self, msg: ep.Lookup) -> str | None:
        return "lookup on a receiver needs sender_endpoint" if msg.sender_endpoint is None else None

    def start(self, msg: ep.Publish | ep.Fetch, token: str) -> Callable[[], TxHandle | RxHandle]:
        assert isinstance(msg, ep.Fetch)
        receiver = self.service
        layers = None
        if msg.layer_begin or msg.layer_end:
            layers = (msg.layer_begin, msg.layer_end or receiver.pool.layout.num_layers)
        return lambda: receiver.fetch(
            msg.request_id,
            msg.sender_endpoint,
            msg.block_ids,
            layers=layers,
            want_aux=msg.want_aux,
            timeout_ms=msg.timeout_ms or None,
            token=msg.token,
            sender_key=msg.sender_key,
            sender_endpoints=msg.sender_endpoints,
            tokens=msg.tokens,
            sender_keys=msg.sender_keys,
            digest=msg.digest,
        )

    def handle_reply(self, msg: ep.Publish | ep.Fetch, hid: int, token: str) -> ep.Handle:
        return ep.Handle(call_id=msg.call_id, handle_id=hid)

    def mark(self, handle: TxHandle | RxHandle, layers_ready: int) -> str | None:
        return "wrong_role"  # only a publish streams

    def orphaned(self, handle: TxHandle | RxHandle) -> None:
        return None  # a fetch runs to its own end (kv_transfer_timeout bounds it)

    def closes_at_once(self, handle: TxHandle | RxHandle) -> bool:
        """True when ``close`` needs no wait: the fetch ended and its fence is settled."""
        assert isinstance(handle, RxHandle)
        rx = handle.session
        return rx.ended and rx.fence_done.is_set()

    def outcome(
        self,
        call_id: int,
        handle: TxHandle | RxHandle,
        value: TxOutcome | RxOutcome,
        handle_id: int = 0,
    ) -> ep.Outcome:
        assert isinstance(handle, RxHandle) and isinstance(value, RxOutcome)
        rx = handle.session
        return ep.Outcome(
            call_id=call_id,
            state=value.state.value,  # type: ignore[arg-type]
            reason=ep.engine_reason(value.reason),
            detail=value.detail[:1024],
            nbytes=value.nbytes,
            aux=value.aux,
            in_doubt=rx.fence is Fence.IN_DOUBT,
            reusable=rx.blocks_reusable,
            handle_id=handle_id,
        )

    def identity(self) -> tuple[str, str]:
        """(endpoint, daemon id) for PoolInfo: where senders send this receiver's Results."""
        return self.service.result_endpoint, self.service.receiver_id

    def links(self, call_id: int) -> ep.LinksReply:
        """Each sender link, unmeasured (the gateway runs on the io thread, which owns them)."""
        links = sorted(views.copied_values(self.service.links.links), key=lambda k: k.endpoint)
        return ep.LinksReply(
            call_id=call_id,
            links=[
                ep.LinkInfo(peer=k.endpoint, state="unmeasured", peer_id=k.sender_id) for k in links
            ],
        )


Role = SenderRole | ReceiverRole


def _digest(params: list[object]) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(params), digest_size=16).digest()


def role_for(service: Sender | Receiver) -> Role:
    """The adapter of ``service``'s role."""
    return SenderRole(service) if isinstance(service, Sender) else ReceiverRole(service)
