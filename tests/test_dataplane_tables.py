"""The data plane's tables (routes.py, loaded_peers.py): their transitions and counts."""

from __future__ import annotations

import threading
import time

from kvxferd.transfer.loaded_peers import LoadedPeers
from kvxferd.transfer.routes import Routes


def test_a_route_counts_each_transition() -> None:
    """A peer loaded, broken, moved and removed: each transition is counted once."""
    r = Routes()
    r.added("rx")
    assert r.path_of("rx") == 0 and ("rx", 0) in r.loaded
    assert r.mark_broken(("rx", 0)) and not r.mark_broken(("rx", 0))
    assert r.trouble(("rx", 0), None) == (True, False)
    r.load(("rx", 1))
    r.move("rx", 1)
    assert r.path_of("rx") == 1 and r.trouble(("rx", 1), None) == (False, False)
    assert r.remove("rx", [0, 1]) == [0, 1] and r.path_of("rx") == 0 and not r.loaded
    assert r.counts == {"loaded": 2, "broken": 1, "moved": 1, "removed": 1}


def test_a_write_in_flight_past_stall_s_is_stalled_until_released() -> None:
    """A key whose oldest write is older than stall_s is stalled; a broken key with a write
    in flight is not reported broken until the write is released."""
    r = Routes()
    r.added("rx")
    wid = r.posted(("rx", 0))
    r.inflight[("rx", 0)][wid] = time.monotonic() - 5.0
    r.mark_broken(("rx", 0))
    assert r.busy(0) and r.trouble(("rx", 0), 1.0) == (False, True)
    r.released(("rx", 0), wid)
    assert not r.busy(0) and r.trouble(("rx", 0), 1.0) == (True, False)
    r.heal(("rx", 0))
    assert r.counts["healed"] == 1 and r.trouble(("rx", 0), 1.0) == (False, False)


def test_a_claim_holds_another_claim_of_the_same_name_only() -> None:
    """A second claim of a claimed name waits for the unclaim; another name never does."""
    lock = threading.Lock()
    t = LoadedPeers(lock)
    second = threading.Event()

    def claim_again() -> None:
        with lock:
            t.claim("rx")
            second.set()
            t.unclaim("rx")

    with lock:
        t.claim("rx")
        t.claim("other")  # not held by rx's claim
    thread = threading.Thread(target=claim_again, name="claim-again", daemon=True)
    thread.start()
    assert not second.wait(0.2)  # a bounded wait: the claim must still hold it
    with lock:
        t.unclaim("rx")
    assert second.wait(10)
    thread.join(10)
    assert t.counts == {"claimed": 3}


def test_a_peer_is_live_until_removed_or_closed() -> None:
    """Lists made for a peer are installed only while it is known and the plane open."""
    t = LoadedPeers(threading.Lock())
    t.add("rx", b"meta")
    assert "rx" in t and t.live("rx") and t.names() == {"rx"}
    t.closed = True
    assert not t.live("rx")
    assert t.remove("rx") and not t.remove("rx") and "rx" not in t
    assert t.counts == {"added": 1, "removed": 1}
