"""Peers from a DNS name: a Kubernetes headless Service, one peer per A/AAAA address.

Every ``dns_interval_ms`` the watcher's thread resolves ``dns_name`` with the
standard library's resolver (``socket.getaddrinfo``, through the system's
resolv.conf: in a pod, the cluster DNS and its search domains). Each address is
one peer named by the address, dialled at ``tcp://ADDRESS:dns_port``; its
incarnation is unknown here ("") and learnt at the handshake. A headless
Service lists only Ready pods (unless ``publishNotReadyAddresses``), so a daemon
that goes not-ready leaves its peers' lists within one interval plus the DNS TTL.

"No such name" (a headless Service with no Ready pod answers NXDOMAIN) means no
peers: they are removed. A temporary failure (no answer, a resolver timeout)
keeps the last peers and marks the watcher disconnected.

The standard library cannot ask for SRV records, so the port is configured
(``dns_port``), not read from a named port.

``getaddrinfo`` has no timeout of its own; it is bounded by the resolver's
(resolv.conf ``timeout``/``attempts``, 5 s x 2 by default). The resolution runs
on a short-lived helper thread so that ``stop()`` never waits for it.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

from kvxferd.discovery.record import MAIN_ENDPOINT, PeerRecord, Role
from kvxferd.discovery.watcher import EventCallback, Watcher

RESOLVE_TIMEOUT_S = 15.0  # past the resolver's own retries: give up this round


def _endpoint(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"tcp://{host}:{port}"


class DnsWatcher(Watcher):
    """Peers of ``role`` at the addresses ``name`` resolves to, each on ``port``."""

    backend = "dns"

    def __init__(
        self,
        role: Role,
        name: str,
        port: int,
        interval_s: float,
        on_event: EventCallback | None = None,
    ) -> None:
        super().__init__(role, on_event)
        self.name = name
        self.port = port
        self.interval_s = interval_s

    def _turn(self) -> None:
        addresses = self._resolve()
        if addresses is not None:
            peers = {}
            for addr in sorted(addresses):
                rec = PeerRecord(
                    role=self.role,
                    name=addr,
                    endpoints={MAIN_ENDPOINT[self.role]: _endpoint(addr, self.port)},
                    topology={"dns_name": self.name},
                )
                peers[addr] = rec
            self._source_ok()
            self._replace_all(peers, f"not in the DNS answer for {self.name}")
        self._stopping.wait(self.interval_s)

    def _resolve(self) -> set[str] | None:
        """The addresses of ``name``; an empty set for no such name; None on a temporary failure."""
        box: dict[str, object] = {}

        def resolve() -> None:
            try:
                box["infos"] = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
            except socket.gaierror as e:
                box["error"] = e
            except Exception as e:  # noqa: BLE001 - reported below, never kills the watcher
                box["error"] = e

        t = threading.Thread(target=resolve, name="kvxferd-disc-dns-resolve", daemon=True)
        t.start()
        deadline = time.monotonic() + RESOLVE_TIMEOUT_S
        while t.is_alive() and time.monotonic() < deadline and not self._stopping.is_set():
            t.join(0.1)
        if self._stopping.is_set():
            return None
        if t.is_alive():
            self._source_failed(f"resolving {self.name}: no answer within {RESOLVE_TIMEOUT_S:g}s")
            return None
        err = box.get("error")
        if isinstance(err, socket.gaierror) and err.errno == socket.EAI_NONAME:
            return set()
        if err is not None:
            self._source_failed(f"resolving {self.name}: {err}")
            return None
        out = set()
        for _family, _type, _proto, _canon, sockaddr in box["infos"]:  # type: ignore[attr-defined]
            addr = str(sockaddr[0]).split("%", 1)[0]  # drop an IPv6 scope id
            out.add(addr)
        return out
