"""PeerAgents: a receiver's NIXL agent is removed only once no write toward it is in flight.

Deterministic tests of the table's state machine (kvxferd/transfer/peer_agents.py) with a data
plane double that records removals; the integration side (real writes, real
replacements) is tests/test_sender_races.py and tests/test_incarnations.py.
"""

from __future__ import annotations

import pytest

from kvxferd.stats import Stats
from kvxferd.transfer.peer_agents import PeerAgents

pytestmark = pytest.mark.timeout(10)


class Removals:
    def __init__(self, fail: bool = False) -> None:
        self.removed: list[str] = []
        self.fail = fail

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)
        if self.fail:
            raise RuntimeError("NIXL said no")


def test_retire_with_no_write_removes_at_once() -> None:
    """An idle agent is removed by the retiring thread, and forgets when it was heard from."""
    dp, stats = Removals(), Stats()
    a = PeerAgents(dp, stats)
    a.heard("rx-1")
    assert a.heard_from("rx-1") > 0
    a.retire("rx-1")
    assert dp.removed == ["rx-1"] and a.heard_from("rx-1") == 0.0
    assert stats.get("peers_removed") == 1 and stats.get("peer_removals_deferred") == 0


def test_retire_under_writes_waits_for_the_last_one() -> None:
    """With two writes in flight the removal is deferred; the end of the second runs it."""
    dp, stats = Removals(), Stats()
    a = PeerAgents(dp, stats)
    assert a.write_started("rx-1") and a.write_started("rx-1")
    a.retire("rx-1")
    assert dp.removed == [] and a.retiring() == {"rx-1"} and a.writes() == {"rx-1": 2}
    a.write_ended("rx-1")
    assert dp.removed == [], "removed under the write still in flight"
    a.write_ended("rx-1")
    assert dp.removed == ["rx-1"] and a.retiring() == set() and a.writes() == {}
    assert stats.get("peer_removals_deferred") == 1


def test_registering_again_cancels_a_deferred_removal() -> None:
    """The same agent registered again while its removal waits: the removal never runs."""
    dp, stats = Removals(), Stats()
    a = PeerAgents(dp, stats)
    a.write_started("rx-1")
    a.retire("rx-1", gone=True)
    a.registered("rx-1")
    assert not a.is_gone("rx-1") and a.retiring() == set()
    a.write_ended("rx-1")
    assert dp.removed == [] and stats.get("peer_removals_cancelled") == 1


def test_a_gone_incarnation_gets_no_new_write_and_is_remembered_boundedly() -> None:
    """No write starts toward a replaced incarnation (nothing counted); the oldest gone
    names are forgotten past gone_max."""
    a = PeerAgents(Removals(), Stats(), gone_max=2)
    a.retire("rx-1", gone=True)
    assert a.is_gone("rx-1") and not a.write_started("rx-1") and a.writes() == {}
    a.mark_gone("rx-2")
    a.mark_gone("rx-3")
    assert not a.is_gone("rx-1") and a.is_gone("rx-2") and a.is_gone("rx-3")


def test_a_failed_removal_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """NIXL refusing the removal costs a log line: the write's thread goes on."""
    dp, stats = Removals(fail=True), Stats()
    a = PeerAgents(dp, stats)
    a.write_started("rx-1")
    a.retire("rx-1")
    a.write_ended("rx-1")
    assert dp.removed == ["rx-1"] and stats.get("peers_removed") == 0
    assert "removing NIXL peer rx-1 failed" in caplog.text
