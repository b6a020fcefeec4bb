"""etcd discovery: one key per daemon on a lease tied to its life, and watchers on the prefix.

The model (Dynamo's): a daemon grants a lease with ``etcd_ttl_s``, puts its
record (record.py) at ``<prefix>/<role>/<name>`` attached to the lease and keeps
the lease alive every TTL/3. When the daemon dies the keep-alives stop, the
lease expires and etcd deletes the key; every watcher of the prefix sees the
DELETE and forgets the daemon. A graceful stop revokes the lease at once.

We talk to etcd's v3 JSON gateway over HTTP with the standard library
(``http.client``): one connection per call, every call bounded by
``etcd_timeout_ms`` (the watch stream by :data:`WATCH_IDLE_S` per read), keys
and values base64 as the gateway wants them, the endpoints tried in turn.

Registrar (thread ``kvxferd-disc-lease``, owns its :class:`EtcdClient`)::

    unregistered --grant + put ok--> registered       (on_change(True))
        ^   \\--a call fails--> wait backoff (doubling up to etcd_backoff_max_ms), again
        |
    registered --every TTL/3: keep-alive + read our key-->
        keep-alive answers TTL 0 (lease gone) ---------------> unregistered (revoke, register anew)
        our key missing or on another lease -----------------> unregistered (idem)
        calls fail for longer than the TTL since the last ok -> unregistered (idem)
    stop(): revoke the lease (the key goes at once), registered False.

``registered`` flips on that thread only, under the registrar's condition.

Watcher (thread ``kvxferd-disc-etcd``, owns its client and the watch stream):
list the role's directory (a range read: the peers and a revision), make the
table equal to it, then watch from the next revision; each PUT is an add or a
change, each DELETE (explicit, or the lease expired) a removal. When the stream
ends (etcd gone, an idle read past :data:`WATCH_IDLE_S`, a compaction) it lists
and watches again, after a backoff when a call failed. Meanwhile the last peers
stay known (``connected`` is False). ``stop()`` shuts the stream's socket down
so the thread ends at once.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvxferd.discovery.record import (
    PeerRecord,
    RecordError,
    Role,
    decode_record,
    encode_record,
)
from kvxferd.discovery.registrar import ChangeCallback, Registrar
from kvxferd.discovery.watcher import EventCallback, Watcher

log = logging.getLogger("kvxferd.discovery")

WATCH_IDLE_S = 30.0  # a watch stream silent this long is re-opened (a re-list catches up)
MAX_BODY_BYTES = 64 << 20
MAX_LINE_BYTES = 16 << 20
FIRST_BACKOFF_S = 0.1


class EtcdError(Exception):
    """An etcd call that failed: no endpoint answered in time, or etcd answered an error."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code  # the gRPC status code etcd answered with; None: not reached


class Compacted(EtcdError):
    """The watch's start revision was compacted away: list again."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    lease: int
    mod_revision: int


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix`` (last byte plus one)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def _kv(obj: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(obj.get("key", "")).decode("utf-8", "replace"),
        value=base64.b64decode(obj.get("value", "")),
        lease=int(obj.get("lease", 0)),
        mod_revision=int(obj.get("mod_revision", 0)),
    )


class Backoff:
    """Delays that double from ``first_s`` up to ``cap_s``, with jitter so peers spread out."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self._next = first_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap_s, self._next * 2)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next = self.first_s


class EtcdClient:
    """etcd's v3 JSON gateway; one connection per call. Not shared between threads."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float) -> None:
        self._urls = [urlsplit(u) for u in endpoints]
        self._good = 0  # the endpoint that answered last; tried first
        self.timeout_s = timeout_s
        self._lock = (
            threading.Lock()
        )  # guards _stream, _interrupted (interrupt() is another thread's)
        self._stream: http.client.HTTPConnection | None = None
        self._interrupted = False  # sticky: a watch opened after interrupt() ends at once

    def _connection(self, i: int, timeout: float) -> http.client.HTTPConnection:
        url = self._urls[i]
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        return cls(url.hostname or "127.0.0.1", url.port, timeout=timeout)

    def _order(self) -> list[int]:
        n = len(self._urls)
        return [(self._good + k) % n for k in range(n)]

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers within the timeout."""
        payload = json.dumps(body).encode()
        last = "no endpoint"
        for i in self._order():
            conn = self._connection(i, self.timeout_s)
            try:
                conn.request("POST", path, payload, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read(MAX_BODY_BYTES + 1)
                status = resp.status
            except (OSError, http.client.HTTPException) as e:
                last = f"{self._urls[i].netloc}{path}: {e!r}"
                continue
            finally:
                conn.close()
            self._good = i
            try:
                doc = json.loads(data) if len(data) <= MAX_BODY_BYTES else None
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                raise EtcdError(f"{path}: HTTP {status}, not a JSON object")
            if status != 200 or "error" in doc:
                raise EtcdError(
                    f"{path}: {doc.get('message') or doc.get('error')}", doc.get("code")
                )
            result = doc.get("result", doc)  # streaming RPCs wrap their one message in "result"
            return result if isinstance(result, dict) else {}
        raise EtcdError(last)

    # -- leases --

    def grant(self, ttl_s: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after refreshing it; 0 when etcd no longer has it."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if e.code != 5:  # NotFound: already gone, which is what we wanted
                raise

    # -- keys --

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store's revision at that read."""
        doc = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return int(doc["header"]["revision"]), [_kv(kv) for kv in doc.get("kvs", [])]

    # -- watch --

    def watch(
        self, prefix: str, start_revision: int, idle_s: float
    ) -> Iterator[tuple[int, list[tuple[str, KeyValue]]]]:
        """(revision, [(PUT|DELETE, kv)]) for each change under ``prefix`` from ``start_revision``.

        Ends (returns) when the stream ends or is interrupted; raises EtcdError when it
        cannot be opened or etcd answers an error, :class:`Compacted` when it must list again.
        """
        create = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "start_revision": str(start_revision),
            }
        }
        i = self._order()[0]
        conn = self._connection(i, idle_s)
        with self._lock:
            if self._interrupted:
                return
            self._stream = conn
        try:
            try:
                conn.request(
                    "POST",
                    "/v3/watch",
                    json.dumps(create).encode(),
                    {"Content-Type": "application/json"},
                )
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._good = (i + 1) % len(self._urls)  # try another endpoint next time
                raise EtcdError(f"{self._urls[i].netloc}/v3/watch: {e!r}") from None
            if resp.status != 200:
                raise EtcdError(f"/v3/watch: HTTP {resp.status}")
            while True:
                try:
                    line = resp.readline(MAX_LINE_BYTES)
                except (OSError, http.client.HTTPException, ValueError):
                    return  # idle past idle_s, reset, or interrupted: the caller lists again
                if not line:
                    return
                try:
                    doc = json.loads(line)
                except ValueError:
                    raise EtcdError("/v3/watch: a line that is not JSON") from None
                if "error" in doc:
                    raise EtcdError(
                        f"/v3/watch: {doc.get('message') or doc['error']}", doc.get("code")
                    )
                res = doc.get("result", {})
                if res.get("compact_revision") and res.get("canceled"):
                    raise Compacted(f"/v3/watch: revision compacted to {res['compact_revision']}")
                if res.get("canceled"):
                    raise EtcdError(f"/v3/watch: canceled ({res.get('cancel_reason', '')})")
                events = [(ev.get("type", "PUT"), _kv(ev["kv"])) for ev in res.get("events", [])]
                yield int(res.get("header", {}).get("revision", 0)), events
        finally:
            with self._lock:
                self._stream = None
            conn.close()

    def interrupt(self) -> None:
        """End a watch blocked in a read (from another thread)."""
        with self._lock:
            self._interrupted = True
            sock = self._stream.sock if self._stream is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def directory(prefix: str, role: str) -> str:
    """``<prefix>/<role>/``: where the daemons of ``role`` keep their keys."""
    return f"{prefix.rstrip('/')}/{role}/"


class EtcdWatcher(Watcher):
    """Peers of ``role`` under ``<prefix>/<role>/``: list, then watch; again on any end."""

    backend = "etcd"

    def __init__(
        self,
        role: Role,
        endpoints: Sequence[str],
        prefix: str,
        timeout_s: float,
        backoff_max_s: float,
        on_event: EventCallback | None = None,
        idle_s: float = WATCH_IDLE_S,
    ) -> None:
        super().__init__(role, on_event)
        self.dir = directory(prefix, role)
        self.idle_s = idle_s
        self._client = EtcdClient(endpoints, timeout_s)
        self._backoff = Backoff(FIRST_BACKOFF_S, backoff_max_s)

    def _interrupt(self) -> None:
        self._client.interrupt()

    def _turn(self) -> None:
        try:
            revision, kvs = self._client.range_prefix(self.dir)
            peers = {}
            for kv in kvs:
                rec = self._decode(kv)
                if rec is not None:
                    peers[rec.name] = rec
            self._source_ok()
            self._replace_all(peers, "deleted")
            for _rev, events in self._client.watch(self.dir, revision + 1, self.idle_s):
                if self._stopping.is_set():
                    return
                for kind, kv in events:
                    self._apply(kind, kv)
            self._backoff.reset()
        except EtcdError as e:
            if not self._stopping.is_set():
                self._source_failed(str(e))
                self._stopping.wait(self._backoff.next())

    def _decode(self, kv: KeyValue) -> PeerRecord | None:
        name = kv.key[len(self.dir) :]
        try:
            rec = decode_record(kv.value)
            if rec.name != name or rec.role != self.role:
                raise RecordError(f"a record of {rec.role} {rec.name!r} under {kv.key!r}")
        except RecordError as e:
            self._malformed(kv.key, str(e))
            return None
        return rec

    def _apply(self, kind: str, kv: KeyValue) -> None:
        name = kv.key[len(self.dir) :]
        if kind == "DELETE":
            self._remove(name, "deleted (or its lease expired)")
            return
        rec = self._decode(kv)
        if rec is None:
            self._remove(name, "its record is malformed")
        else:
            self._upsert(rec)


class EtcdRegistrar(Registrar):
    """Keeps ``record`` at ``<prefix>/<role>/<name>`` on a lease kept alive every TTL/3."""

    backend = "etcd"

    def __init__(
        self,
        record: PeerRecord,
        endpoints: Sequence[str],
        prefix: str,
        ttl_s: int,
        timeout_s: float,
        backoff_max_s: float,
        on_change: ChangeCallback | None = None,
    ) -> None:
        super().__init__(record, on_change)
        self.key = directory(prefix, record.role) + record.name
        self.ttl_s = ttl_s
        self.interval_s = ttl_s / 3
        self._client = EtcdClient(endpoints, timeout_s)
        self._backoff = Backoff(FIRST_BACKOFF_S, backoff_max_s)
        self.lease = 0  # the lease our key is on; 0: none (registrar thread only)
        self._put: PeerRecord | None = None  # the record etcd holds for us
        self._last_ok = 0.0
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.counts.update({"errors": 0, "call_failures": 0})
        self._thread = threading.Thread(target=self._run, name="kvxferd-disc-lease", daemon=True)

    def start(self) -> EtcdRegistrar:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Revoke the lease (peers forget us at once) and end the thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def update(self, record: PeerRecord) -> None:
        super().update(record)
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception:
                log.exception("discovery etcd registrar: unexpected error (the thread goes on)")
                with self._cond:
                    self.counts["errors"] += 1
                self._stopping.wait(1.0)
        self._withdraw()

    def _turn(self) -> None:
        if not self.lease:
            self._register()
            return
        self._wake.wait(self.interval_s)
        self._wake.clear()
        if self._stopping.is_set():
            return
        try:
            ttl = self._client.keepalive(self.lease)
            if ttl <= 0:
                self._lost("the lease expired or was revoked")
                return
            kv = self._client.get(self.key)
            if kv is None:
                self._lost("our key is gone")
                return
            if kv.lease != self.lease:
                self._lost(f"our key is on another lease ({kv.lease}): another daemon named alike?")
                return
            record = self.record
            if record != self._put:
                self._client.put(self.key, encode_record(record), self.lease)
                self._put = record
            self._last_ok = time.monotonic()
        except EtcdError as e:
            self._failed(e)
            since = time.monotonic() - self._last_ok
            if since > self.ttl_s:
                self._lost(f"no keep-alive answered for {since:.1f}s (TTL {self.ttl_s}s): {e}")

    def _register(self) -> None:
        lease = 0
        try:
            lease = self._client.grant(self.ttl_s)
            record = self.record
            self._client.put(self.key, encode_record(record), lease)
        except EtcdError as e:
            self._failed(e)
            if lease:
                self._revoke(lease)
            self._stopping.wait(self._backoff.next())
            return
        self.lease, self._put, self._last_ok = lease, record, time.monotonic()
        self._backoff.reset()
        self._set_registered(True)

    def _lost(self, why: str) -> None:
        old, self.lease, self._put = self.lease, 0, None
        self._set_registered(False, why)
        self._revoke(old)  # a lease that still exists would keep nothing of ours; let it go

    def _failed(self, e: EtcdError) -> None:
        log.warning("discovery etcd registrar: %s", e)
        with self._cond:
            self.counts["call_failures"] += 1

    def _revoke(self, lease: int) -> None:
        try:
            self._client.revoke(lease)
        except EtcdError as e:
            log.info("discovery etcd registrar: could not revoke lease %x: %s", lease, e)

    def _withdraw(self) -> None:
        if self.lease:
            self._revoke(self.lease)
            self.lease = 0
        self._set_registered(False, "stopped")
