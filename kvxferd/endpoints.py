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

Before a receiver dials a sender endpoint that came from request data (a fetch's
``sender_endpoint``), the endpoint must also pass the operator's allow-list
(:class:`DialAllow`, setting ``dial_allow``), read by a strict parser
(:func:`parse_endpoint`) that accepts exactly ``tcp://HOST:PORT`` (HOST a host
name, a dotted IPv4 address or a bracketed IPv6 address; PORT 1-65535 in plain
decimal) or ``ipc://PATH``, and nothing libzmq would read differently: no source
address (``;``), no userinfo (``@``), no path, query or fragment, no whitespace or
control characters, no wildcard. The rules (``HOST[:PORTS]``, ``CIDR[:PORTS]``,
``[IPV6-OR-CIDR][:PORTS]``, ``ipc://PREFIX``; PORTS ``N`` or ``N-M``, none: any)
match literally: a host name matches only the same name (kvxferd never resolves a
name to check it, libzmq would resolve it again), a CIDR only literal addresses.
With no rules, loopback (``127.0.0.0/8``, ``::1``, ``localhost``) and ipc are allowed.

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
import ipaddress
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

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


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[1-9][0-9]{0,4}$")
_IPV4ISH = re.compile(r"^[0-9.]+$")
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class ParsedEndpoint:
    """An endpoint :func:`parse_endpoint` accepted: ``tcp`` with host and port, or ``ipc`` with a path."""

    scheme: str  # "tcp" or "ipc"
    host: str = ""  # a host name (lower case) or an address's text, brackets removed
    address: IpAddress | None = None  # the host as an address, when it is one
    port: int = 0
    path: str = ""  # ipc only


def parse_endpoint(endpoint: str) -> ParsedEndpoint:
    """``endpoint`` read strictly (see the module docstring); ValueError saying why not."""
    if not endpoint or len(endpoint) > 256:
        raise ValueError("empty or longer than 256 characters")
    if any(c.isspace() or not c.isprintable() or ord(c) > 126 for c in endpoint):
        raise ValueError("whitespace, control or non-ASCII characters")
    why = connect_problem(endpoint)  # source syntax, schemes, wildcards, ports, ipc paths
    if why is not None:
        raise ValueError(why.removeprefix(f"{endpoint!r}: "))
    if endpoint.startswith("ipc://"):
        return ParsedEndpoint("ipc", path=endpoint[len("ipc://") :])
    rest = endpoint[len("tcp://") :]
    for c in "@/?#\\%*":
        if c in rest:
            raise ValueError(f"{c!r} is not accepted in a tcp endpoint")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError("expected tcp://host:port")
    if not _PORT.match(port) or int(port) > 65535:
        raise ValueError("port must be 1-65535 in plain decimal")
    address = _host_address(host)
    if address is not None:
        if address.is_unspecified:
            raise ValueError("a wildcard address dials this host; give the peer's address")
        return ParsedEndpoint("tcp", str(address), address, int(port))
    return ParsedEndpoint("tcp", host.lower(), None, int(port))


def _host_address(host: str) -> IpAddress | None:
    """``host`` as an address (IPv6 in brackets), None for a valid host name; ValueError else."""
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{host!r}: unbalanced brackets")
        try:
            return ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    if ":" in host:
        raise ValueError(f"{host!r}: an IPv6 address needs brackets")
    if _IPV4ISH.match(host):
        try:
            return ipaddress.IPv4Address(host)  # strict: four parts, no leading zeros
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
    labels = host.rstrip(".").split(".") if len(host) <= 253 else [""]
    if not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} is not a host name or address")
    return None


@dataclass(frozen=True, slots=True)
class _Rule:
    text: str
    name: str = ""  # a host name rule (lower case)
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    ipc_prefix: str | None = None
    ports: tuple[int, int] = (1, 65535)

    def allows(self, ep: ParsedEndpoint) -> bool:
        if ep.scheme == "ipc":
            return self.ipc_prefix is not None and ep.path.startswith(self.ipc_prefix)
        if self.ipc_prefix is not None or not self.ports[0] <= ep.port <= self.ports[1]:
            return False
        if self.network is not None:
            return ep.address is not None and ep.address in self.network
        return ep.address is None and ep.host == self.name


def _rule(text: str) -> _Rule:
    """One ``dial_allow`` entry; ValueError naming what is wrong."""
    if text.startswith("ipc://"):
        return _Rule(text, ipc_prefix=text[len("ipc://") :])
    if not text or any(c.isspace() for c in text) or "://" in text or ";" in text:
        raise ValueError("expected HOST[:PORTS], CIDR[:PORTS], [IPV6][:PORTS] or ipc://PREFIX")
    host, ports = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("unbalanced brackets")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("expected ':PORTS' after ']'")
        ports = rest[1:]
    elif text.count(":") == 1:
        host, ports = text.split(":")
    elif ":" in text:  # a bare IPv6 address or network, no port
        host = text
    lo, hi = 1, 65535
    if ports:
        a, _, b = ports.partition("-")
        if not _PORT.match(a) or (b and not _PORT.match(b)):
            raise ValueError(f"ports {ports!r}: N or N-M, 1-65535")
        lo, hi = int(a), int(b or a)
        if not lo <= hi <= 65535:
            raise ValueError(f"ports {ports!r}: N or N-M, 1-65535")
    if host in _WILDCARDS or host in ("", "*"):
        raise ValueError("a wildcard host would allow every address")
    if not ("/" in host or ":" in host or _IPV4ISH.match(host)):
        _host_address(host)  # a host name: ValueError unless it is a valid one
        return _Rule(text, name=host.lower().rstrip("."), ports=(lo, hi))
    try:
        network = ipaddress.ip_network(host, strict=True)
    except ValueError:
        raise ValueError(f"{host!r} is not an address or network") from None
    if network.prefixlen == 0:
        raise ValueError("a /0 network would allow every address")
    return _Rule(text, network=network, ports=(lo, hi))


LOOPBACK_RULES: tuple[str, ...] = ("127.0.0.0/8", "[::1]", "localhost", "ipc://")


_VERDICTS_KEPT = 4096  # endpoints whose dial verdict DialAllow keeps


class DialAllow:
    """The endpoints a receiver may dial for a fetch (setting ``dial_allow``; see the module doc)."""

    def __init__(self, entries: Sequence[str] = ()) -> None:
        self.entries = tuple(entries) or LOOPBACK_RULES
        rules = []
        for entry in self.entries:
            try:
                rules.append(_rule(entry))
            except ValueError as e:
                raise ConfigError(f"dial_allow entry {entry!r}: {e}") from None
        self._rules = tuple(rules)
        self._verdicts: dict[str, tuple[bool, str] | None] = {}  # see ``verdict``

    def problem(self, endpoint: str) -> str | None:
        """Why ``endpoint`` may not be dialled (unparsable, or no rule allows it), or None."""
        try:
            ep = parse_endpoint(endpoint)
        except ValueError as e:
            return f"{endpoint!r}: {e}"
        if any(rule.allows(ep) for rule in self._rules):
            return None
        return f"{endpoint!r} is not in dial_allow ({', '.join(self.entries)})"

    def __repr__(self) -> str:
        return f"DialAllow({list(self.entries)!r})"

    def verdict(self, endpoint: str) -> tuple[bool, str] | None:
        """Why ``endpoint`` may not be dialled, or None: ``(False, why)`` when libzmq would
        read it otherwise (``connect_problem``), ``(True, why)`` when these rules do not
        admit it. Kept per endpoint (the rules never change): parsing an address per
        fetch was a fifth of a receiver's io thread per small request (issue 22)."""
        cache = self._verdicts
        if endpoint in cache:
            return cache[endpoint]
        problem = connect_problem(endpoint)
        if problem is not None:
            verdict: tuple[bool, str] | None = (False, problem)
        else:
            why = self.problem(endpoint)
            verdict = None if why is None else (True, why)
        if len(cache) >= _VERDICTS_KEPT:
            cache.clear()
        cache[endpoint] = verdict
        return verdict


def is_local_endpoint(endpoint: str) -> bool:
    """True for an ipc:// endpoint or a tcp:// one on a loopback address (or ``localhost``)."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve anywhere


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
