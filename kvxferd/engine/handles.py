"""The engine handles of one gateway: each handle by id, and the open Publish/Fetch of each key.

A handle is what a Publish or Fetch opened (the service's TxHandle or RxHandle). The
engine names it by id in Wait, Poll, Cancel and Close, and finds it again by the call's
key (roles.py: a Publish by request id, a Fetch by request id, sender endpoint and
layer range) in a retried Publish/Fetch or a Lookup. A key's states::

    key state     _work[key]                  a Publish/Fetch with that key        Lookup
    ------------  --------------------------  -----------------------------------  --------------
    free          absent                      runs; -> open (stays free if it      unknown_handle
                                              failed or expired)
    open          _Work with its handle id    same parameters: that handle; other  that handle
                                              parameters: duplicate
    (Close(safe) of the handle: open -> free)

Invariants:

- A handle id comes from a counter that starts at the daemon's start time in ms shifted
  left by 20 bits, so no id is ever reused, not even by a restarted daemon.
- A handle serves the connections that created it or found it by key (a retried
  Publish/Fetch or a Lookup; the last ``MAX_OWNERS``, oldest dropped first); any other
  connection does not see it.
- A key maps to at most one handle; a key whose handle is gone counts as free (its
  ``_work`` record is dropped when next looked at).
- ``forget`` drops a handle only when its close reported the memory safe; otherwise it
  stays so the engine can Poll or Close again.
- At most ``max_handles`` handles: one more Publish/Fetch is refused (``full``).

Known limit: handles of an engine that died stay in the table (bounded by
``max_handles``) until an engine finds them by key and closes them, or the daemon
stops; the service ends their sessions (publish_ttl / kv_transfer_timeout) meanwhile.
A streamed publish is the exception: once no open connection on the unix socket holds
its handle (``orphaned``), a stream still open is cancelled at once, so its fetches
fail now rather than at the stall bound (a tcp:// engine socket sees no connection
close: there ``stream_stall_timeout_ms`` ends it).

Owner: the gateway's io thread, the only thread that touches the table (no lock). It
counts the retries it answers with an open handle (``calls_found_by_key``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kvxferd.engine.roles import Key
from kvxferd.stats import Stats
from kvxferd.transfer.receiver import RxHandle
from kvxferd.transfer.sender import TxHandle

MAX_HANDLES = 65_536  # live handles across all engines; one more publish/fetch gets BUSY
MAX_OWNERS = 16  # connections that may use one handle (its creator, then those that found it)


@dataclass(slots=True)
class Entry:
    """One open handle: what its Publish/Fetch opened, its key, the connections it serves."""

    owners: list[bytes]  # connections that may use the handle, oldest first
    handle: TxHandle | RxHandle
    key: Key
    token: str = ""  # a publish's fetch token (the same in every reply for this handle)


@dataclass(slots=True)
class _Work:
    """One Publish/Fetch key in use: its parameters' digest and its handle id."""

    digest: bytes
    handle_id: int


class HandleTable:
    """Open handles by id and by key, with the connections each one serves; io thread only."""

    def __init__(self, stats: Stats, max_handles: int = MAX_HANDLES) -> None:
        self.stats = stats
        self.max_handles = max_handles
        start_ms = time.time_ns() // 1_000_000
        self._handle_ids = itertools.count((start_ms << 20) + 1)  # never an earlier daemon's
        self._handles: dict[int, Entry] = {}
        self._work: dict[Key, _Work] = {}

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def full(self) -> bool:
        """``max_handles`` are open: a new Publish/Fetch is refused."""
        return len(self._handles) >= self.max_handles

    def __getitem__(self, handle_id: int) -> Entry:
        return self._handles[handle_id]

    def owned(self, rid: bytes, handle_id: int) -> Entry | None:
        """The handle ``handle_id`` if connection ``rid`` may use it, else None."""
        entry = self._handles.get(handle_id)
        return None if entry is None or rid not in entry.owners else entry

    def open_work(self, key: Key) -> _Work | None:
        """The open Publish/Fetch of ``key`` (its digest and handle id); None: the key is free."""
        work = self._work.get(key)
        return work if work is not None and work.handle_id in self._handles else None

    def open(
        self, rid: bytes, handle: TxHandle | RxHandle, key: Key, digest: bytes, token: str
    ) -> int:
        """A new handle for the free ``key``, served to ``rid``: its id (free -> open)."""
        hid = next(self._handle_ids)
        self._handles[hid] = Entry([rid], handle, key, token)
        self._work[key] = _Work(digest, hid)
        return hid

    def retried(self, rid: bytes, key: Key) -> int:
        """A retry of ``key``'s open call (same parameters): its handle, now served to ``rid`` too."""
        found = self.share(rid, key)
        assert found is not None
        self.stats.add("calls_found_by_key")
        return found

    def share(self, rid: bytes, key: Key) -> int | None:
        """The open handle of ``key``, now also usable by connection ``rid``; None: key free."""
        work = self._work.get(key)
        entry = None if work is None else self._handles.get(work.handle_id)
        if work is None or entry is None:
            self._work.pop(key, None)
            return None
        if rid not in entry.owners:
            entry.owners.append(rid)
            del entry.owners[:-MAX_OWNERS]
        return work.handle_id

    def forget(self, handle_id: int, entry: Entry, safe: bool) -> None:
        """The handle was closed: dropped with its key (open -> free) only when ``safe``."""
        if safe and self._handles.get(handle_id) is entry:
            del self._handles[handle_id]
            work = self._work.get(entry.key)
            if work is not None and work.handle_id == handle_id:
                del self._work[entry.key]

    def orphaned(self, rid: bytes, live: set[bytes]) -> list[Entry]:
        """Connection ``rid`` closed: the handles it held that no connection in ``live`` holds."""
        return [
            e
            for e in self._handles.values()
            if rid in e.owners and not any(o in live for o in e.owners if o != rid)
        ]

    def clear(self) -> None:
        """The gateway stopped: every handle and key is forgotten."""
        self._handles.clear()
        self._work.clear()
