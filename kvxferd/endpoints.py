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
"""

from __future__ import annotations

import re

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
