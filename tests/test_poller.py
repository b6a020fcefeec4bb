"""The io threads' Poller: ZMQ sockets and plain descriptors, sub-millisecond waits, and the
skipped EVENTS check (``check_zmq=False``) after a turn that used no socket."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import zmq

from kvxferd.transfer.poller import Poller

WAIT_S = 5.0  # a wake-up that must come; generous for a loaded 2-core host


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    b.send(b"hello")  # the connection is up once it arrived
    assert a.poll(int(WAIT_S * 1000)), "the pair never connected"
    assert a.recv() == b"hello"
    yield a, b
    a.close(linger=0)
    b.close(linger=0)


def test_nothing_ready_returns_empty_after_a_short_wait(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    a, _ = pair
    p = Poller()
    p.register(a)
    t0 = time.monotonic()
    assert p.poll(200e-6) == []
    assert time.monotonic() - t0 < WAIT_S


def test_a_message_after_a_check_wakes_a_poll_that_skips_the_check(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    """The ZMQ descriptor signals a message that came after EVENTS said none: a poll that
    skips the check (nothing touched the socket since) still wakes for it, long before
    its timeout."""
    a, b = pair
    p = Poller()
    p.register(a)
    assert p.poll(0.0) == []  # the check: nothing waits
    assert p.poll(1e-4, check_zmq=False) == []  # nothing came: a quiet wait
    b.send(b"late")
    t0 = time.monotonic()
    ready = p.poll(WAIT_S, check_zmq=False)
    assert ready == [(a, zmq.POLLIN)], ready
    assert time.monotonic() - t0 < WAIT_S
    assert a.recv(zmq.NOBLOCK) == b"late"


def test_a_message_already_there_is_seen_by_the_check(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    a, b = pair
    b.send(b"early")
    p = Poller()
    p.register(a)
    deadline = time.monotonic() + WAIT_S
    ready: list[tuple[object, int]] = []
    while not ready and time.monotonic() < deadline:  # bounded: the message is on its way
        ready = p.poll(0.05)
    assert ready == [(a, zmq.POLLIN)]
    assert a.recv(zmq.NOBLOCK) == b"early"


def test_a_plain_descriptor_beside_the_sockets(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    a, _ = pair
    r, w = os.pipe()
    try:
        p = Poller()
        p.register(a)
        p.register(r, zmq.POLLIN)
        assert p.poll(1e-4) == []
        os.write(w, b"x")
        assert p.poll(WAIT_S, check_zmq=False) == [(r, zmq.POLLIN)]
        assert p.poll(2e-3) == [(r, zmq.POLLIN)]  # the millisecond path (select.poll) too
    finally:
        os.close(r)
        os.close(w)
