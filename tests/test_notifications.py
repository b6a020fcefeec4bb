"""The success path of issue 22: small writes by the listener, coalesced, done by the notification the WRITE carries.

A real Sender and Receiver over real ZMQ with controllable data planes (kvxferd.testing):
the test decides when each WRITE ends, and a WRITE that ends ok delivers the notification
it carries to the receiver's double, as NIXL does once the WRITE is complete.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState
from tests.support.conditions import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0
QUIET_S = 0.3  # how long something that must not happen is watched
POOL = dict(
    num_layers=2, num_blocks=64, block_elems=16, dtype="uint8", aux_slots=4, aux_slot_bytes=64
)
BIG = 256  # bytes of a request past which the worker threads write it (inline_write_max_bytes)


@pytest.fixture
def sender() -> Iterator[tuple[Sender, ControlledDataPlane]]:
    """A started Sender on prepared lists: requests of up to BIG bytes are the listener's."""
    dp = ControlledDataPlane("note-tx", prepped=True)
    sx = Sender(
        load_sender_settings(
            name="note-tx",
            listen="tcp://127.0.0.1:0",
            num_threads=2,
            inline_write_max_bytes=BIG,
            pool=POOL,
            deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000),
        ),
        dataplane=dp,
    ).start()
    dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
    try:
        yield sx, dp
    finally:
        for x in dp.xfers:
            x.finish(True)
        sx.shutdown(timeout=3)


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for rx in made:
        rx.shutdown(timeout=3)


def receiver(made: list[Receiver], name: str, *, notifications: bool = True) -> Receiver:
    rx = Receiver(
        load_receiver_settings(
            name=name,
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000, cancel_fence_ms=500),
            dataplane={"notifications": notifications},
        ),
        dataplane=ControlledDataPlane(name),
    ).start()
    made.append(rx)
    return rx


def test_a_fetch_is_done_by_the_notification_its_write_carries_and_no_result_is_sent(
    sender: tuple[Sender, ControlledDataPlane], receivers: list[Receiver]
) -> None:
    """A small fetch is written by the listener itself, its WRITE carries the done
    notification (fetch id, the receiver's nonce, bytes), and the fetch ends done when the
    WRITE ends: no Result goes."""
    sx, dp = sender
    rx = receiver(receivers, "note-rx")
    sx.publish("req-1", [1, 2])
    h = rx.fetch("req-1", sx.endpoint, [5, 6], want_aux=False)
    x = dp.wait_posted(1)
    [record] = wire.decode_notification(x.notif) or []
    assert record == (h.fetch_id, h.session.nonce, 2 * 2 * 16, 0)
    assert h.wait(QUIET_S) is None  # nothing before the WRITE ends
    x.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE and out.nbytes == 64, out
    # The receiver hears of the WRITE as it completes; the sender counts it once it sees it.
    wait_until(lambda: sx.stats.get("slices_done_notified") == 1, WAIT_S, "counted")
    assert sx.stats.get("inline_slices") == 1 and sx.stats.get("sent_result") == 0
    assert rx.stats.get("notifications") == 1


def test_a_notification_with_another_nonce_or_from_another_agent_completes_nothing(
    sender: tuple[Sender, ControlledDataPlane], receivers: list[Receiver]
) -> None:
    """A record with the right fetch id but not its nonce, or with its nonce but from an agent
    that is not the sender's, is refused and counted; the real one completes the fetch."""
    sx, dp = sender
    rx = receiver(receivers, "note-rx")
    sx.publish("req-1", [1])
    h = rx.fetch("req-1", sx.endpoint, [5], want_aux=False)
    x = dp.wait_posted(1)
    rdp = rx.dataplane
    assert isinstance(rdp, ControlledDataPlane)
    wrong_nonce = wire.encode_notification([(h.fetch_id, b"12345678", 32, 0)])
    right = wire.encode_notification([(h.fetch_id, h.session.nonce, 32, 0)])
    rdp.deliver(sx.sender_id, wrong_nonce)
    rdp.deliver("another-agent", right)
    rdp.deliver(sx.sender_id, b"not ours")
    wait_until(lambda: rx.stats.get("notifications_refused") == 2, WAIT_S, "both refused")
    wait_until(lambda: rx.stats.get("notifications_unknown") == 1, WAIT_S, "garbage dropped")
    assert h.wait(QUIET_S) is None, "a forged notification ended the fetch"
    x.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out


def test_slices_of_one_receiver_queued_together_share_one_write_and_one_notification(
    sender: tuple[Sender, ControlledDataPlane], receivers: list[Receiver]
) -> None:
    """Fetches queued behind a WRITE in flight toward the same receiver are posted as one
    WRITE (their blocks together) whose one notification completes them all."""
    sx, dp = sender
    rx = receiver(receivers, "note-rx")
    for i in range(4):
        sx.publish(f"req-{i}", [10 + i])
    first = rx.fetch("req-0", sx.endpoint, [20], want_aux=False)
    x0 = dp.wait_posted(1)
    rest = [rx.fetch(f"req-{i}", sx.endpoint, [20 + i], want_aux=False) for i in (1, 2, 3)]
    wait_until(
        lambda: sum(len(s.slices()) for s in list(sx.published.sessions.values())) == 4,
        WAIT_S,
        "the three fetches attached (queued behind the first write)",
    )
    assert len(dp.xfers) == 1  # the lane is busy: nothing else is posted
    x0.finish(True)
    x1 = dp.wait_posted(2)
    assert sorted(x1.src.tolist()) == [11, 12, 13] and sorted(x1.dst.tolist()) == [21, 22, 23]
    records = wire.decode_notification(x1.notif) or []
    assert sorted(r[0] for r in records) == sorted(h.fetch_id for h in rest)
    x1.finish(True)
    for h in [first, *rest]:
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
    assert len(dp.xfers) == 2
    assert sx.stats.get("writes_coalesced") == 2


def test_a_receiver_without_notifications_gets_done_results(
    sender: tuple[Sender, ControlledDataPlane], receivers: list[Receiver]
) -> None:
    """A receiver that asks for no notification (no nonce) gets its done Result, and the
    WRITE carries nothing."""
    sx, dp = sender
    rx = receiver(receivers, "plain-rx", notifications=False)
    sx.publish("req-1", [1])
    h = rx.fetch("req-1", sx.endpoint, [5], want_aux=False)
    x = dp.wait_posted(1)
    assert x.notif == b""
    x.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    wait_until(lambda: sx.stats.get("sent_result") == 1, WAIT_S, "the done Result sent")
    assert sx.stats.get("slices_done_notified") == 0 and rx.stats.get("notifications") == 0


def test_a_request_over_the_inline_bound_is_written_by_a_worker_thread(
    sender: tuple[Sender, ControlledDataPlane], receivers: list[Receiver]
) -> None:
    """A request of more than inline_write_max_bytes goes to a worker thread (its WRITE
    overlaps the listener's work); a small one stays with the listener."""
    sx, dp = sender
    rx = receiver(receivers, "note-rx")
    big = list(range(30, 40))  # 10 blocks x 2 layers x 16 B = 320 B > BIG
    sx.publish("req-big", big)
    sx.publish("req-small", [1])
    hb = rx.fetch("req-big", sx.endpoint, big, want_aux=False)
    dp.wait_posted(1).finish(True)
    hs = rx.fetch("req-small", sx.endpoint, [2], want_aux=False)
    dp.wait_posted(2).finish(True)
    for h in (hb, hs):
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
    wait_until(
        lambda: sum(sx.stats.get(f"worker_{i}_slices") for i in range(2)) == 1,
        WAIT_S,
        "the big slice counted on a worker thread",
    )
    wait_until(lambda: sx.stats.get("inline_slices") == 1, WAIT_S, "the small one inline")
