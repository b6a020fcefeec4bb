"""Who a peer is: the CURVE public key that ZAP authenticated for its connection.

The identity of a peer is never a field a message claims. With CURVE on, libzmq attaches
the User-Id that the ZAP handler returned for the connection (the client's public key in
Z85) to every message received on it; with security off (loopback and ipc only) there is
one anonymous identity, the empty string.
"""

from __future__ import annotations

import zmq

ANONYMOUS = ""  # the identity of every peer when security is off


def peer_identity(frame: zmq.Frame) -> str:
    """The authenticated identity of the peer that sent ``frame`` (``ANONYMOUS`` if none)."""
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, KeyError):
        return ANONYMOUS
    return uid if isinstance(uid, str) else ANONYMOUS
