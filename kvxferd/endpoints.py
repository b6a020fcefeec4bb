"""ZMQ endpoints a peer may be told to connect to: checked before any socket sees them.

libzmq accepts more than kvxferd should dial, and rejects some strings only at
``connect()`` (an exception on whatever thread owns the socket). Every endpoint
that comes from a peer or an engine (a fetch's ``sender_endpoint``, a Register's
``result_endpoint``) passes :func:`connect_problem` first, on the caller's thread,
so a bad one is a typed refusal and never an exception on an io thread.

Refused, with the reason named:

* a transport other than ``tcp://`` or ``ipc://``;
* libzmq's source syntax ``tcp://src;dst`` (``tcp://allowed:0;attacker:9999``
  dials the second address);
* a wildcard host (``*``, ``0.0.0.0``, ``::``, ``[::]``): on Linux it dials this
  host, never the peer meant;
* a missing, non-numeric, zero or out-of-range port; an empty host;
* an ``ipc://`` path longer than the socket address limit (107 bytes on Linux),
  or an empty one.

The other direction: what a daemon *tells* peers and engines about itself (its
sender ``listen`` endpoint, its receiver ``result_endpoint``) is
:func:`advertised`, never the bound address when that is a wildcard: a daemon
bound to ``tcp://0.0.0.0:5555`` advertises ``tcp://<service.advertise_host>:5555``
(or the IPv4 address of ``service.advertise_interface``), and with neither set
it refuses to start (:class:`~kvxferd.errors.ConfigError`). A specific bound
address is advertised as is; port 0 advertises the port actually bound.
"""

from __future__ import annotations

import fcntl
import re
import socket
import struct

from kvxferd.errors import ConfigError

# sun_path is 108 bytes on Linux, one of them the terminating NUL.
IPC_PATH_MAX = 107

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "[0:0:0:0:0:0:0:0]"})
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")


def connect_problem(endpoint: str) -> str | None:
    """Why kvxferd will not connect to ``endpoint``, or None when it may."""
    if ";" in endpoint:
        return f"{endpoint!r}: source-address syntax (';') is not accepted"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path:
            return f"{endpoint!r}: empty ipc path"
        if len(path.encode()) > IPC_PATH_MAX:
            return f"{endpoint!r}: ipc path longer than {IPC_PATH_MAX} bytes"
        return None
    if not endpoint.startswith("tcp://"):
        return f"{endpoint!r}: only tcp:// and ipc:// endpoints are accepted"
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        return f"{endpoint!r}: expected tcp://host:port"
    if host in _WILDCARDS:
        return f"{endpoint!r}: a wildcard address dials this host; give the peer's address"
    if not _HOST.match(host):
        return f"{endpoint!r}: {host!r} is not a host name or address"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"{endpoint!r}: port must be 1-65535"
    return None


def is_wildcard(host: str) -> bool:
    """True for an address that means "every address of this host" (never dialable)."""
    return host in _WILDCARDS or host == ""


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux); OSError when it has none."""
    # SIOCGIFADDR: the interface's primary IPv4 address, without parsing `ip` output.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", name.encode()[:15])
        res = fcntl.ioctl(s.fileno(), 0x8915, req)
    return socket.inet_ntoa(res[20:24])


def advertise_host(host: str | None, interface: str | None) -> str | None:
    """The host to advertise from ``service.advertise_host`` / ``advertise_interface``.

    None when neither is set; ConfigError naming the setting when the interface has no
    IPv4 address (or does not exist).
    """
    if host is not None:
        return host
    if interface is None:
        return None
    try:
        return interface_address(interface)
    except OSError as e:
        raise ConfigError(
            f"service.advertise_interface = {interface!r}: no IPv4 address"
            f" ({e.strerror or e}); name an interface that has one (ip -4 addr)"
        ) from None


def advertised(bound: str, host: str | None, setting: str) -> str:
    """What peers are told for an endpoint bound at ``bound`` (its real port, never ``:0``).

    ``host`` (from :func:`advertise_host`) replaces the bound host; without one a
    specific bound address is advertised as is and a wildcard one is a ConfigError
    naming ``setting`` and the settings that fix it.
    """
    if not bound.startswith("tcp://"):
        return bound  # ipc: a local path, the same for every process on this host
    bound_host, _, port = bound[len("tcp://") :].rpartition(":")
    if host is not None:
        return f"tcp://{_bracket(host)}:{port}"
    if is_wildcard(bound_host):
        raise ConfigError(
            f"{setting} = {bound!r} binds every address and would advertise a wildcard;"
            " set service.advertise_host (KVXFERD_SERVICE__ADVERTISE_HOST, e.g. the pod IP)"
            " or service.advertise_interface, or bind one address"
        )
    return bound


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
