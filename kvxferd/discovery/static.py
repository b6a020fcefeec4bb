"""Peers listed in a file (TOML or JSON), read again whenever it changes.

The file (``discovery.static_file``; ``.json`` is JSON, anything else TOML)::

    [[peers]]
    role = "sender"
    name = "prefill-0"
    incarnation = ""                               # optional
    endpoints = { listen = "tcp://10.1.2.3:5555" }
    topology = { host = "node-7", zone = "a" }     # optional

The watcher's thread checks the file's (mtime, size, inode) every
``static_poll_ms`` and reads it again when one changed, so an edit or an atomic
replace (write a temp file, rename it over) is seen within one interval. Each
entry is validated on its own: a bad one is counted and skipped, the others
apply. A file that is missing or does not parse leaves the peers as they were
(a half-written file must not make the daemon forget everyone); write
``peers = []`` to remove them all.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from kvxferd.discovery.record import PeerRecord, RecordError, Role, record_from_dict
from kvxferd.discovery.watcher import EventCallback, Watcher

MAX_FILE_BYTES = 4 << 20


class StaticWatcher(Watcher):
    """Peers of ``role`` from ``path``, re-read on change (polled every ``poll_s``)."""

    backend = "static"

    def __init__(
        self, role: Role, path: str | Path, poll_s: float, on_event: EventCallback | None = None
    ) -> None:
        super().__init__(role, on_event)
        self.path = Path(path)
        self.poll_s = poll_s
        self._seen: tuple[int, int, int] | None = None

    def _turn(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._seen = None
            self._source_failed(f"{self.path}: {e.strerror or e}")
        else:
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._seen:
                self._seen = stamp
                self._read()
        self._stopping.wait(self.poll_s)

    def _read(self) -> None:
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            text = self.path.read_text()
            doc = json.loads(text) if self.path.suffix == ".json" else tomllib.loads(text)
            entries = doc.get("peers", []) if isinstance(doc, dict) else None
            if not isinstance(entries, list):
                raise ValueError("'peers' must be a list of tables")
        except (OSError, ValueError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            self._bump("malformed")
            self._source_failed(f"{self.path}: {e}")
            return
        peers: dict[str, PeerRecord] = {}
        for i, entry in enumerate(entries):
            try:
                rec = record_from_dict(entry)
            except RecordError as e:
                self._malformed(f"{self.path} peers[{i}]", str(e))
                continue
            if rec.role == self.role:
                peers[rec.name] = rec
        self._source_ok()
        self._replace_all(peers, "not in the file")
