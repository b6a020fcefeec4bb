"""Discovery: how a daemon finds its peers and advertises itself (docs/discovery.md).

Two objects per daemon, both threads (never asyncio: the services they feed
are thread-based, and the daemon's event loop must not wait on etcd)::

    object        thread                 owns                      gives the daemon
    ------------  ---------------------  ------------------------  --------------------------------
    Watcher       kvxferd-disc-<backend> the source (file, DNS     PeerAdded / PeerChanged /
                                         resolver, etcd watch)     PeerRemoved via on_event (on its
                                                                   thread), snapshot() + version
    Registrar     kvxferd-disc-lease     the etcd lease and key    ``registered`` (readiness) and
                  (etcd only)                                      on_change(bool)

Backends (``[discovery] backend``): ``none`` (today's behaviour: each fetch
names its sender), ``static`` (static.py), ``dns`` (dns.py) and ``etcd``
(etcd.py). :func:`make_watcher` and :func:`make_registrar` build them from
:class:`~kvxferd.config.DiscoverySettings`.
"""

from __future__ import annotations

from kvxferd.config import DiscoverySettings
from kvxferd.discovery.record import (
    MAIN_ENDPOINT,
    PeerRecord,
    RecordError,
    Role,
    decode_record,
    encode_record,
    own_record,
)
from kvxferd.discovery.registrar import ChangeCallback, NullRegistrar, Registrar
from kvxferd.discovery.watcher import (
    EventCallback,
    PeerAdded,
    PeerChanged,
    PeerEvent,
    PeerRemoved,
    PeerSet,
    Watcher,
)

__all__ = [
    "MAIN_ENDPOINT",
    "ChangeCallback",
    "EventCallback",
    "NullRegistrar",
    "PeerAdded",
    "PeerChanged",
    "PeerEvent",
    "PeerRecord",
    "PeerRemoved",
    "PeerSet",
    "RecordError",
    "Registrar",
    "Role",
    "Watcher",
    "decode_record",
    "encode_record",
    "make_registrar",
    "make_watcher",
    "own_record",
]


def make_watcher(
    settings: DiscoverySettings, role: Role, on_event: EventCallback | None = None
) -> Watcher | None:
    """A watcher (not started) of the peers of ``role``; None for backend ``none``."""
    if settings.backend == "static":
        from kvxferd.discovery.static import StaticWatcher

        assert settings.static_file is not None  # the settings' validator
        return StaticWatcher(role, settings.static_file, settings.static_poll_ms / 1000, on_event)
    if settings.backend == "dns":
        from kvxferd.discovery.dns import DnsWatcher

        assert settings.dns_name is not None
        return DnsWatcher(
            role, settings.dns_name, settings.dns_port, settings.dns_interval_ms / 1000, on_event
        )
    if settings.backend == "etcd":
        from kvxferd.discovery.etcd import EtcdWatcher

        return EtcdWatcher(
            role,
            settings.etcd_endpoints,
            settings.etcd_prefix,
            settings.etcd_timeout_ms / 1000,
            settings.etcd_backoff_max_ms / 1000,
            on_event,
        )
    return None


def make_registrar(
    settings: DiscoverySettings, record: PeerRecord, on_change: ChangeCallback | None = None
) -> Registrar:
    """A registrar (not started) advertising ``record``; a NullRegistrar unless etcd."""
    if settings.backend == "etcd":
        from kvxferd.discovery.etcd import EtcdRegistrar

        return EtcdRegistrar(
            record,
            settings.etcd_endpoints,
            settings.etcd_prefix,
            settings.etcd_ttl_s,
            settings.etcd_timeout_ms / 1000,
            settings.etcd_backoff_max_ms / 1000,
            on_change,
        )
    return NullRegistrar(record, on_change)
