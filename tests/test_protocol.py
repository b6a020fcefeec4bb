"""The wire protocol (protocol.py): round trips, framing, bounds, and hostile input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import KvxferdError, ProtocolError, Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.layout import Layout

MAX = 1 << 22  # a max_bytes far above every frame built here, unless a test says otherwise

LAYOUT = wire.WireLayout(
    num_layers=2, num_blocks=64, block_bytes=256, dtype="uint8", aux_slots=8, aux_slot_bytes=4096
)
LAYOUT_MAP = msgspec.structs.asdict(LAYOUT)

# One message of each type with every field set away from its default.
TO_SENDER: list[wire.ToSender] = [
    wire.Register(
        receiver_id="kvxferd-receiver-0123456789ab",
        result_endpoint="tcp://127.0.0.1:5556",
        agent_metadata=bytes(range(256)) * 4,
        layout=LAYOUT,
        kv_base=2**63 - 1,
        aux_base=4096,
        device="VRAM",
        device_id=3,
    ),
    wire.RequestData(
        request_id="req-1",
        fetch_id=2**63 - 1,
        dst_blocks=[0, 7, 2**31 - 1],
        layer_begin=1,
        layer_end=2,
        aux_slot=5,
        timeout_ms=3_600_000,
    ),
    wire.Cancel(request_id="req-1", fetch_id=7),
]
TO_RECEIVER: list[wire.ToReceiver] = [
    wire.RegisterReply(ok=False, sender_id="s-1", reason=Reason.INCOMPATIBLE, detail="dtype"),
    wire.Result(
        request_id="req-1",
        fetch_id=7,
        status="in_doubt",
        reason=Reason.STALLED,
        detail="x" * 1024,
        nbytes=2**63 - 1,
        aux_bytes=1 << 20,
    ),
    wire.CancelAck(request_id="req-1", fetch_id=7, in_doubt=True),
    wire.Reject(reason=Reason.UNKNOWN_PEER, detail="REGISTER first"),
]

# The smallest valid wire map of each type (required fields only).
MINIMAL: dict[str, dict[str, Any]] = {
    "register": {
        "t": "register",
        "receiver_id": "r",
        "result_endpoint": "ipc:///tmp/r",
        "agent_metadata": b"",
        "layout": LAYOUT_MAP,
        "kv_base": 0,
        "aux_base": 0,
    },
    "request_data": {"t": "request_data", "request_id": "q", "fetch_id": 0, "dst_blocks": []},
    "cancel": {"t": "cancel", "request_id": "q", "fetch_id": 0},
    "register_reply": {"t": "register_reply", "ok": True, "sender_id": "s"},
    "result": {"t": "result", "request_id": "q", "fetch_id": 0, "status": "done"},
    "cancel_ack": {"t": "cancel_ack", "request_id": "q", "fetch_id": 0},
    "reject": {"t": "reject", "reason": "malformed"},
}
SENDER_TAGS = {"register", "request_data", "cancel"}


def frame(body: Any) -> list[bytes]:
    """One kvxferd frame around an arbitrary msgpack body."""
    return [wire.HEADER + msgspec.msgpack.encode(body)]


def decoder_for(tag: str):  # type: ignore[no-untyped-def]
    return wire.decode_to_sender if tag in SENDER_TAGS else wire.decode_to_receiver


def reason_of(decode, frames: list[bytes], max_bytes: int = MAX) -> Reason:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as info:
        decode(frames, max_bytes)
    return info.value.reason


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("msg", TO_SENDER, ids=lambda m: type(m).__name__)
def test_every_message_to_a_sender_round_trips(msg: wire.ToSender) -> None:
    """A message a receiver sends decodes, on the sender, to an equal message."""
    assert wire.decode_to_sender([wire.encode(msg)], MAX) == msg


@pytest.mark.parametrize("msg", TO_RECEIVER, ids=lambda m: type(m).__name__)
def test_every_message_to_a_receiver_round_trips(msg: wire.ToReceiver) -> None:
    """A message a sender sends decodes, on the receiver, to an equal message."""
    assert wire.decode_to_receiver([wire.encode(msg)], MAX) == msg


@pytest.mark.parametrize("msg", [*TO_SENDER, *TO_RECEIVER], ids=lambda m: type(m).__name__)
def test_a_frame_is_the_header_then_a_plain_msgpack_map_tagged_t(msg: wire._Msg) -> None:
    """Every frame is b"KX\\x04" followed by a msgpack map any msgpack library can read, tag in "t"."""
    data = wire.encode(msg)
    assert data[:3] == b"KX\x04"
    body = msgspec.msgpack.decode(data[3:])  # untyped: plain msgpack, no extension types
    assert isinstance(body, dict)
    assert body["t"] == msg.__struct_config__.tag


@pytest.mark.parametrize("tag", sorted(MINIMAL))
def test_omitted_optional_fields_take_their_defaults(tag: str) -> None:
    """A map with only the required fields decodes, and every omitted field gets its default."""
    msg = decoder_for(tag)(frame(MINIMAL[tag]), MAX)
    assert msg.__struct_config__.tag == tag
    defaults = {
        "register": {"device": "DRAM", "device_id": 0},
        "request_data": {"layer_begin": 0, "layer_end": 0, "aux_slot": -1, "timeout_ms": 60_000},
        "cancel": {},
        "register_reply": {"reason": None, "detail": ""},
        "result": {"reason": None, "detail": "", "nbytes": 0, "aux_bytes": 0},
        "cancel_ack": {"in_doubt": False},
        "reject": {"detail": ""},
    }[tag]
    for name, value in defaults.items():
        assert getattr(msg, name) == value


def test_the_tag_may_come_anywhere_in_the_map() -> None:
    """The "t" key need not be the map's first key."""
    body = {"request_id": "q", "fetch_id": 3, "t": "cancel"}
    assert wire.decode_to_sender(frame(body), MAX) == wire.Cancel(request_id="q", fetch_id=3)


def test_a_null_reason_is_the_same_as_no_reason() -> None:
    """A Result whose reason is msgpack nil decodes with reason None (what the encoder writes)."""
    body = {**MINIMAL["result"], "reason": None}
    assert wire.decode_to_receiver(frame(body), MAX).reason is None


def test_every_reason_code_travels_in_a_reject() -> None:
    """Each Reason value is accepted on the wire and comes back as the same enum member."""
    for reason in Reason:
        msg = wire.decode_to_receiver([wire.encode(wire.Reject(reason=reason))], MAX)
        assert msg.reason is reason


def test_wire_layout_converts_to_and_from_a_layout() -> None:
    """WireLayout.of and to_layout are inverses."""
    layout = Layout(
        num_layers=3, num_blocks=9, block_bytes=512, dtype="float16", aux_slots=2, aux_slot_bytes=64
    )
    assert wire.WireLayout.of(layout).to_layout() == layout


def test_a_peer_id_made_from_the_longest_configured_name_fits() -> None:
    """A receiver id of a 64-char name plus "-" and 12 hex digits is a valid PeerId."""
    reg = msgspec.structs.replace(TO_SENDER[0], receiver_id="n" * 64 + "-0123456789ab")
    assert wire.decode_to_sender([wire.encode(reg)], MAX) == reg


# -- framing -------------------------------------------------------------------------------


@pytest.mark.parametrize("decode", [wire.decode_to_sender, wire.decode_to_receiver])
@pytest.mark.parametrize("count", [0, 2, 3])
def test_anything_but_exactly_one_frame_is_malformed(decode, count: int) -> None:  # type: ignore[no-untyped-def]
    """A message of zero or several frames is refused as malformed, even if each frame is valid."""
    frames = [wire.encode(wire.Cancel(request_id="q", fetch_id=1))] * count
    assert reason_of(decode, frames) is Reason.MALFORMED


@pytest.mark.parametrize("data", [b"", b"K", b"KX", b"XK\x01\x80", b"kx\x01\x80", b"\x80"])
def test_a_frame_without_the_kx_header_is_malformed(data: bytes) -> None:
    """A frame that does not start with b"KX" plus a version byte is malformed."""
    assert reason_of(wire.decode_to_sender, [data]) is Reason.MALFORMED


@pytest.mark.parametrize("version", [0, 1, 2, 5, 255])
def test_another_version_is_unsupported(version: int) -> None:
    """A frame with a version byte other than 3 and 4 (an older peer's 2 too) is
    unsupported_version; only a Register may come in a newer one (next test)."""
    good = wire.encode(wire.Cancel(request_id="q", fetch_id=1))
    data = b"KX" + bytes([version]) + good[3:]
    assert reason_of(wire.decode_to_sender, [data]) is Reason.UNSUPPORTED_VERSION
    assert reason_of(wire.decode_to_receiver, [data]) is Reason.UNSUPPORTED_VERSION


def test_a_frame_over_max_bytes_is_too_large_and_one_at_max_bytes_is_not() -> None:
    """The frame size limit is inclusive: len == max_bytes decodes, max_bytes + 1 is too_large."""
    data = wire.encode(wire.Cancel(request_id="q", fetch_id=1))
    assert wire.decode_to_sender([data], len(data)) == wire.Cancel(request_id="q", fetch_id=1)
    assert reason_of(wire.decode_to_sender, [data], len(data) - 1) is Reason.TOO_LARGE


def test_the_size_limit_is_checked_before_anything_is_parsed() -> None:
    """An oversize frame of garbage is too_large, not malformed: nothing is parsed past the limit."""
    assert reason_of(wire.decode_to_sender, [b"\xff" * 100], 99) is Reason.TOO_LARGE


# -- bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["nope", "REGISTER", "", "register_v2"])
def test_an_unknown_tag_is_unknown_message(tag: str) -> None:
    """A map whose "t" names no message of this version is unknown_message."""
    body = {**MINIMAL["cancel"], "t": tag}
    assert reason_of(wire.decode_to_sender, frame(body)) is Reason.UNKNOWN_MESSAGE
    assert reason_of(wire.decode_to_receiver, frame(body)) is Reason.UNKNOWN_MESSAGE


@pytest.mark.parametrize("tag", sorted(MINIMAL))
def test_a_message_for_the_other_side_is_unknown_message(tag: str) -> None:
    """A sender does not accept receiver-bound tags and vice versa: unknown_message."""
    wrong = wire.decode_to_receiver if tag in SENDER_TAGS else wire.decode_to_sender
    assert reason_of(wrong, frame(MINIMAL[tag])) is Reason.UNKNOWN_MESSAGE


@pytest.mark.parametrize(
    "body",
    [
        {"request_id": "q", "fetch_id": 1},  # no tag
        {**MINIMAL["cancel"], "t": 1},  # tag of the wrong type
        {**MINIMAL["cancel"], "t": None},
        [["t", "cancel"]],  # not a map
        "cancel",
        42,
        None,
        {**MINIMAL["cancel"], "extra": 1},  # unknown field
        {"t": "cancel", "request_id": "q"},  # missing required field
        {**MINIMAL["cancel"], "fetch_id": "1"},  # wrong types
        {**MINIMAL["cancel"], "fetch_id": 1.0},
        {**MINIMAL["cancel"], "fetch_id": True},
        {**MINIMAL["cancel"], "request_id": b"q"},
        {**MINIMAL["register"], "agent_metadata": "text, not bin"},
        {**MINIMAL["register"], "layout": {**LAYOUT_MAP, "extra": 1}},
        {**MINIMAL["register"], "device": None},
        {**MINIMAL["request_data"], "dst_blocks": [1, "2"]},
        {**MINIMAL["request_data"], "dst_blocks": {"0": 1}},
    ],
    ids=repr,
)
def test_a_body_that_is_not_a_valid_message_is_malformed(body: Any) -> None:
    """Missing or wrong-typed tags, unknown or missing fields and wrong types are malformed."""
    assert reason_of(wire.decode_to_sender, frame(body)) is Reason.MALFORMED


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # the one byte msgpack never uses
        b"\x81\xa1t",  # truncated map
        b"\xdf\xff\xff\xff\xff",  # a map that claims 4G entries
        b"\xc7\x01\x01x",  # an extension type
        b"\xd4\x00\x00",  # fixext: the kind pickle-style codecs hook into
        bytes(range(256)),
    ],
    ids=lambda d: d[:8].hex(),
)
def test_garbage_after_the_header_is_malformed(data: bytes) -> None:
    """Bytes that are not a msgpack map (bad, truncated, oversized claims, ext types) are malformed."""
    assert reason_of(wire.decode_to_sender, [wire.HEADER + data]) is Reason.MALFORMED
    assert reason_of(wire.decode_to_receiver, [wire.HEADER + data]) is Reason.MALFORMED


@pytest.mark.parametrize("tag", sorted(MINIMAL))
def test_bytes_after_a_valid_message_are_malformed(tag: str) -> None:
    """A frame is exactly one msgpack map: trailing bytes after a valid message are malformed."""
    data = wire.HEADER + msgspec.msgpack.encode(MINIMAL[tag]) + b"\x00"
    assert reason_of(decoder_for(tag), [data]) is Reason.MALFORMED


# (tag, field, a value just outside its bounds, a value at its bound)
BOUNDS: list[tuple[str, str, Any, Any]] = [
    ("cancel", "request_id", "", "q"),
    ("cancel", "request_id", "x" * 257, "x" * 256),
    ("cancel", "request_id", "has space", "no-space!~"),
    ("cancel", "request_id", "caf\u00e9", "cafe"),
    ("cancel", "request_id", "tab\t", "tab"),
    ("cancel", "fetch_id", -1, 0),
    ("cancel", "fetch_id", 2**63, 2**63 - 1),
    ("register", "receiver_id", "", "r"),
    ("register", "receiver_id", "r" * 129, "r" * 128),
    ("register", "receiver_id", "a/b", "a_b.c:d-e"),
    ("register", "result_endpoint", "http://x:1", "tcp://x:1"),
    ("register", "result_endpoint", "tcp://", "tcp://h"),
    ("register", "result_endpoint", "ipc://" + "p" * 251, "ipc://" + "p" * 250),
    ("register", "agent_metadata", b"m" * ((1 << 20) + 1), b"m" * (1 << 20)),
    ("register", "kv_base", -1, 0),
    ("register", "kv_base", 2**63, 2**63 - 1),
    ("register", "aux_base", -1, 2**63 - 1),
    ("register", "device", "GPU", "VRAM"),
    ("register", "device_id", -1, 0),
    ("register", "device_id", 1025, 1024),
    ("register_reply", "sender_id", "s" * 129, "s" * 128),
    ("register_reply", "sender_id", "s s", "s"),
    ("register_reply", "reason", "nope", "busy"),
    ("register_reply", "detail", "d" * 1025, "d" * 1024),
    ("request_data", "dst_blocks", [-1], [0]),
    ("request_data", "dst_blocks", [2**31], [2**31 - 1]),
    ("request_data", "layer_begin", -1, 0),
    ("request_data", "layer_begin", 2**31, 2**31 - 1),
    ("request_data", "layer_end", -1, 2**31 - 1),
    ("request_data", "aux_slot", -2, -1),
    ("request_data", "aux_slot", 2**31, 2**31 - 1),
    ("request_data", "timeout_ms", 0, 1),
    ("request_data", "timeout_ms", 3_600_001, 3_600_000),
    ("result", "status", "ok", "done"),
    ("result", "status", "DONE", "failed"),
    ("result", "reason", "nope", "stalled"),
    ("result", "detail", "d" * 1025, "d" * 1024),
    ("result", "nbytes", -1, 2**63 - 1),
    ("result", "aux_bytes", -1, 0),
    ("result", "aux_bytes", (1 << 20) + 1, 1 << 20),
    ("cancel_ack", "in_doubt", 1, True),
    ("reject", "reason", None, "too_large"),
    ("reject", "reason", "", "malformed"),
    ("reject", "detail", "d" * 1025, ""),
]


@pytest.mark.parametrize(("tag", "field", "bad", "edge"), BOUNDS, ids=lambda v: repr(v)[:24])
def test_a_field_outside_its_bounds_is_malformed_and_one_at_its_bound_is_not(
    tag: str, field: str, bad: Any, edge: Any
) -> None:
    """Each field's bound is enforced at decode (malformed past it) and is inclusive (valid at it)."""
    decode = decoder_for(tag)
    assert reason_of(decode, frame({**MINIMAL[tag], field: bad})) is Reason.MALFORMED
    assert getattr(decode(frame({**MINIMAL[tag], field: edge}), MAX), field) == edge


LAYOUT_BOUNDS: list[tuple[str, Any, Any]] = [
    ("num_layers", 0, 1),
    ("num_layers", 4097, 4096),
    ("num_blocks", 0, 1),
    ("num_blocks", (1 << 22) + 1, 1 << 22),
    ("block_bytes", 0, 1),
    ("block_bytes", (1 << 30) + 1, 1 << 30),
    ("dtype", "int4", "bfloat16"),
    ("aux_slots", 0, 1),
    ("aux_slots", (1 << 20) + 1, 1 << 20),
    ("aux_slot_bytes", 63, 64),
    ("aux_slot_bytes", (1 << 20) + 1, 1 << 20),
]


@pytest.mark.parametrize(("field", "bad", "edge"), LAYOUT_BOUNDS, ids=lambda v: repr(v)[:24])
def test_a_layout_field_outside_its_bounds_is_malformed(field: str, bad: Any, edge: Any) -> None:
    """Each WireLayout bound is enforced inside a Register, inclusively."""
    body = {**MINIMAL["register"], "layout": {**LAYOUT_MAP, field: bad}}
    assert reason_of(wire.decode_to_sender, frame(body)) is Reason.MALFORMED
    body = {**MINIMAL["register"], "layout": {**LAYOUT_MAP, field: edge}}
    assert getattr(wire.decode_to_sender(frame(body), MAX).layout, field) == edge


def test_a_block_list_over_its_length_bound_is_malformed() -> None:
    """dst_blocks holds at most 2**20 ids; one more is malformed."""
    body = {**MINIMAL["request_data"], "dst_blocks": [0] * ((1 << 20) + 1)}
    assert reason_of(wire.decode_to_sender, frame(body), 1 << 23) is Reason.MALFORMED


def test_an_invalid_literal_inside_a_message_is_not_mistaken_for_an_unknown_tag() -> None:
    """A bad enum value in a field (status, dtype, reason) is malformed, never unknown_message."""
    bad_status = {**MINIMAL["result"], "status": "nope"}
    assert reason_of(wire.decode_to_receiver, frame(bad_status)) is Reason.MALFORMED
    bad_dtype = {**MINIMAL["register"], "layout": {**LAYOUT_MAP, "dtype": "nope"}}
    assert reason_of(wire.decode_to_sender, frame(bad_dtype)) is Reason.MALFORMED


def test_a_protocol_error_is_a_kvxferd_error_with_a_short_detail() -> None:
    """A ProtocolError is a KvxferdError whose detail fits a Reject (<= 1024 chars)."""
    body = {**MINIMAL["cancel"], "request_id": "x" * 100_000}
    with pytest.raises(ProtocolError) as info:
        wire.decode_to_sender(frame(body), MAX)
    assert isinstance(info.value, KvxferdError)
    assert info.value.reason is Reason.MALFORMED
    assert len(info.value.detail) <= 1024
    wire.encode(wire.Reject(reason=info.value.reason, detail=info.value.detail))


# -- compatibility -------------------------------------------------------------------------

SENDER_LAYOUT = LAYOUT.to_layout()


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "int8"), ("block_bytes", 512), ("num_layers", 3)],
)
def test_a_pool_with_another_dtype_block_size_or_layer_count_is_incompatible(
    field: str, value: Any
) -> None:
    """check_compatible names the first mismatching field among dtype, block_bytes and num_layers."""
    receiver = msgspec.structs.replace(LAYOUT, **{field: value})
    why = wire.check_compatible(SENDER_LAYOUT, receiver)
    assert why is not None and why.startswith(field)


def test_a_pool_with_the_same_shape_is_compatible() -> None:
    """The same dtype, block size and layer count, whatever the aux slots, is compatible."""
    receiver = msgspec.structs.replace(LAYOUT, aux_slots=1, aux_slot_bytes=64)
    assert wire.check_compatible(SENDER_LAYOUT, receiver) is None


# -- hostile input, by property ------------------------------------------------------------

DECODERS = [wire.decode_to_sender, wire.decode_to_receiver]
TAGS = sorted(MINIMAL)
FIELD_NAMES = sorted(
    {"t", *LAYOUT_MAP} | {f for m in (*TO_SENDER, *TO_RECEIVER) for f in m.__struct_fields__}
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.text(max_size=12) | st.sampled_from(["t", "fetch_id", "layout"]), inner, max_size=6
        )
    ),
    max_leaves=8,
)


def _only_messages_or_protocol_errors(frames: list[bytes], max_bytes: int = MAX) -> None:
    for decode in DECODERS:
        try:
            msg = decode(frames, max_bytes)
        except ProtocolError as e:
            assert isinstance(e.reason, Reason)
        else:
            assert isinstance(msg, wire._Msg)


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=512), prefix=st.sampled_from([b"", b"KX", wire.HEADER]))
def test_arbitrary_bytes_decode_to_a_message_or_a_protocol_error(
    data: bytes, prefix: bytes
) -> None:
    """Any bytes, with or without the header in front, give a message or a ProtocolError, nothing else."""
    _only_messages_or_protocol_errors([prefix + data])


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), max_size=4), max_bytes=st.integers(0, 128))
def test_arbitrary_frame_lists_decode_to_a_message_or_a_protocol_error(
    frames: list[bytes], max_bytes: int
) -> None:
    """Any number of frames of any bytes under any size limit give a message or a ProtocolError."""
    _only_messages_or_protocol_errors(frames, max_bytes)


@settings(max_examples=300, deadline=None)
@given(
    tag=st.sampled_from(TAGS),
    changes=st.dictionaries(
        st.sampled_from(FIELD_NAMES) | st.text(max_size=8), msgpack_values, max_size=4
    ),
    data=st.data(),
)
def test_mutated_messages_decode_to_a_message_or_a_protocol_error(
    tag: str, changes: dict[str, Any], data: st.DataObject
) -> None:
    """A valid map with fields replaced, added or removed gives a message or a ProtocolError."""
    body = {**MINIMAL[tag], **changes}
    for key in data.draw(st.lists(st.sampled_from(sorted(body)), max_size=2)):
        body.pop(key, None)
    _only_messages_or_protocol_errors(frame(body))


request_ids = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=256
)


@settings(max_examples=200, deadline=None)
@given(
    msg=st.builds(
        wire.RequestData,
        request_id=request_ids,
        fetch_id=st.integers(0, 2**63 - 1),
        dst_blocks=st.lists(st.integers(0, 2**31 - 1), max_size=64),
        layer_begin=st.integers(0, 2**31 - 1),
        layer_end=st.integers(0, 2**31 - 1),
        aux_slot=st.integers(-1, 2**31 - 1),
        timeout_ms=st.integers(1, 3_600_000),
    )
)
def test_any_in_bounds_request_round_trips(msg: wire.RequestData) -> None:
    """Every RequestData whose fields are inside their bounds survives encode and decode unchanged."""
    assert wire.decode_to_sender([wire.encode(msg)], MAX) == msg


@settings(max_examples=200, deadline=None)
@given(
    msg=st.builds(
        wire.Result,
        request_id=request_ids,
        fetch_id=st.integers(0, 2**63 - 1),
        status=st.sampled_from(["done", "failed", "in_doubt"]),
        reason=st.none() | st.sampled_from(list(Reason)),
        detail=st.text(max_size=1024),
        nbytes=st.integers(0, 2**63 - 1),
        aux_bytes=st.integers(0, 1 << 20),
    )
)
def test_any_in_bounds_result_round_trips(msg: wire.Result) -> None:
    """Every Result whose fields are inside their bounds survives encode and decode unchanged."""
    assert wire.decode_to_receiver([wire.encode(msg)], MAX) == msg
