"""What the sender's listener does with hostile, malformed or premature input (real ZMQ, real NIXL).

A raw ZMQ DEALER plays a misbehaving (or hand-written) receiver against a real
:class:`~kvxferd.transfer.sender.Sender`: every message it sends must get one typed reply
with the right reason, be counted in ``sender.stats``, and leave the listener
able to serve a real :class:`~kvxferd.transfer.receiver.Receiver` byte for byte.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import TxState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(10)]

POOL = dict(num_layers=2, num_blocks=64, block_elems=256, dtype="uint8")
REPLY_S = 5.0  # deadline for one reply; a healthy listener answers in milliseconds
MAX = 1 << 22
_request_ids = itertools.count(1)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def make_sender(request: pytest.FixtureRequest) -> Callable[..., Sender]:
    """Start Senders on a free port; each is shut down by a finalizer."""

    def make(**overrides: Any) -> Sender:
        settings = load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, **overrides)
        sender = Sender(settings)
        request.addfinalizer(lambda: sender.shutdown(timeout=5))
        return sender.start()

    return make


@pytest.fixture
def sender(make_sender: Callable[..., Sender]) -> Sender:
    return make_sender()


@pytest.fixture
def make_receiver(request: pytest.FixtureRequest) -> Callable[..., Receiver]:
    """Start Receivers; each is shut down by a finalizer."""

    def make(**overrides: Any) -> Receiver:
        receiver = Receiver(load_receiver_settings(pool=POOL, **overrides))
        request.addfinalizer(lambda: receiver.shutdown(timeout=5))
        return receiver.start()

    return make


@pytest.fixture
def receiver(make_receiver: Callable[..., Receiver]) -> Receiver:
    return make_receiver()


@pytest.fixture
def raw(sender: Sender) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER connected to the sender's listener, as a receiver's would be."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.endpoint)
    yield sock
    sock.close(linger=0)


@pytest.fixture
def result_router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A bare ROUTER a hand-written receiver would bind for Results and CancelAcks."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(linger=0)


# -- helpers -------------------------------------------------------------------------------


def recv(sock: zmq.Socket[bytes], timeout_s: float = REPLY_S) -> wire.ToReceiver:
    """The next message on ``sock`` (a ROUTER's routing id stripped), or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            frames = sock.recv_multipart()
            if sock.type == zmq.ROUTER:
                frames = frames[1:]
            return wire.decode_to_receiver(frames, MAX)
    raise AssertionError(f"no reply within {timeout_s}s")


def expect_reject(sock: zmq.Socket[bytes], reason: Reason) -> wire.Reject:
    reply = recv(sock)
    assert isinstance(reply, wire.Reject), reply
    assert reply.reason is reason, reply
    return reply


def expect_result(
    sock: zmq.Socket[bytes], msg: wire.RequestData, status: str, reason: Reason | None
) -> wire.Result:
    reply = recv(sock)
    assert isinstance(reply, wire.Result), reply
    assert (reply.request_id, reply.fetch_id) == (msg.request_id, msg.fetch_id)
    assert (reply.status, reply.reason) == (status, reason), reply
    return reply


def assert_next_reply_is_to_a_probe(sock: zmq.Socket[bytes]) -> None:
    """Nothing else is queued for ``sock``: the listener answers in order, so a probe's reply comes next."""
    sock.send(b"probe")
    reply = expect_reject(sock, Reason.MALFORMED)
    assert "header" in reply.detail


def rejected(sender: Sender) -> dict[str, int]:
    return {k: v for k, v in sender.stats.snapshot().items() if k.startswith("rejected_")}


def request(**fields: Any) -> wire.RequestData:
    fields.setdefault("request_id", f"req-{next(_request_ids)}")
    fields.setdefault("fetch_id", next(_request_ids))
    fields.setdefault("dst_blocks", [1, 2])
    return wire.RequestData(**fields)


def assert_serves_a_transfer(sender: Sender, receiver: Receiver) -> None:
    """A real receiver registers (if it has not) and fetches a request byte for byte, with its aux."""
    src, dst = [3, 9], [50, 20]
    data = torch.randint(
        0, 256, (POOL["num_layers"], len(src), POOL["block_elems"]), dtype=torch.uint8
    )
    sender.pool.kv[:, src] = data
    rid, aux = f"ok-{next(_request_ids)}", bytes(random.randbytes(100))
    tx = sender.publish(rid, src, aux=aux)
    rx = receiver.fetch(rid, sender.endpoint, dst)
    outcome = rx.wait(REPLY_S)
    assert outcome is not None and outcome.ok, outcome
    assert torch.equal(receiver.pool.kv[:, dst], data)
    assert outcome.aux == aux
    tx_outcome = tx.wait(REPLY_S)
    assert tx_outcome is not None and tx_outcome.state is TxState.COMPLETE
    assert tx.close(REPLY_S) and rx.close(REPLY_S)
    assert sender.stats.get("listener_errors") == 0


def register_raw(
    sock: zmq.Socket[bytes], receiver: Receiver, result_endpoint: str
) -> wire.Register:
    """Register a bare DEALER as a peer that writes into ``receiver``'s pool (its NIXL agent)."""
    reg = wire.Register(
        receiver_id="hand-written",
        result_endpoint=result_endpoint,
        agent_metadata=receiver.agents.metadata(),
        layout=wire.WireLayout.of(receiver.pool.layout),
        kv_base=receiver.pool.kv_base,
        aux_base=receiver.pool.aux_base,
    )
    sock.send(wire.encode(reg))
    reply = recv(sock)
    assert isinstance(reply, wire.RegisterReply) and reply.ok, reply
    return reg


# -- frames that are not messages ----------------------------------------------------------

GARBAGE = {
    "empty": b"",
    "text": b"hello, sender",
    "zeros": bytes(64),
    "header-only": wire.HEADER,
    "bad-msgpack": wire.HEADER + b"\xc1",
    "not-a-map": wire.HEADER + msgspec.msgpack.encode([1, 2, 3]),
    "missing-tag": wire.HEADER + msgspec.msgpack.encode({"request_id": "q", "fetch_id": 1}),
    "pickle": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.",
}


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_frame_that_is_not_a_message_gets_a_malformed_reject(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes], data: bytes
) -> None:
    """Garbage gets one Reject(malformed), counted as rejected_malformed, and the listener keeps serving."""
    raw.send(data)
    expect_reject(raw, Reason.MALFORMED)
    assert rejected(sender) == {"rejected_malformed": 1}
    assert_serves_a_transfer(sender, receiver)


@pytest.mark.parametrize("version", [0, 1, 2, 5, 255])
def test_another_protocol_version_gets_an_unsupported_version_reject(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes], version: int
) -> None:
    """A frame in a version this sender does not speak (not 3 or 4) gets Reject(unsupported_version), counted, and the listener keeps serving."""
    good = wire.encode(wire.Cancel(request_id="q", fetch_id=1))
    raw.send(b"KX" + bytes([version]) + good[3:])
    reply = expect_reject(raw, Reason.UNSUPPORTED_VERSION)
    assert str(version) in reply.detail
    assert rejected(sender) == {"rejected_unsupported_version": 1}
    assert_serves_a_transfer(sender, receiver)


def test_the_frames_of_one_multipart_message_are_handled_one_by_one_in_order(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A receiver batches the messages of one turn as one multipart message: each frame is
    one message, handled (and refused) on its own, in order."""
    frame = wire.encode(wire.Cancel(request_id="q", fetch_id=1))
    raw.send_multipart([b"garbage", frame])
    expect_reject(raw, Reason.MALFORMED)
    reply = expect_reject(raw, Reason.UNKNOWN_PEER)  # the Cancel, before any Register
    assert "CANCEL before REGISTER" in reply.detail
    assert rejected(sender) == {"rejected_malformed": 1, "rejected_unknown_peer": 1}
    assert_serves_a_transfer(sender, receiver)


def test_a_message_of_more_frames_than_a_batch_gets_exactly_one_malformed_reject(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """More than MAX_BATCH frames in one message are one malformed message, none handled."""
    frame = wire.encode(wire.Cancel(request_id="q", fetch_id=1))
    raw.send_multipart([frame] * (wire.MAX_BATCH + 1))
    reply = expect_reject(raw, Reason.MALFORMED)
    assert f"at most {wire.MAX_BATCH}" in reply.detail
    assert_next_reply_is_to_a_probe(raw)
    assert rejected(sender) == {"rejected_malformed": 2}  # the message and the probe
    assert sender.stats.get("cancels") == 0
    assert_serves_a_transfer(sender, receiver)


@pytest.mark.parametrize(
    "tag", ["nope", "register_v2", "result", "register_reply", "cancel_ack", "reject"]
)
def test_an_unknown_or_receiver_bound_tag_gets_an_unknown_message_reject(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes], tag: str
) -> None:
    """A tag the sender does not take (unknown, or meant for a receiver) gets Reject(unknown_message)."""
    raw.send(wire.HEADER + msgspec.msgpack.encode({"t": tag, "request_id": "q", "fetch_id": 1}))
    expect_reject(raw, Reason.UNKNOWN_MESSAGE)
    assert rejected(sender) == {"rejected_unknown_message": 1}
    assert_serves_a_transfer(sender, receiver)


OUT_OF_BOUNDS = {
    "request_id-space": {"t": "cancel", "request_id": "a b", "fetch_id": 1},
    "fetch_id-negative": {"t": "cancel", "request_id": "q", "fetch_id": -1},
    "block-id-negative": {"t": "request_data", "request_id": "q", "fetch_id": 1, "dst_blocks": [-1]},
    "timeout-zero": {"t": "request_data", "request_id": "q", "fetch_id": 1, "dst_blocks": [1], "timeout_ms": 0},
    "unknown-field": {"t": "cancel", "request_id": "q", "fetch_id": 1, "priority": 9},
    "layout-too-small": {
        "t": "register", "receiver_id": "r", "result_endpoint": "tcp://127.0.0.1:1",
        "agent_metadata": b"", "kv_base": 0, "aux_base": 0,
        "layout": {"num_layers": 0, "num_blocks": 64, "block_bytes": 256, "dtype": "uint8",
                   "aux_slots": 1, "aux_slot_bytes": 64},
    },
}  # fmt: skip


@pytest.mark.parametrize("body", OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS.keys())
def test_a_field_out_of_bounds_gets_a_malformed_reject_naming_it(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes], body: dict[str, Any]
) -> None:
    """A well-formed map with a field outside its bounds gets Reject(malformed) whose detail names the field."""
    raw.send(wire.HEADER + msgspec.msgpack.encode(body))
    reply = expect_reject(raw, Reason.MALFORMED)
    assert "$." in reply.detail or "unknown field" in reply.detail
    assert rejected(sender) == {"rejected_malformed": 1}
    assert_serves_a_transfer(sender, receiver)


def test_an_oversize_frame_does_not_stop_the_listener(
    make_sender: Callable[..., Sender], receiver: Receiver
) -> None:
    """A frame over max_frame_bytes gets at most a too_large Reject; the listener and that peer carry on."""
    sender = make_sender(limits={"max_frame_bytes": 8192})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.endpoint)
    try:
        sock.send(wire.HEADER + bytes(10_000))
        # ZMQ's MAXMSGSIZE may drop the connection instead of delivering the frame;
        # the DEALER reconnects. Probe until a reply comes back on the new connection.
        deadline = time.monotonic() + REPLY_S
        replies: list[wire.ToReceiver] = []
        while not any(
            isinstance(r, wire.Reject) and r.reason is Reason.UNKNOWN_PEER for r in replies
        ):
            assert time.monotonic() < deadline, replies
            sock.send(wire.encode(wire.Cancel(request_id="probe", fetch_id=1)))
            if sock.poll(200, zmq.POLLIN):
                replies.append(wire.decode_to_receiver(sock.recv_multipart(), MAX))
        assert all(isinstance(r, wire.Reject) for r in replies), replies
        assert {r.reason for r in replies} <= {Reason.TOO_LARGE, Reason.UNKNOWN_PEER}  # type: ignore[union-attr]
    finally:
        sock.close(linger=0)
    assert_serves_a_transfer(sender, receiver)


def test_a_flood_of_random_frames_gets_one_reject_each(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """Hundreds of random frames each get exactly one Reject with a decode reason, and the listener keeps serving."""
    rng = random.Random(1234)
    frames = [
        rng.choice([b"", b"KX", wire.HEADER]) + rng.randbytes(rng.randrange(64)) for _ in range(300)
    ]
    for data in frames:
        raw.send(data)
    decode_reasons = {Reason.MALFORMED, Reason.UNSUPPORTED_VERSION, Reason.UNKNOWN_MESSAGE}
    for _ in frames:
        reply = recv(raw)
        assert isinstance(reply, wire.Reject) and reply.reason in decode_reasons, reply
    assert_next_reply_is_to_a_probe(raw)
    assert sum(rejected(sender).values()) == len(frames) + 1
    assert_serves_a_transfer(sender, receiver)


# -- messages before REGISTER, and refused REGISTERs ---------------------------------------


def test_a_request_before_register_gets_a_failed_result_unknown_peer(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A RequestData from a peer that never registered gets its one final Result: failed, unknown_peer."""
    msg = request()
    raw.send(wire.encode(msg))
    expect_result(raw, msg, "failed", Reason.UNKNOWN_PEER)
    assert_next_reply_is_to_a_probe(raw)
    assert rejected(sender) == {"rejected_unknown_peer": 1, "rejected_malformed": 1}
    assert_serves_a_transfer(sender, receiver)


def test_a_cancel_before_register_gets_an_unknown_peer_reject(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A Cancel from a peer that never registered gets Reject(unknown_peer), not a CancelAck."""
    raw.send(wire.encode(wire.Cancel(request_id="q", fetch_id=1)))
    expect_reject(raw, Reason.UNKNOWN_PEER)
    assert rejected(sender) == {"rejected_unknown_peer": 1}
    assert sender.stats.get("cancels") == 0
    assert_serves_a_transfer(sender, receiver)


@pytest.mark.parametrize(
    ("field", "value"), [("dtype", "float16"), ("block_bytes", 512), ("num_layers", 3)]
)
def test_an_incompatible_register_gets_a_refusal_and_registers_nothing(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes], field: str, value: Any
) -> None:
    """A Register whose dtype, block size or layer count differs gets RegisterReply(ok=False, incompatible)."""
    layout = msgspec.structs.replace(wire.WireLayout.of(sender.pool.layout), **{field: value})
    reg = wire.Register(
        receiver_id="other-model", result_endpoint="tcp://127.0.0.1:1", agent_metadata=b"unused",
        layout=layout, kv_base=0, aux_base=0,
    )  # fmt: skip
    raw.send(wire.encode(reg))
    reply = recv(raw)
    assert isinstance(reply, wire.RegisterReply), reply
    assert (reply.ok, reply.reason, reply.sender_id) == (
        False,
        Reason.INCOMPATIBLE,
        sender.sender_id,
    )
    assert field in reply.detail
    msg = request()
    raw.send(wire.encode(msg))  # still not a peer
    expect_result(raw, msg, "failed", Reason.UNKNOWN_PEER)
    assert rejected(sender) == {"rejected_incompatible": 1, "rejected_unknown_peer": 1}
    assert sender.stats.get("peers_registered") == 0
    assert_serves_a_transfer(sender, receiver)


def test_a_register_with_unusable_nixl_metadata_gets_an_incompatible_refusal(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A Register whose agent metadata NIXL cannot load gets RegisterReply(ok=False, incompatible)."""
    reg = wire.Register(
        receiver_id="bad-agent", result_endpoint="tcp://127.0.0.1:1", agent_metadata=b"not nixl",
        layout=wire.WireLayout.of(sender.pool.layout), kv_base=0, aux_base=0,
    )  # fmt: skip
    raw.send(wire.encode(reg))
    reply = recv(raw)
    assert isinstance(reply, wire.RegisterReply) and not reply.ok, reply
    assert reply.reason is Reason.INCOMPATIBLE and "NIXL" in reply.detail
    assert rejected(sender) == {"rejected_incompatible": 1}
    assert_serves_a_transfer(sender, receiver)


def test_a_receiver_with_the_longest_allowed_name_can_register(
    sender: Sender, make_receiver: Callable[..., Receiver]
) -> None:
    """A receiver named with 64 characters (the config maximum) registers and transfers."""
    receiver = make_receiver(name="n" * 64)
    assert_serves_a_transfer(sender, receiver)
    assert rejected(sender) == {}


# -- a hand-written receiver: refusals after REGISTER, and the whole exchange --------------


def test_a_hand_written_receiver_fetches_a_parked_request_byte_for_byte(
    sender: Sender,
    receiver: Receiver,
    raw: zmq.Socket[bytes],
    result_router: tuple[zmq.Socket[bytes], str],
) -> None:
    """Register, RequestData before publish (parked), publish, then one done Result on the result endpoint."""
    router, endpoint = result_router
    register_raw(raw, receiver, endpoint)
    msg = request(dst_blocks=[60, 61], aux_slot=7)
    raw.send(wire.encode(msg))
    assert_next_reply_is_to_a_probe(raw)  # parked: no reply yet
    assert sender.stats.get("fetches_parked") == 1
    data = torch.randint(0, 256, (2, 2, POOL["block_elems"]), dtype=torch.uint8)
    sender.pool.kv[:, [5, 6]] = data
    tx = sender.publish(msg.request_id, [5, 6], aux=b"aux!")
    reply = expect_result(router, msg, "done", None)
    assert (reply.nbytes, reply.aux_bytes) == (data.numel() + 4, 4)  # nbytes counts KV and aux
    assert torch.equal(receiver.pool.kv[:, [60, 61]], data)
    assert bytes(receiver.pool.aux[7, :4].tolist()) == b"aux!"
    assert tx.close(REPLY_S)
    assert_serves_a_transfer(sender, receiver)


def test_a_cancel_after_the_result_is_acknowledged_after_it(
    sender: Sender,
    receiver: Receiver,
    raw: zmq.Socket[bytes],
    result_router: tuple[zmq.Socket[bytes], str],
) -> None:
    """A Cancel of an attached fetch is answered on the result endpoint: its Result first, then CancelAck."""
    router, endpoint = result_router
    register_raw(raw, receiver, endpoint)
    msg = request(dst_blocks=[62])
    tx = sender.publish(msg.request_id, [0])
    raw.send(wire.encode(msg))
    raw.send(wire.encode(wire.Cancel(request_id=msg.request_id, fetch_id=msg.fetch_id)))
    result = recv(router)
    assert isinstance(result, wire.Result) and result.fetch_id == msg.fetch_id
    assert result.status in ("done", "failed")  # the cancel may land before or after the write
    ack = recv(router)
    assert ack == wire.CancelAck(request_id=msg.request_id, fetch_id=msg.fetch_id, in_doubt=False)
    assert tx.close(REPLY_S)


def test_a_cancel_of_a_parked_fetch_gets_a_cancelled_result_then_an_ack(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A parked fetch that is cancelled gets Result(failed, cancelled) and then CancelAck, on the DEALER."""
    register_raw(raw, receiver, receiver.result_endpoint)
    msg = request()
    raw.send(wire.encode(msg))
    raw.send(wire.encode(wire.Cancel(request_id=msg.request_id, fetch_id=msg.fetch_id)))
    expect_result(raw, msg, "failed", Reason.CANCELLED)
    ack = recv(raw)
    assert ack == wire.CancelAck(request_id=msg.request_id, fetch_id=msg.fetch_id, in_doubt=False)
    assert sender.stats.get("cancels") == 1
    assert_serves_a_transfer(sender, receiver)


def test_a_cancel_of_an_unknown_fetch_is_acknowledged_at_once(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A registered peer's Cancel for a fetch the sender never saw gets only a CancelAck, not in doubt."""
    register_raw(raw, receiver, receiver.result_endpoint)
    raw.send(wire.encode(wire.Cancel(request_id="never-sent", fetch_id=424242)))
    assert recv(raw) == wire.CancelAck(request_id="never-sent", fetch_id=424242, in_doubt=False)
    assert_next_reply_is_to_a_probe(raw)


def test_a_parked_fetch_expires_after_its_own_timeout(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A fetch for a request never published gets Result(failed, expired) once its timeout_ms passes."""
    register_raw(raw, receiver, receiver.result_endpoint)
    msg = request(timeout_ms=200)
    t0 = time.monotonic()
    raw.send(wire.encode(msg))
    expect_result(raw, msg, "failed", Reason.EXPIRED)
    assert time.monotonic() - t0 >= 0.2
    assert rejected(sender) == {"rejected_expired": 1}
    assert_serves_a_transfer(sender, receiver)


REFUSED = {
    "block-outside-pool": (dict(dst_blocks=[64]), Reason.BAD_BLOCKS),
    "repeated-blocks": (dict(dst_blocks=[3, 3]), Reason.BAD_BLOCKS),
    "empty-blocks": (dict(dst_blocks=[]), Reason.BAD_BLOCKS),
    "layer-past-end": (dict(layer_begin=1, layer_end=3), Reason.BAD_BLOCKS),
    "empty-layer-range": (dict(layer_begin=2, layer_end=0), Reason.BAD_BLOCKS),
    "aux-slot-outside-pool": (dict(aux_slot=256), Reason.BAD_BLOCKS),
}


@pytest.mark.parametrize(("fields", "reason"), REFUSED.values(), ids=REFUSED.keys())
def test_a_request_for_blocks_outside_the_receivers_pool_is_refused(
    sender: Sender,
    receiver: Receiver,
    raw: zmq.Socket[bytes],
    fields: dict[str, Any],
    reason: Reason,
) -> None:
    """Block ids, layer ranges and aux slots are bounds-checked against the registered layout before any write."""
    register_raw(raw, receiver, receiver.result_endpoint)
    msg = request(**fields)
    raw.send(wire.encode(msg))
    expect_result(raw, msg, "failed", reason)
    assert rejected(sender) == {f"rejected_{reason}": 1}
    assert sender.stats.get("fetches_parked") == 0
    assert_serves_a_transfer(sender, receiver)


def test_a_request_with_more_blocks_than_were_published_is_refused(
    sender: Sender, receiver: Receiver, raw: zmq.Socket[bytes]
) -> None:
    """A RequestData whose block count differs from the published request gets Result(failed, bad_blocks)."""
    register_raw(raw, receiver, receiver.result_endpoint)
    msg = request(dst_blocks=[1, 2, 3])
    tx = sender.publish(msg.request_id, [0, 1])
    raw.send(wire.encode(msg))
    expect_result(raw, msg, "failed", Reason.BAD_BLOCKS)
    assert tx.close(REPLY_S)
    assert_serves_a_transfer(sender, receiver)


def test_a_fetch_id_in_use_is_refused_as_duplicate(
    sender: Sender,
    receiver: Receiver,
    raw: zmq.Socket[bytes],
    result_router: tuple[zmq.Socket[bytes], str],
) -> None:
    """A second RequestData with an attached fetch's id gets Result(failed, duplicate) on the DEALER."""
    router, endpoint = result_router
    register_raw(raw, receiver, endpoint)
    first = request(dst_blocks=[63])
    tx = sender.publish(first.request_id, [0])
    raw.send(wire.encode(first))
    expect_result(router, first, "done", None)
    again = request(request_id=first.request_id, fetch_id=first.fetch_id, dst_blocks=[62])
    raw.send(wire.encode(again))
    expect_result(raw, again, "failed", Reason.DUPLICATE)
    assert tx.close(REPLY_S)
    assert_serves_a_transfer(sender, receiver)


@pytest.mark.parametrize(
    ("limits", "fields", "reason"),
    [
        ({"max_pending_fetches": 0}, {}, Reason.BUSY),
        ({"max_blocks_per_request": 2}, {"dst_blocks": [1, 2, 3]}, Reason.TOO_LARGE),
    ],
    ids=["pending-table-full", "too-many-blocks"],
)
def test_a_request_over_a_sender_limit_is_refused(
    make_sender: Callable[..., Sender],
    receiver: Receiver,
    limits: dict[str, int],
    fields: dict[str, Any],
    reason: Reason,
) -> None:
    """A RequestData that would exceed a bounded table or block limit gets Result(failed) with that reason."""
    sender = make_sender(limits=limits)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.endpoint)
    try:
        register_raw(sock, receiver, receiver.result_endpoint)
        msg = request(**fields)
        sock.send(wire.encode(msg))
        expect_result(sock, msg, "failed", reason)
        assert rejected(sender) == {f"rejected_{reason}": 1}
    finally:
        sock.close(linger=0)
    assert_serves_a_transfer(sender, receiver)
