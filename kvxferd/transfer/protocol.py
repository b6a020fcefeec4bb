"""The wire protocol: typed, versioned, bounded messages; msgpack decoded by msgspec into fixed structs.

Every message is exactly one ZMQ frame (a ROUTER additionally sees the routing
id frame in front of it)::

    frame = b"KX" + version(1 byte) + msgpack(tagged map)

The map's ``"t"`` key names the message type. Decoding checks the frame count,
the frame size, the header, the tag and every field's bounds; anything else is
a :class:`~kvxferd.errors.ProtocolError` with a reason code, never an
exception that could kill a thread. ``docs/protocol.md`` is the full
description, complete enough to write a compatible peer.

A fetch whose RequestData carries ``notify`` (a nonce) completes by a NIXL notification
attached to its last WRITE (NIXL sends it once that WRITE is complete, and reports the
WRITE DONE only after sending it), not by a done Result; failures still come as Results::

    notification = b"KN" + version(1 byte) + count(u16)
                   + count x [fetch_id(u64) + nonce(8 bytes) + nbytes(u64) + aux_bytes(u32)]
                   (little-endian; at most MAX_BATCH records: the fetches one WRITE serves)

Direction and socket::

    receiver DEALER -> sender ROUTER   Register, RequestData, Cancel
    sender ROUTER  -> receiver DEALER  RegisterReply, Result (listener refusals), CancelAck, Reject
    sender worker DEALER -> receiver ROUTER (result endpoint)   Result, CancelAck, Moved
    draining sender DEALER -> sender ROUTER   Handover (answered HandoverReply)
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvxferd.errors import ProtocolError, Reason, RejectedError
from kvxferd.transfer.digest import DIGEST_BYTES
from kvxferd.transfer.layout import Layout
from kvxferd.transfer.reshard import check_pair
from kvxferd.transfer.topology import Topology

# 3: RequestData.notify, a fetch completed by its NIXL notification; 4: negotiated per link
# at Register (the lower both speak), V4_ONLY fields and messages (docs/protocol.md §2.1)
PROTOCOL_VERSION = 4
MIN_PROTOCOL_VERSION = 3  # the previous release's: a daemon speaks every version in between
SUPPORTED_VERSIONS = frozenset(range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1))
# "Message" or "Message.field" names that exist from version 4 on: ``encode`` refuses a
# frame toward a version-3 peer that carries one (a field set, i.e. not at its default).
V4_ONLY: frozenset[str] = frozenset(
    {
        "Register.scratch_base",
        "Register.scratch_bytes",
        "Result.moved_to",
        "Handover",
        "HandoverReply",
        "Moved",
    }
)
MAGIC = b"KX"
HEADER = MAGIC + bytes([PROTOCOL_VERSION])


def negotiate(offered: int) -> int:
    """The version a sender answers a Register offered at ``offered`` in: the lower of the two."""
    return min(offered, PROTOCOL_VERSION)


def answer_version(frame_version: int) -> int:
    """The version to answer a frame in that came in ``frame_version`` (maybe not one we
    speak): the nearest one we speak, so a peer of either release reads the refusal."""
    return max(MIN_PROTOCOL_VERSION, negotiate(frame_version))


REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,256}$"  # printable ASCII, no spaces
RequestId = Annotated[str, Meta(min_length=1, max_length=256, pattern=REQUEST_ID_PATTERN)]
# 128, not 64: a peer id is the configured name (up to 64 chars) + "-" + 12 hex digits.
PeerId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
Endpoint = Annotated[str, Meta(max_length=256, pattern=r"^(tcp|ipc)://.+$")]
U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
U31 = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Text = Annotated[str, Meta(max_length=1024)]
FetchToken = Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9_-]*$")]
BlockIds = Annotated[list[U31], Meta(max_length=1 << 20)]
Dtype = Literal["uint8", "int8", "float16", "bfloat16", "float32"]
Status = Literal["done", "failed", "in_doubt"]


class WireLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A pool's shape, declared at registration."""

    num_layers: Annotated[int, Meta(ge=1, le=4096)]
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 22)]
    block_bytes: Annotated[int, Meta(ge=1, le=1 << 30)]
    dtype: Dtype
    aux_slots: Annotated[int, Meta(ge=1, le=1 << 20)]
    aux_slot_bytes: Annotated[int, Meta(ge=64, le=1 << 20)]

    def to_layout(self) -> Layout:
        return Layout(**msgspec.structs.asdict(self))

    @classmethod
    def of(cls, layout: Layout) -> WireLayout:
        return cls(
            num_layers=layout.num_layers,
            num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            dtype=layout.dtype,  # type: ignore[arg-type]
            aux_slots=layout.aux_slots,
            aux_slot_bytes=layout.aux_slot_bytes,
        )


class _Msg(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    pass


NONCE_BYTES = 8
# A receiver may send the messages of one turn as one multipart message (one wake-up of
# each side's I/O thread instead of one per message): each frame after the routing id is
# one message, decoded and handled in order. At most this many frames.
MAX_BATCH = 64
NOTIFY_MAGIC = b"KN" + bytes([PROTOCOL_VERSION])
_NOTIFY_MAGICS = frozenset(b"KN" + bytes([v]) for v in SUPPORTED_VERSIONS)
_NOTIFY_HEAD = struct.Struct("<3sH")
_NOTIFY_RECORD = struct.Struct("<Q8sQI")

Notified = tuple[int, bytes, int, int]  # (fetch_id, nonce, nbytes, aux_bytes)


def encode_notification(records: list[Notified], version: int = PROTOCOL_VERSION) -> bytes:
    """The NIXL notification telling a receiver these fetches are done (module docstring),
    its magic carrying the peer's negotiated ``version``."""
    parts = [_NOTIFY_HEAD.pack(b"KN" + bytes([version]), len(records))]
    parts += [_NOTIFY_RECORD.pack(*r) for r in records]
    return b"".join(parts)


def decode_notification(payload: bytes) -> list[Notified] | None:
    """The records of a notification, or None if it is not one of ours (or malformed)."""
    if len(payload) < _NOTIFY_HEAD.size or payload[:3] not in _NOTIFY_MAGICS:
        return None
    _, count = _NOTIFY_HEAD.unpack_from(payload)
    if count > MAX_BATCH or len(payload) != _NOTIFY_HEAD.size + count * _NOTIFY_RECORD.size:
        return None
    return [
        _NOTIFY_RECORD.unpack_from(payload, _NOTIFY_HEAD.size + i * _NOTIFY_RECORD.size)  # type: ignore[misc]
        for i in range(count)
    ]


class Register(_Msg, tag="register", omit_defaults=True):
    """Receiver -> sender: who I am, where my results go, my NIXL agent and pool.

    ``topology``: the decode rank's record (kvxferd/transfer/topology.py), when its engine declared
    one. With a record on both sides the sender checks the pair with the reshard mapping
    instead of requiring an equal pool; without, the pools must be equal. Fields at their
    default are not sent (an older sender still reads a Register without a record).

    ``scratch_base`` / ``scratch_bytes`` (version 4): a region of the receiver's registered
    with the link's NIXL agent, outside the KV pool and the aux slots, that the sender may
    WRITE to measure the link (the link probe); 0 bytes: none, the sender does not probe.
    """

    receiver_id: PeerId
    result_endpoint: Endpoint
    agent_metadata: Annotated[bytes, Meta(max_length=1 << 20)]
    layout: WireLayout
    kv_base: U63  # address of the receiver's KV region (block 0 of layer 0)
    aux_base: U63  # address of the receiver's aux region (slot 0)
    device: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, Meta(ge=0, le=1024)] = 0
    topology: Topology | None = None
    scratch_base: U63 = 0
    scratch_bytes: Annotated[int, Meta(ge=0, le=256 << 20)] = 0


class RegisterReply(_Msg, tag="register_reply", omit_defaults=True):
    """Sender -> receiver: accepted, or refused with a reason.

    ``topology``: the sender's (prefill rank's) record, when it has one: the receiver
    plans its reads of the whole prefill instance from it (``instance_ranks``).
    """

    ok: bool
    sender_id: PeerId
    reason: Reason | None = None
    detail: Text = ""
    topology: Topology | None = None


class RequestData(_Msg, tag="request_data", omit_defaults=True):
    """Receiver -> sender: write request ``request_id`` into these blocks of mine.

    ``dst_blocks[i]`` receives the sender's i-th published block, for each layer in
    ``[layer_begin, layer_end)``. ``aux_slot`` (or -1) receives the auxiliary payload.
    """

    request_id: RequestId
    fetch_id: U63
    dst_blocks: BlockIds
    layer_begin: U31 = 0
    layer_end: U31 = 0  # 0 means "all layers"
    aux_slot: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1
    timeout_ms: Annotated[int, Meta(ge=1, le=3_600_000)] = 60_000
    # The receiver's own deadline, absolute: Unix time in ms on the receiver's clock (0: none).
    # The sender starts no write after min(arrival + timeout_ms, deadline_unix_ms + clock_skew_ms).
    deadline_unix_ms: U63 = 0
    # The fetch token the publisher issued for this request ("" when none was given); only
    # sent when set (fields at their default are omitted), so older senders still read it.
    token: FetchToken = ""
    # A random nonce of the receiver's: the fetch's last WRITE carries a NIXL notification
    # (``encode_notification``) instead of a done Result following it. b"": done Results.
    notify: Annotated[bytes, Meta(max_length=NONCE_BYTES)] = b""
    # True: the done Result carries ``digest`` (kvxferd/transfer/digest.py) over the bytes
    # written. Only sent when true: a sender that predates it refuses the RequestData
    # (malformed, unknown field), so a receiver asks only senders of this version.
    digest: bool = False


class Cancel(_Msg, tag="cancel"):
    """Receiver -> sender: stop ``fetch_id``; acknowledge once no write to it is in flight."""

    request_id: RequestId
    fetch_id: U63


class Result(_Msg, tag="result", omit_defaults=True):
    """Sender -> receiver: the one final result of a fetch.

    ``digest``: on a done Result of a fetch that asked for one (``RequestData.digest``),
    the 16-byte digest of the bytes written (digest.py); omitted otherwise, like every
    field at its default, so a receiver that predates it reads every Result it gets.
    """

    request_id: RequestId
    fetch_id: U63
    status: Status
    reason: Reason | None = None
    detail: Text = ""
    nbytes: U63 = 0
    aux_bytes: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    digest: Annotated[bytes, Meta(max_length=DIGEST_BYTES)] = b""
    # With reason ``moved``: the sender endpoint that holds the request now (version 4).
    moved_to: Endpoint | Literal[""] = ""


class CancelAck(_Msg, tag="cancel_ack"):
    """Sender -> receiver: no write toward ``fetch_id`` is in flight (unless ``in_doubt``)."""

    request_id: RequestId
    fetch_id: U63
    in_doubt: bool = False


class Reject(_Msg, tag="reject"):
    """Sender -> receiver: a message that could not be taken (malformed, unknown peer...)."""

    reason: Reason
    detail: Text = ""


class HandoverItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One published, unfetched request a draining sender offers (``Handover``)."""

    request_id: RequestId
    token: FetchToken = ""  # the fetch token it was published with ("" when none)
    blocks: Annotated[int, Meta(ge=1, le=1 << 20)] = 1
    num_layers: Annotated[int, Meta(ge=1, le=4096)] = 1
    aux_bytes: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    ttl_ms: Annotated[int, Meta(ge=1, le=2**31 - 1)] = 1  # what is left of its publish TTL
    expected_fetches: Annotated[int, Meta(ge=1, le=1 << 16)] = 1


class Handover(_Msg, tag="handover", omit_defaults=True):
    """Draining sender -> another sender's listener: please adopt these requests (version 4).

    The adopting sender fetches each one it accepts from ``sender_endpoint`` with the
    normal protocol (Register, RequestData with the token) and publishes it again under
    the same id and token (kvxferd/transfer/sender/adopt.py).
    """

    sender_endpoint: Endpoint
    items: Annotated[list[HandoverItem], Meta(max_length=4096)]


class HandoverRefusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: RequestId
    reason: Reason
    detail: Text = ""


class HandoverReply(_Msg, tag="handover_reply", omit_defaults=True):
    """Adopting sender -> draining sender (on its DEALER): what it takes (version 4).

    ``receiver_id``: the id its fetches register with, so the draining sender knows
    which fetch of each request is the move.
    """

    receiver_id: PeerId
    accepted: Annotated[list[RequestId], Meta(max_length=4096)] = []
    refused: Annotated[list[HandoverRefusal], Meta(max_length=4096)] = []


class MovedItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: RequestId
    ttl_ms: Annotated[int, Meta(ge=1, le=2**31 - 1)]  # how long the entry holds


class Moved(_Msg, tag="moved"):
    """Draining sender -> receiver result endpoint: these requests are at ``endpoint`` now
    (version 4). The receiver sends a fetch of one of them there directly."""

    endpoint: Endpoint
    items: Annotated[list[MovedItem], Meta(max_length=4096)]


ToSender = Register | RequestData | Cancel | Handover
ToReceiver = RegisterReply | Result | CancelAck | Reject | Moved | HandoverReply

_encoder = msgspec.msgpack.Encoder()
_to_sender = msgspec.msgpack.Decoder(ToSender)
_to_receiver = msgspec.msgpack.Decoder(ToReceiver)


def v4_only_parts(msg: _Msg) -> list[str]:
    """The V4_ONLY names ``msg`` carries: its message, and each of its fields not at its default."""
    name = type(msg).__name__
    if name in V4_ONLY:
        return [name]
    return [
        f"{name}.{f.name}"
        for f in msgspec.structs.fields(msg)
        if f"{name}.{f.name}" in V4_ONLY and getattr(msg, f.name) != f.default
    ]


def encode(msg: _Msg, version: int = PROTOCOL_VERSION) -> bytes:
    """One frame in ``version`` (the peer's, negotiated): header + msgpack body.

    A message or field that ``version`` does not have (V4_ONLY toward a version-3 peer)
    is a bug of the caller, never sent: ValueError.
    """
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"protocol version {version} is not one this side speaks")
    if version < 4 and V4_ONLY and (newer := v4_only_parts(msg)):
        raise ValueError(f"{', '.join(newer)} not in protocol version {version}")
    return MAGIC + bytes([version]) + _encoder.encode(msg)


def frame_version(frame: bytes) -> int:
    """The version byte of a frame that decoded (``decode_frame`` checked its header)."""
    return frame[2]


def decode_frame(
    decoder: msgspec.msgpack.Decoder,
    frames: list[bytes],
    max_bytes: int,
    magic: bytes = MAGIC,
    versions: frozenset[int] = SUPPORTED_VERSIONS,
    offers: type | None = None,
) -> object:
    """One frame ``magic + version + msgpack body`` checked step by step, or ProtocolError.

    The steps (frame count, size, header, version, body) and their reasons are
    the table of docs/protocol.md section 2 (Frames); the engine protocol
    (magic ``KE``) goes through the same steps. ``versions``: those this side speaks;
    ``offers``: the message type (Register) that may come in a higher version too (an
    offer, answered in the lower one).
    """
    if len(frames) != 1:
        raise ProtocolError(Reason.MALFORMED, f"expected 1 frame, got {len(frames)}")
    frame = frames[0]
    if len(frame) > max_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"frame of {len(frame)} bytes > {max_bytes}")
    if len(frame) < 3 or frame[:2] != magic:
        raise ProtocolError(Reason.MALFORMED, f"missing {magic.decode()} header")
    if frame[2] not in versions:
        # A newer peer's offer (a Register) is read and answered in our newest version;
        # anything else in a version we do not speak, valid or not, is refused as such.
        if offers is None or frame[2] < max(versions):
            raise _unsupported(frame[2], versions)
        try:
            offer = decoder.decode(memoryview(frame)[3:])
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            raise _unsupported(frame[2], versions) from None
        if not isinstance(offer, offers):
            raise _unsupported(frame[2], versions)
        return offer
    try:
        return decoder.decode(memoryview(frame)[3:])
    except msgspec.ValidationError as e:
        text = str(e)
        unknown_tag = "Invalid value" in text and "$.t" in text
        raise ProtocolError(
            Reason.UNKNOWN_MESSAGE if unknown_tag else Reason.MALFORMED, text[:300]
        ) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(Reason.MALFORMED, str(e)[:300]) from None
    except RecursionError:  # a tagged union skips fields before the tag: ~1 KB of [[[...]]]
        raise ProtocolError(Reason.MALFORMED, "nested deeper than the decoder's limit") from None


def _unsupported(version: int, versions: frozenset[int]) -> ProtocolError:
    spoken = ", ".join(str(v) for v in sorted(versions))
    return ProtocolError(
        Reason.UNSUPPORTED_VERSION, f"version {version}, this side speaks {spoken}"
    )


def decode_to_sender(frames: list[bytes], max_bytes: int) -> ToSender:
    """Decode a frame received by a sender, or raise ProtocolError."""
    return decode_frame(_to_sender, frames, max_bytes, offers=Register)  # type: ignore[return-value]


def decode_to_receiver(frames: list[bytes], max_bytes: int) -> ToReceiver:
    """Decode a frame received by a receiver, or raise ProtocolError."""
    return decode_frame(_to_receiver, frames, max_bytes)  # type: ignore[return-value]


def check_compatible(
    sender: Layout,
    receiver: WireLayout,
    own: Topology | None = None,
    theirs: Topology | None = None,
) -> str | None:
    """Why a receiver's pool cannot take this sender's blocks, or None when it can.

    Without a topology record on both sides the pools must be equal (block size,
    layer count, dtype). With both, the receiver's record must describe its pool and
    the reshard mapping must serve the pair (``reshard.check_pair``: its refusal text).
    """
    if own is not None and theirs is not None:
        if receiver.dtype != sender.dtype:
            return f"dtype {receiver.dtype} != {sender.dtype}"
        if (receiver.block_bytes, receiver.num_layers) != (
            theirs.block_bytes,
            theirs.num_stage_layers,
        ):
            return (
                f"topology does not describe the registered pool: block_bytes "
                f"{receiver.block_bytes}, num_layers {receiver.num_layers} != the record's "
                f"{theirs.block_bytes}, {theirs.num_stage_layers}"
            )
        try:
            check_pair(own, theirs)
        except RejectedError as e:
            return e.detail
        return None
    if receiver.dtype != sender.dtype:
        return f"dtype {receiver.dtype} != {sender.dtype}"
    if receiver.block_bytes != sender.block_bytes:
        return f"block_bytes {receiver.block_bytes} != {sender.block_bytes}"
    if receiver.num_layers != sender.num_layers:
        return f"num_layers {receiver.num_layers} != {sender.num_layers}"
    return None
