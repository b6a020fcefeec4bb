"""Static discovery: a real file, edited and replaced while the watcher polls it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from pathlib import Path

from kvxferd.config import DiscoverySettings
from kvxferd.discovery import PeerAdded, PeerChanged, PeerEvent, PeerRemoved, make_watcher
from kvxferd.discovery.static import StaticWatcher
from tests.support.conditions import wait_until

WAIT_S = 10.0


def _entry(name: str, port: int, role: str = "sender", incarnation: str = "") -> str:
    key = "listen" if role == "sender" else "result"
    return (
        f'[[peers]]\nrole = "{role}"\nname = "{name}"\nincarnation = "{incarnation}"\n'
        f'endpoints = {{ {key} = "tcp://127.0.0.1:{port}" }}\ntopology = {{ zone = "a" }}\n'
    )


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically, as an operator or a config-map update does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _events(w: StaticWatcher, q: queue.Queue[PeerEvent], n: int) -> list[PeerEvent]:
    out = []
    for _ in range(n):
        try:
            out.append(q.get(timeout=WAIT_S))
        except queue.Empty:
            raise AssertionError(f"only {out} within {WAIT_S}s") from None
    return out


def _watcher(path: Path, q: queue.Queue[PeerEvent]) -> StaticWatcher:
    settings = DiscoverySettings(backend="static", static_file=str(path), static_poll_ms=50)
    w = make_watcher(settings, "sender", q.put)
    assert isinstance(w, StaticWatcher)
    return w.start()


def test_an_edited_file_gives_added_changed_and_removed(tmp_path: Path) -> None:
    """Each edit of the file becomes the events that turn the old peer list into the new one."""
    path = tmp_path / "peers.toml"
    _write(path, _entry("p0", 5000) + _entry("p1", 5001) + _entry("d0", 6000, role="receiver"))
    q: queue.Queue[PeerEvent] = queue.Queue()
    w = _watcher(path, q)
    try:
        first = _events(w, q, 2)
        assert all(isinstance(e, PeerAdded) for e in first)
        assert {e.peer.name for e in first if isinstance(e, PeerAdded)} == {"p0", "p1"}
        assert w.snapshot().peers["p0"].endpoint == "tcp://127.0.0.1:5000"
        assert w.snapshot().peers["p0"].topology == {"zone": "a"}
        _write(path, _entry("p1", 5001, incarnation="i2") + _entry("p2", 5002))
        removed, changed, added = _events(w, q, 3)
        assert isinstance(removed, PeerRemoved) and removed.peer.name == "p0"
        assert isinstance(changed, PeerChanged) and changed.new.incarnation == "i2"
        assert isinstance(added, PeerAdded) and added.peer.name == "p2"
        assert w.snapshot().version == 5
        _write(path, "peers = []\n")
        assert all(isinstance(e, PeerRemoved) for e in _events(w, q, 2))
        assert w.snapshot().peers == {}
    finally:
        assert w.stop()


def test_a_bad_entry_is_skipped_and_a_bad_file_keeps_the_peers(tmp_path: Path) -> None:
    """A malformed entry is counted and skipped; an unparsable or missing file is counted and changes nothing."""
    path = tmp_path / "peers.toml"
    wildcard = _entry("bad", 5000).replace("127.0.0.1", "0.0.0.0")
    _write(path, wildcard + _entry("p1", 5001) + '[[peers]]\nrole = "sender"\n')
    q: queue.Queue[PeerEvent] = queue.Queue()
    w = _watcher(path, q)
    try:
        (ev,) = _events(w, q, 1)
        assert isinstance(ev, PeerAdded) and ev.peer.name == "p1"
        assert w.count("malformed") == 2
        _write(path, "[[peers]\nthis is not toml")
        wait_until(lambda: w.count("malformed") == 3, WAIT_S, "bad file counted")
        assert not w.connected
        path.unlink()
        wait_until(lambda: w.count("source_errors") >= 2, WAIT_S, "missing file counted")
        assert set(w.snapshot().peers) == {"p1"} and q.empty()
        _write(path, _entry("p1", 5001))
        wait_until(lambda: w.connected, WAIT_S, "file read again")
        assert q.empty() and w.alive and w.count("errors") == 0
    finally:
        assert w.stop()


def test_a_json_file_is_read_as_json(tmp_path: Path) -> None:
    """A ``.json`` peers file lists the same records as the TOML form."""
    path = tmp_path / "peers.json"
    peers = [{"role": "sender", "name": "p0", "endpoints": {"listen": "tcp://10.0.0.1:5555"}}]
    _write(path, json.dumps({"peers": peers}))
    q: queue.Queue[PeerEvent] = queue.Queue()
    w = _watcher(path, q)
    try:
        (ev,) = _events(w, q, 1)
        assert isinstance(ev, PeerAdded) and ev.peer.endpoint == "tcp://10.0.0.1:5555"
    finally:
        assert w.stop()


def test_a_failing_callback_does_not_stop_the_watcher(tmp_path: Path) -> None:
    """An exception in the daemon's event callback is counted; later edits are still applied."""
    path = tmp_path / "peers.toml"
    _write(path, _entry("p0", 5000))

    def boom(ev: PeerEvent) -> None:
        raise RuntimeError("callback bug")

    settings = DiscoverySettings(backend="static", static_file=str(path), static_poll_ms=50)
    w = make_watcher(settings, "sender", boom)
    assert w is not None
    w.start()
    try:
        wait_until(lambda: w.count("callback_errors") == 1, WAIT_S, "first callback failed")
        _write(path, _entry("p0", 5000) + _entry("p1", 5001))
        wait_until(lambda: w.count("callback_errors") == 2, WAIT_S, "second edit's event")
        assert "p1" in w.snapshot().peers and w.alive
    finally:
        assert w.stop()


def test_the_listing_command_prints_what_a_daemon_would_see(tmp_path: Path) -> None:
    """``python -m kvxferd.discovery --once`` with a daemon's config prints the peers it would know."""
    peers = tmp_path / "peers.toml"
    _write(peers, _entry("p0", 5000) + _entry("d0", 6000, role="receiver"))
    conf = tmp_path / "receiver.toml"
    conf.write_text(f'[discovery]\nbackend = "static"\nstatic_file = "{peers}"\n')
    cmd = [sys.executable, "-m", "kvxferd.discovery", "--config", str(conf), "--once"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    state = json.loads(out)
    assert state["peers"] == {"p0": "tcp://127.0.0.1:5000"} and state["connected"]
    none = subprocess.run(cmd[:3], capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "backend is 'none'" in none.stderr
