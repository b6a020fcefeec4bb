"""The engine protocol: how a local engine drives its kvxferd daemon; msgpack decoded into fixed structs.

Every message is one frame: on an ``ipc://`` engine socket (a unix stream) a 4-byte
little-endian length then the frame (kvxferd/engine/channel.py); on a ``tcp://`` one
exactly one ZMQ frame (the gateway's ROUTER additionally sees the routing id frame in
front of it)::

    frame = b"KE" + version(1 byte) + msgpack(tagged map)

The map's ``"t"`` key names the message type; every request carries a
``call_id`` chosen by the engine, echoed in its reply, so one connection may
have many calls outstanding. Decoding checks the frame count, the frame size,
the header, the tag and every field's bounds; anything else is a
:class:`~kvxferd.errors.ProtocolError`. ``docs/engine-api.md`` is the full
description.

Calls and their replies (engine DEALER -> gateway ROUTER and back)::

    Describe                                         -> PoolInfo
    Publish(request_id, block_ids, aux, expected     -> Handle | Error     (sender only)
            [, token, allowed_receivers])               (+ sender description, token)
    Publish(..., wait_ms > 0 [, close])              -> Outcome | Error    (one round trip)
    Fetch(request_id, sender_endpoint, block_ids...  -> Handle | Error     (receiver only)
          [, token, sender_key])
    Fetch(..., wait_ms > 0 [, close])                -> Outcome | Error    (one round trip)
    Lookup(request_id[, sender_endpoint, layers])    -> Handle | Error(unknown_handle)
    Wait(handle_id, timeout_ms[, close])             -> Outcome | Pending | Error
    Poll(handle_id)                                  -> Outcome | Pending | Error
    Cancel(handle_id)                                -> Ok | Error
    Close(handle_id, timeout_ms)                     -> Closed | Error
    Progress(handle_id, layers_ready)                -> nothing (a streamed publish's mark)
    Links                                            -> LinksReply (each link's speed)

Every call but Describe and Poll carries ``deadline_unix_ms``: the moment (Unix
time in ms, on the host's clock, which the engine and its local daemon share)
at which the engine stops waiting for the reply; 0 means none. The gateway
never starts a call whose deadline has passed: it answers ``Error(timeout)``.
Publish and Fetch are idempotent by key (the request id on a sender; request
id, sender endpoint and layer range on a receiver): a retry with the same key
and parameters gets the same handle, with other parameters ``Error(duplicate)``.

A Publish with ``streamed`` is published before its KV is computed; the engine then
sends ``Progress`` as prefill computes layers. Progress is never answered: a bad one
(unknown handle, not streamed, decreasing, past ``num_layers``) is counted and, when
the handle exists, fails that publish (``bad_progress``: its outcome says so). A
streamed Publish cannot wait (its handle id would come only with the outcome).

A Publish or Fetch with ``wait_ms`` > 0 is answered once: with the Outcome when the
transfer ended (closed as by Close when ``close``; ``Outcome.closed`` says so), or,
if it had not ended after ``wait_ms``, with an Outcome in its open state
("published" / "requested"); either way ``Outcome.handle_id`` names the handle for
later calls. A waiting Publish cannot ask the daemon for a token (the token would
come only with the outcome): it passes its own ``fetch_token``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvxferd.errors import ProtocolError, Reason
from kvxferd.transfer.protocol import (
    U31,
    U63,
    BlockIds,
    Endpoint,
    FetchToken,
    RequestId,
    Text,
    decode_frame,
)
from kvxferd.transfer.topology import Topology

# 2: deadline_unix_ms, Lookup, idempotent Publish/Fetch; 3: Wait.close; 4: Publish/Fetch
# wait_ms + close (one round trip per request), Outcome.handle_id; ipc:// is a unix stream;
# 5: the gateway answers each connection in the version it speaks (4 or 5), V5_ONLY calls.
ENGINE_PROTOCOL_VERSION = 5
MIN_ENGINE_PROTOCOL_VERSION = 4  # the previous release's: the gateway speaks both
ENGINE_VERSIONS = frozenset(range(MIN_ENGINE_PROTOCOL_VERSION, ENGINE_PROTOCOL_VERSION + 1))
# Message tags that exist from version 5 on: ``encode`` refuses them in a version-4 frame.
V5_ONLY: frozenset[str] = frozenset({"links", "links_reply"})
MAGIC = b"KE"
HEADER = MAGIC + bytes([ENGINE_PROTOCOL_VERSION])
MAX_FRAME_BYTES = 16 << 20  # a Publish of 1M block ids fits; nothing bigger is accepted

CallId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
HandleId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
WaitMs = Annotated[int, Meta(ge=0, le=3_600_000)]
DeadlineMs = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # Unix time in ms; 0 = no deadline
Aux = Annotated[bytes, Meta(max_length=1 << 20)]
# A receiver allowed to fetch: its identity (Z85 CURVE key, 40 chars) or its receiver id.
Allowed = Annotated[list[Annotated[str, Meta(min_length=1, max_length=128)]], Meta(max_length=64)]
PublicKey = Annotated[str, Meta(max_length=40)]  # Z85 CURVE public key; "" with security off
MIN_TOKEN_CHARS = 16  # an engine-chosen fetch token shorter than this is refused (malformed)


class EngineReason(StrEnum):
    """Why a call failed or a transfer ended: every :class:`~kvxferd.errors.Reason`, plus the gateway's own."""

    MALFORMED = "malformed"
    UNKNOWN_MESSAGE = "unknown_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"
    INCOMPATIBLE = "incompatible"
    UNKNOWN_PEER = "unknown_peer"
    BAD_BLOCKS = "bad_blocks"
    DUPLICATE = "duplicate"
    BUSY = "busy"
    DRAINING = "draining"  # the daemon is draining: no new publish/fetch
    SHUTTING_DOWN = "shutting_down"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    TIMEOUT = "timeout"
    TRANSFER_ERROR = "transfer_error"
    BUILD_FAILED = "build_failed"
    STALLED = "stalled"
    SESSION_FAILED = "session_failed"
    PEER_LOST = "peer_lost"
    PEER_RESTARTED = "peer_restarted"
    BAD_ENDPOINT = "bad_endpoint"
    NOT_AUTHORIZED = "not_authorized"
    BAD_PROGRESS = "bad_progress"  # a progress mark was refused: the streamed publish failed
    STREAM_STALLED = "stream_stalled"  # no progress mark for stream_stall_timeout_ms
    DIGEST_MISMATCH = "digest_mismatch"  # a failed load: what landed is not what was written
    MOVED = "moved"  # the request moved to another sender and could not be followed there
    # The gateway's own.
    UNKNOWN_HANDLE = "unknown_handle"  # never issued, already closed, or another connection's
    WRONG_ROLE = "wrong_role"  # Publish on a receiver, Fetch on a sender
    INTERNAL = "internal"  # a bug in the daemon; the call failed, the daemon lives on


def engine_reason(reason: Reason | None) -> EngineReason | None:
    """The engine-protocol spelling of a service :class:`Reason`."""
    return None if reason is None else EngineReason(reason.value)


class PoolLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the pool's KV and aux regions lie in the shared-memory segment, and their shape."""

    num_layers: Annotated[int, Meta(ge=1, le=4096)]
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 22)]
    block_bytes: Annotated[int, Meta(ge=1, le=1 << 30)]
    dtype: Literal["uint8", "int8", "float16", "bfloat16", "float32"]
    aux_slots: Annotated[int, Meta(ge=1, le=1 << 20)]
    aux_slot_bytes: Annotated[int, Meta(ge=64, le=1 << 20)]
    kv_offset: U63  # byte offset of the KV region in the segment (always 0 on the CPU)
    aux_offset: U63  # byte offset of the aux region in the segment


class CudaIpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """torch's ``UntypedStorage._share_cuda_()`` tuple, field by field, plus the tensor's view."""

    device: Annotated[int, Meta(ge=0, le=1024)]
    handle: Annotated[bytes, Meta(max_length=4096)]
    storage_size_bytes: U63
    storage_offset_bytes: U63
    ref_counter_handle: Annotated[bytes, Meta(max_length=4096)]
    ref_counter_offset: U63
    event_handle: Annotated[bytes, Meta(max_length=4096)]
    event_sync_required: bool
    tensor_offset: U63  # element offset of the KV tensor in its storage
    shape: Annotated[list[U63], Meta(max_length=8)]
    stride: Annotated[list[U63], Meta(max_length=8)]


class _Msg(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    pass


# -- engine -> gateway ---------------------------------------------------------------------
class Describe(_Msg, tag="describe", frozen=True, omit_defaults=True):
    """What the daemon serves: role, pool, endpoint.

    ``topology``: the engine declares its rank's record at attach (kvxferd/transfer/topology.py;
    once per daemon, the same record again is fine); Error(incompatible) when it does
    not describe the pool or another record was declared. Not sent when absent.
    """

    call_id: CallId
    topology: Topology | None = None


class Publish(_Msg, tag="publish", frozen=True, omit_defaults=True):
    """Sender daemon: offer a finished request's blocks (and aux payload) to receivers.

    ``token``: the daemon issues a random fetch token, returned in the Handle; only a
    fetch carrying it is served. ``fetch_token``: the engine chose the token itself
    (at least ``MIN_TOKEN_CHARS``; implies ``token``), for an engine that must hand it
    on before the reply comes. ``allowed_receivers``: only these receivers (identity
    or receiver id) may fetch it. Fields at their default are not sent.
    """

    call_id: CallId
    request_id: RequestId
    block_ids: BlockIds
    aux: Aux | None = None
    # Decode ranks that read this rank (reshard.readers_for); 0: released at once, unread.
    expected_fetches: Annotated[int, Meta(ge=0, le=65_536)] = 1
    deadline_unix_ms: DeadlineMs = 0
    token: bool = False
    fetch_token: FetchToken = ""
    allowed_receivers: Allowed = []
    wait_ms: WaitMs = 0  # > 0: answered once, with the Outcome (see the module docstring)
    close: bool = False  # with wait_ms: close the handle once it ended
    streamed: bool = False  # no layer ready yet: Progress marks them (not with wait_ms)


class Fetch(_Msg, tag="fetch", frozen=True, omit_defaults=True):
    """Receiver daemon: have ``sender_endpoint`` write ``request_id`` into ``block_ids``.

    ``token`` and ``sender_key`` are what the publish side's Handle said (the engine
    passes them along with the endpoint, e.g. in vLLM's kv_transfer_params).

    ``sender_endpoints``: the prefill instance, one endpoint per prefill rank (index =
    rank); the daemon reads from each rank what the reshard mapping gives this rank
    (needs a declared topology). ``sender_endpoint`` is then the key (rank 0's by
    convention). ``tokens`` / ``sender_keys``: per rank (empty: none).
    """

    call_id: CallId
    request_id: RequestId
    sender_endpoint: Endpoint
    block_ids: BlockIds
    layer_begin: U31 = 0
    layer_end: U31 = 0  # 0 means "all layers"
    timeout_ms: WaitMs = 0  # 0 means the daemon's kv_transfer_timeout_ms
    want_aux: bool = True
    deadline_unix_ms: DeadlineMs = 0
    token: FetchToken = ""
    sender_key: PublicKey = ""
    sender_endpoints: Annotated[list[Endpoint], Meta(max_length=4096)] = []
    tokens: Annotated[list[FetchToken], Meta(max_length=4096)] = []
    sender_keys: Annotated[list[PublicKey], Meta(max_length=4096)] = []
    wait_ms: WaitMs = 0  # > 0: answered once, with the Outcome (see the module docstring)
    close: bool = False  # with wait_ms: close the handle once it ended
    # The per-request digest (kvxferd/transfer/digest.py): None means the daemon's
    # ``integrity.digest``; true/false overrides it for this fetch.
    digest: bool | None = None


class Lookup(_Msg, tag="lookup", frozen=True):
    """The handle of the open publish (sender) or fetch (receiver) with this key, shared with the caller.

    On a receiver the key is (request_id, sender_endpoint, layer range) as in the
    Fetch; on a sender only ``request_id`` counts.
    """

    call_id: CallId
    request_id: RequestId
    sender_endpoint: Endpoint | None = None
    layer_begin: U31 = 0
    layer_end: U31 = 0  # 0 means "all layers"
    deadline_unix_ms: DeadlineMs = 0


class Wait(_Msg, tag="wait", frozen=True):
    """The handle's outcome once it ended, or Pending after ``timeout_ms``.

    ``close``: once ended, also Close the handle (waiting for in-flight writes within
    what is left of ``timeout_ms``) and say in ``Outcome.closed`` whether it is gone;
    one round trip instead of Wait + Close.
    """

    call_id: CallId
    handle_id: HandleId
    timeout_ms: WaitMs
    deadline_unix_ms: DeadlineMs = 0
    close: bool = False


class Poll(_Msg, tag="poll", frozen=True):
    """The handle's outcome if it ended, else Pending; never waits."""

    call_id: CallId
    handle_id: HandleId


class Cancel(_Msg, tag="cancel", frozen=True):
    """End the handle's transfer; memory stays fenced until Close says it is safe."""

    call_id: CallId
    handle_id: HandleId
    deadline_unix_ms: DeadlineMs = 0


class Close(_Msg, tag="close", frozen=True):
    """Cancel if open, wait up to ``timeout_ms`` for in-flight writes; forget the handle when safe."""

    call_id: CallId
    handle_id: HandleId
    timeout_ms: WaitMs
    deadline_unix_ms: DeadlineMs = 0


class Progress(_Msg, tag="progress", frozen=True, omit_defaults=True):
    """A streamed publish: layers ``[0, layers_ready)`` of the sender's pool hold their KV.

    Monotone; ``num_layers`` ends the stream. Never answered (one frame per mark); a
    bad mark is counted and fails the publish, whose outcome says ``bad_progress``.
    """

    handle_id: HandleId
    layers_ready: Annotated[int, Meta(ge=0, le=1 << 20)]
    call_id: CallId = 0  # unused: nothing answers a Progress


class Links(_Msg, tag="links", frozen=True):
    """Each link of the daemon and its last measured speed (kvxferd/engine/links.py); answered
    at once, like Describe. Version 5 (``V5_ONLY``)."""

    call_id: CallId


# -- gateway -> engine ---------------------------------------------------------------------
class PoolInfo(_Msg, tag="pool_info", frozen=True, omit_defaults=True):
    """The daemon's role and KV pool, enough for the engine to map it (see ``client.attach_pool``).

    ``public_key``: the daemon's CURVE public key (Z85; "" with security off), for the
    engine to hand to the other side (a sender's key is what its fetchers expect).
    Fields at their default are not sent.
    """

    call_id: CallId
    role: Literal["sender", "receiver"]
    shm_name: Annotated[str, Meta(min_length=1, max_length=255)]
    shm_bytes: U63  # size of the shared-memory segment
    layout: PoolLayout
    device: Literal["cpu", "cuda"]
    cuda_device: Annotated[int, Meta(ge=0, le=1024)] = 0
    cuda_ipc_handle: Annotated[bytes, Meta(max_length=65_536)] | None = (
        None  # msgpack CudaIpcHandle
    )
    endpoint: Endpoint | None = None  # sender: its listen endpoint; receiver: its result endpoint
    daemon_id: Annotated[str, Meta(max_length=128)] = ""
    public_key: PublicKey = ""
    topology: Topology | None = None  # the rank's declared record, once declared


class Handle(_Msg, tag="handle", frozen=True, omit_defaults=True):
    """A publish or fetch was accepted (or found by key); ``handle_id`` names it.

    Handle ids are never reused, not even by a restarted daemon; a handle serves
    the connections that created it or obtained it by key (retry or Lookup).
    A Publish's Handle also describes the sender for the decode side: its
    ``sender_endpoint``, ``sender_key`` (Z85, "" with security off) and the fetch
    ``token`` ("" unless the Publish asked for one). Fields at their default are
    not sent.
    """

    call_id: CallId
    handle_id: HandleId
    sender_endpoint: Endpoint | None = None
    sender_key: PublicKey = ""
    token: FetchToken = ""


class Error(_Msg, tag="error", frozen=True):
    """The call was refused or failed; nothing was started (for Publish/Fetch)."""

    call_id: CallId
    reason: EngineReason
    detail: Text = ""


class Outcome(_Msg, tag="outcome", frozen=True):
    """How a publish or fetch ended.

    ``reusable`` is true once no write can touch the blocks; ``in_doubt`` once
    that is unknown (the blocks must not be reused). ``state`` is a TxState value
    on a sender, an RxState value on a receiver.
    """

    call_id: CallId
    state: Literal[
        "complete", "failed", "cancelled", "expired", "done", "timed_out", "published", "requested"
    ]
    reason: EngineReason | None = None
    detail: Text = ""
    nbytes: U63 = 0
    aux: Aux | None = None
    in_doubt: bool = False
    reusable: bool = False
    closed: bool | None = None  # Wait(close=True): True = closed safe and forgotten, as Close
    handle_id: U63 = 0  # the handle it is about (set in replies to a waiting Publish/Fetch)

    @property
    def ok(self) -> bool:
        return self.state in ("complete", "done")


class Pending(_Msg, tag="pending", frozen=True):
    """The handle has not ended yet."""

    call_id: CallId


class Ok(_Msg, tag="ok", frozen=True):
    """The call was done."""

    call_id: CallId


class Closed(_Msg, tag="closed", frozen=True):
    """``safe``: the blocks may be reused and the handle is forgotten; else it stays open to retry."""

    call_id: CallId
    safe: bool


class LinkInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One link: a sender's to a receiver (``peer``: its result endpoint), measured by the
    sender's link probe; a receiver's to a sender (``peer``: the sender's endpoint), which a
    receiver does not measure (``state`` "unmeasured").

    ``gbps``: nil unless ``state`` is "ok"; ``transport``: what UCX was asked for
    (``UCX_TLS=...``); ``measured_at``: Unix seconds of the last probe's end (0: none).
    """

    peer: Endpoint
    state: Literal["probing", "ok", "failed", "timeout", "unmeasured"]
    gbps: Annotated[float, Meta(ge=0)] | None = None
    transport: Text = ""
    measured_at: Annotated[float, Meta(ge=0)] = 0.0
    nbytes: U63 = 0
    peer_id: Annotated[str, Meta(max_length=128)] = ""  # the incarnation on the other side


class LinksReply(_Msg, tag="links_reply", frozen=True):
    """The answer to Links, by peer. Version 5 (``V5_ONLY``)."""

    call_id: CallId
    links: Annotated[list[LinkInfo], Meta(max_length=65_536)]


ToGateway = Describe | Publish | Fetch | Lookup | Wait | Poll | Cancel | Close | Progress | Links
ToEngine = PoolInfo | Handle | Error | Outcome | Pending | Ok | Closed | LinksReply


class _CallIdOnly(msgspec.Struct):
    """Salvages the call id of a rejected message, so the engine can match the Error."""

    call_id: CallId = 0


_encoder = msgspec.msgpack.Encoder()
_to_gateway = msgspec.msgpack.Decoder(ToGateway)
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_call_id_only = msgspec.msgpack.Decoder(_CallIdOnly)
_cuda_ipc = msgspec.msgpack.Decoder(CudaIpcHandle)


def encode(msg: _Msg, version: int = ENGINE_PROTOCOL_VERSION) -> bytes:
    """One frame in ``version`` (the connection's): header + msgpack body; a V5_ONLY
    message in a version-4 frame is a bug of the caller, never sent: ValueError."""
    if version not in ENGINE_VERSIONS:
        raise ValueError(f"engine protocol version {version} is not one this side speaks")
    tag = str(msg.__struct_config__.tag)
    if version < 5 and tag in V5_ONLY:
        raise ValueError(f"{tag} is not in engine protocol version {version}")
    return MAGIC + bytes([version]) + _encoder.encode(msg)


def frame_version(frame: bytes) -> int:
    """The version to answer ``frame`` in: its own when spoken here, else the nearest one
    (the newest for a frame without our magic)."""
    v = frame[2] if len(frame) >= 3 and frame[:2] == MAGIC else ENGINE_PROTOCOL_VERSION
    return min(max(v, MIN_ENGINE_PROTOCOL_VERSION), ENGINE_PROTOCOL_VERSION)


def _decode(decoder: msgspec.msgpack.Decoder, frames: list[bytes], max_bytes: int) -> object:
    return decode_frame(decoder, frames, max_bytes, MAGIC, ENGINE_VERSIONS)


def decode_to_gateway(frames: list[bytes], max_bytes: int = MAX_FRAME_BYTES) -> ToGateway:
    """Decode a frame the gateway received, or raise ProtocolError."""
    return _decode(_to_gateway, frames, max_bytes)  # type: ignore[return-value]


def decode_to_engine(frames: list[bytes], max_bytes: int = MAX_FRAME_BYTES) -> ToEngine:
    """Decode a frame the engine received, or raise ProtocolError."""
    return _decode(_to_engine, frames, max_bytes)  # type: ignore[return-value]


def salvage_call_id(frames: list[bytes]) -> int:
    """The call id of a frame that did not decode, or 0 when even that is unreadable."""
    if (
        len(frames) != 1
        or len(frames[0]) > MAX_FRAME_BYTES
        or frames[0][:2] != MAGIC
        or frames[0][2:3] not in (bytes([v]) for v in ENGINE_VERSIONS)
    ):
        return 0
    try:
        return _call_id_only.decode(memoryview(frames[0])[3:]).call_id
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return 0


def encode_cuda_ipc(handle: CudaIpcHandle) -> bytes:
    return _encoder.encode(handle)


def decode_cuda_ipc(data: bytes) -> CudaIpcHandle:
    """The CUDA IPC handle carried in ``PoolInfo.cuda_ipc_handle``; ProtocolError if unreadable."""
    try:
        return _cuda_ipc.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError(Reason.MALFORMED, f"cuda_ipc_handle: {e}"[:300]) from None
