"""SharedDealerPool: one connect per endpoint, serialised sends, per-peer stalls, safe close."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq

from kvxferd.errors import SendTimeout
from kvxferd.transfer import control
from kvxferd.transfer.control import SharedDealerPool, SocketLimits

WAIT_S = 5.0  # bound on anything that must happen
QUIET_S = 0.3  # how long something that must not happen is watched
LIMITS = SocketLimits(max_frame_bytes=4 << 20, sndhwm=1)


class SpySocket:
    """A real DEALER that records sends in progress and closes; a send may be held at a gate."""

    def __init__(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.gate: threading.Event | None = None  # set by a test: sends wait for it
        self.cond = threading.Condition()
        self.entered = 0
        self.active = 0
        self.max_active = 0
        self.closed = False
        self.closed_during_send = False

    def send(self, frame: bytes, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        with self.cond:
            if self.closed:
                raise AssertionError("send on a closed socket")
            self.entered += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.cond.notify_all()
        try:
            if self.gate is not None:
                assert self.gate.wait(WAIT_S), "gate never opened"
            self.sock.send(frame, flags, copy=copy, track=track)
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def close(self, linger: int | None = None) -> None:
        with self.cond:
            self.closed_during_send |= self.active > 0
            self.closed = True
            self.cond.notify_all()
        self.sock.close(linger=linger)

    def wait_entered(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered >= n, WAIT_S), f"{n} sends never began"


class Spies:
    """Replaces control.connect_dealer: every pool DEALER is a SpySocket; connects are counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = control.connect_dealer
        self.sockets: list[SpySocket] = []
        self.connects: Counter[str] = Counter()
        self.lock = threading.Lock()
        monkeypatch.setattr(control, "connect_dealer", self.connect)

    def connect(
        self,
        endpoint: str,
        limits: SocketLimits,
        timeout_ms: int,
        *,
        server_key: str = "",
    ) -> SpySocket:
        spy = SpySocket(self.real(endpoint, limits, timeout_ms, server_key=server_key), endpoint)
        with self.lock:
            self.connects[endpoint] += 1
            self.sockets.append(spy)
        return spy

    def of(self, endpoint: str) -> SpySocket:
        with self.lock:
            (spy,) = [s for s in self.sockets if s.endpoint == endpoint]
        return spy


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Spies:
    return Spies(monkeypatch)


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A ROUTER the test reads from."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    sock.close(linger=0)


@pytest.fixture
def frozen() -> Iterator[str]:
    """A TCP port that accepts connections and never reads: a receiver frozen mid-flight."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    yield f"tcp://127.0.0.1:{lsock.getsockname()[1]}"
    lsock.close()


@pytest.fixture
def pools() -> Iterator[list[SharedDealerPool]]:
    made: list[SharedDealerPool] = []
    yield made
    for pool in made:
        pool.close_all()


def make_pool(pools: list[SharedDealerPool], timeout_ms: int = 1000) -> SharedDealerPool:
    pool = SharedDealerPool(LIMITS, timeout_ms)
    pools.append(pool)
    return pool


def unbound_endpoint() -> str:
    """A loopback TCP endpoint nobody listens on (yet)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return f"tcp://127.0.0.1:{port}"


def recv_all(sock: zmq.Socket[bytes], n: int) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    while len(got) < n:
        assert sock.poll(int(WAIT_S * 1000)), f"only {len(got)} of {n} frames arrived"
        got.append(sock.recv_multipart())
    return got


def run(target, *args) -> tuple[threading.Thread, threading.Event, list[BaseException]]:  # type: ignore[no-untyped-def]
    """Start ``target`` in a thread; returns it, an event set when it returned, and its error."""
    done, errors = threading.Event(), []

    def body() -> None:
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, done, errors


class TestSharedDealerPool:
    def test_concurrent_sends_connect_once_and_arrive_whole(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """Many threads sending to one endpoint share one DEALER, never overlap, and every frame arrives intact."""
        sock, endpoint = router
        pool = SharedDealerPool(SocketLimits(4 << 20, 10_000), 1000)
        pools.append(pool)
        n_threads, per_thread = 8, 40
        barrier = threading.Barrier(n_threads)
        sent = {
            f"t{t}-{i}".encode() + bytes(2000) for t in range(n_threads) for i in range(per_thread)
        }

        def sender(t: int) -> None:
            barrier.wait(WAIT_S)
            for i in range(per_thread):
                pool.send(endpoint, f"t{t}-{i}".encode() + bytes(2000))

        threads = [run(sender, t) for t in range(n_threads)]
        got = recv_all(sock, n_threads * per_thread)
        for _, done, errors in threads:
            assert done.wait(WAIT_S) and not errors, errors
        assert spies.connects == {endpoint: 1}
        assert spies.of(endpoint).max_active == 1
        assert {frames[0] for frames in got} == {got[0][0]}  # one connection
        assert all(len(frames) == 2 for frames in got)
        assert {frames[1] for frames in got} == sent

    def test_first_sends_racing_to_one_endpoint_connect_once(
        self,
        monkeypatch: pytest.MonkeyPatch,
        router: tuple[zmq.Socket[bytes], str],
        pools: list[SharedDealerPool],
    ) -> None:
        """Two first sends to one endpoint racing through get-or-connect create one DEALER, not two."""
        _, endpoint = router
        real = control.connect_dealer
        calls: list[str] = []
        second_arrived = threading.Event()

        def slow_connect(
            ep: str,
            limits: SocketLimits,
            timeout_ms: int,
            *,
            server_key: str = "",
        ):  # type: ignore[no-untyped-def]
            calls.append(threading.current_thread().name)
            if len(calls) == 1:
                # Hold the first connect open: an unguarded pool lets the second caller in here.
                second_arrived.wait(QUIET_S)
            else:
                second_arrived.set()
            return real(ep, limits, timeout_ms, server_key=server_key)

        monkeypatch.setattr(control, "connect_dealer", slow_connect)
        pool = make_pool(pools)
        barrier = threading.Barrier(2)

        def first_send() -> None:
            barrier.wait(WAIT_S)
            pool.send(endpoint, b"hello")

        threads = [run(first_send), run(first_send)]
        for _, done, errors in threads:
            assert done.wait(WAIT_S) and not errors, errors
        assert len(calls) == 1

    def test_forget_closes_the_dealer_and_a_later_send_reconnects(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """forget closes an endpoint's DEALER; the next send to it connects a new one and arrives."""
        sock, endpoint = router
        pool = make_pool(pools)
        pool.send(endpoint, b"before")
        first = spies.of(endpoint)
        pool.forget(endpoint)
        assert first.closed and not first.closed_during_send
        pool.send(endpoint, b"after")
        assert spies.connects[endpoint] == 2, "the forgotten DEALER was reused"
        # Both arrive; two connections give no order between them (the old one lingers).
        assert sorted(f[1] for f in recv_all(sock, 2)) == [b"after", b"before"]
        pool.forget("tcp://127.0.0.1:1")  # never connected: nothing to do

    def test_sends_to_one_endpoint_are_serialised(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """While one thread is inside a send on a shared DEALER, another send to that endpoint waits."""
        sock, endpoint = router
        pool = make_pool(pools)
        pool.send(endpoint, b"connect")
        spy = spies.of(endpoint)
        gate = spy.gate = threading.Event()
        _, a_done, a_err = run(pool.send, endpoint, b"a")
        spy.wait_entered(2)
        _, b_done, b_err = run(pool.send, endpoint, b"b")
        with spy.cond:
            overlapped = spy.cond.wait_for(lambda: spy.entered >= 3, QUIET_S)
        assert not overlapped, "a second send entered the socket during the first"
        gate.set()
        assert a_done.wait(WAIT_S) and b_done.wait(WAIT_S) and not a_err and not b_err
        assert spy.max_active == 1
        assert [f[1] for f in recv_all(sock, 3)] == [b"connect", b"a", b"b"]

    def test_send_blocked_toward_a_peer_that_stopped_reading_does_not_stall_another_endpoint(
        self,
        spies: Spies,
        router: tuple[zmq.Socket[bytes], str],
        frozen: str,
        pools: list[SharedDealerPool],
    ) -> None:
        """A send blocked at the high-water mark toward one peer leaves sends to other endpoints free."""
        sock, endpoint = router
        pool = make_pool(pools, timeout_ms=2000)
        pool.send(frozen, b"fills the queue (sndhwm=1)")
        blocked = spies.of(frozen)
        _, stuck_done, stuck_err = run(pool.send, frozen, b"blocks")
        blocked.wait_entered(2)
        t0 = time.monotonic()
        pool.send(endpoint, b"to a reading peer")
        assert recv_all(sock, 1)[0][1] == b"to a reading peer"
        assert time.monotonic() - t0 < 1.0
        assert not stuck_done.is_set() and blocked.active == 1, "the other send was not blocked"
        assert stuck_done.wait(WAIT_S)
        assert len(stuck_err) == 1 and isinstance(stuck_err[0], SendTimeout)

    def test_send_to_a_peer_that_stopped_reading_times_out(
        self, frozen: str, pools: list[SharedDealerPool]
    ) -> None:
        """A shared send to a peer that is not reading raises SendTimeout within its deadline."""
        pool = make_pool(pools, timeout_ms=200)
        pool.send(frozen, b"fills the queue")
        t0 = time.monotonic()
        with pytest.raises(SendTimeout):
            pool.send(frozen, b"cannot go")
        assert 0.1 <= time.monotonic() - t0 < 2.0

    def test_close_all_waits_for_the_send_in_progress(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """close_all never closes a DEALER while a send on it is in progress; it closes it right after."""
        sock, endpoint = router
        pool = make_pool(pools)
        pool.send(endpoint, b"connect")
        spy = spies.of(endpoint)
        gate = spy.gate = threading.Event()
        _, send_done, send_err = run(pool.send, endpoint, b"in flight at shutdown")
        spy.wait_entered(2)
        _, close_done, close_err = run(pool.close_all)
        assert not close_done.wait(QUIET_S), "close_all returned during a send"
        assert not spy.closed
        gate.set()
        assert send_done.wait(WAIT_S) and close_done.wait(WAIT_S)
        assert not send_err and not close_err
        assert spy.closed and not spy.closed_during_send

    def test_close_all_does_not_wait_for_a_send_queued_behind_an_active_one(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """A send that looked its DEALER up before close_all either goes out first or is refused; no socket error."""
        _, endpoint = router
        pool = make_pool(pools)
        pool.send(endpoint, b"connect")
        spy = spies.of(endpoint)
        gate = spy.gate = threading.Event()
        _, a_done, a_err = run(pool.send, endpoint, b"active")
        spy.wait_entered(2)
        _, b_done, b_err = run(pool.send, endpoint, b"queued behind the active send")
        _, close_done, close_err = run(pool.close_all)
        assert not close_done.wait(QUIET_S)
        gate.set()
        assert a_done.wait(WAIT_S) and b_done.wait(WAIT_S) and close_done.wait(WAIT_S)
        assert not a_err and not close_err
        assert not b_err or isinstance(b_err[0], SendTimeout), b_err
        assert spy.closed and not spy.closed_during_send and spy.max_active == 1

    def test_send_after_close_all_is_refused_without_connecting(
        self, spies: Spies, router: tuple[zmq.Socket[bytes], str], pools: list[SharedDealerPool]
    ) -> None:
        """Once close_all ran, sends raise SendTimeout and no new DEALER is connected."""
        _, endpoint = router
        pool = make_pool(pools)
        pool.send(endpoint, b"connect")
        pool.close_all()
        with pytest.raises(SendTimeout):
            pool.send(endpoint, b"late")
        with pytest.raises(SendTimeout):
            pool.send("tcp://127.0.0.1:1", b"late, new endpoint")
        assert sum(spies.connects.values()) == 1
        assert spies.of(endpoint).closed

    def test_close_all_still_delivers_a_frame_queued_before_it(
        self, pools: list[SharedDealerPool]
    ) -> None:
        """A frame queued before close_all, while the connection is not up yet, is delivered once the peer listens."""
        endpoint = unbound_endpoint()
        pool = make_pool(pools, timeout_ms=2000)
        pool.send(endpoint, b"last words")  # queued: nobody listens there yet
        pool.close_all()
        late = zmq.Context.instance().socket(zmq.ROUTER)
        late.setsockopt(zmq.LINGER, 0)
        try:
            late.bind(endpoint)
            assert late.poll(int(WAIT_S * 1000)), "close_all dropped the queued frame"
            assert late.recv_multipart()[1] == b"last words"
        finally:
            late.close(linger=0)


_MANY_SOCKETS = """
import resource, sys, zmq
from kvxferd.transfer.control import process_context, sockets_needed
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
if sys.argv[1] == "sized":
    process_context(sockets_needed(8, 256))
ctx = process_context()
socks = []
try:
    for _ in range(1100):
        socks.append(ctx.socket(zmq.DEALER))
except zmq.ZMQError as e:
    print("refused after", len(socks), e)
    sys.exit(3)
finally:
    for s in socks:
        s.close(linger=0)
print("opened", len(socks))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sized", [True, False])
def test_a_daemon_sized_context_opens_more_than_libzmqs_default_of_sockets(sized: bool) -> None:
    """A context sized for 8 workers x 256 peers opens 1 100 sockets; libzmq's default (1 023)
    refuses one of them (the control shows the limit is real)."""
    import resource
    import subprocess
    import sys

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096:
        pytest.skip("needs a hard RLIMIT_NOFILE of at least 4096 (each socket holds an fd)")
    r = subprocess.run(
        [sys.executable, "-c", _MANY_SOCKETS, "sized" if sized else "default"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    if sized:
        assert r.returncode == 0 and "opened 1100" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 3 and "refused after 1023" in r.stdout, r.stdout + r.stderr
