"""The engine protocol version one client connection speaks: the newest, or the previous
release's toward a daemon of that release.

A daemon of the previous release (kvxferd 0.1.0, engine protocol 4) answers a frame of a
version it does not speak with ``Error{unsupported_version}`` and call id 0 (it cannot read
the call id of such a frame), in its own version. One connection's dialect::

    state      entered by                        left by
    ---------  --------------------------------  --------------------------------------------
    newest     the connection opened              any other reply -> confirmed (nothing kept)
    (unsure)   (calls sent are kept, by call id)  Error{unsupported_version, call id 0} ->
                                                  previous: every kept call is sent again in it
    confirmed  a reply to a call in the newest    the connection's end (a new one starts unsure)
    previous   the daemon refused the newest      the connection's end

Invariants: a call sent while unsure is sent again at most once (it is kept until the
first reply, and the fall-back takes them all); only the first refusal falls back; the
lock orders ``encode`` (senders, under the client's send lock) against ``take`` (the
reading caller). A new connection gets a new dialect: the daemon may have been upgraded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import ChannelClosed
from kvxferd.errors import ProtocolError

log = logging.getLogger("kvxferd.engine")


class _Sends(Protocol):
    def send_blocking(self, frame: bytes, deadline: float) -> None: ...


Resend = Callable[[list[bytes]], None]


def resend_on(chan: _Sends, lock: threading.Lock, deadline: float, endpoint: str) -> Resend:
    """How a Client sends calls again: on ``chan``, under its send ``lock``, by ``deadline``."""

    def resend(frames: list[bytes]) -> None:
        try:
            with lock:
                for frame in frames:
                    chan.send_blocking(frame, deadline)
        except ChannelClosed as e:  # those calls end at their bound, as any unanswered
            log.warning("calls to %s could not be sent again: %s", endpoint, e)

    return resend


def refuses_newest(reply: ep.ToEngine) -> bool:
    """True when ``reply`` is an older daemon's refusal of a frame in our newest version."""
    return (
        isinstance(reply, ep.Error)
        and reply.call_id == 0
        and reply.reason is ep.EngineReason.UNSUPPORTED_VERSION
    )


class Dialect:
    """The version of one connection (this module's table); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = ep.ENGINE_PROTOCOL_VERSION
        self._unsure = True
        self._kept: dict[int, ep._Msg] = {}  # calls sent while unsure, by call id

    def encode(self, msg: ep._Msg) -> bytes:
        """``msg``'s frame in this connection's version (kept to resend while unsure)."""
        with self._lock:
            call_id = getattr(msg, "call_id", None)
            if self._unsure and call_id is not None:
                self._kept[call_id] = msg
            return ep.encode(msg, self.version)

    def take(self, frames: Sequence[bytes], endpoint: str, resend: Resend) -> list[ep.ToEngine]:
        """The replies in ``frames``; an older daemon's refusal of our newest version is
        not one: it switches this connection to the previous version and the calls sent
        in the newest go again, through ``resend`` (before the replies are handed on)."""
        replies: list[ep.ToEngine] = []
        again: list[bytes] = []
        for frame in frames:
            try:
                reply = ep.decode_to_engine([frame])
            except ProtocolError as e:
                log.warning("undecodable reply from %s: %s", endpoint, e)
                continue
            with self._lock:
                if self._unsure and refuses_newest(reply):
                    self.version = ep.MIN_ENGINE_PROTOCOL_VERSION
                    again = [ep.encode(m, self.version) for m in self._kept.values()]
                    self._unsure, self._kept = False, {}
                    log.info(
                        "daemon at %s speaks engine protocol %d: this connection does too",
                        endpoint,
                        self.version,
                    )
                    continue
                if self._unsure:
                    self._unsure, self._kept = False, {}
            replies.append(reply)
        if again:
            resend(again)
        return replies
