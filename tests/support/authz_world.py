"""CURVE for the authorisation tests: real authenticated identities without the daemons' own key settings.

:class:`CurveWorld` replaces kvxferd's process ZMQ context (``control._context``)
with one whose sockets speak CURVE: every ROUTER kvxferd binds is a CURVE server
with the key pair named by :meth:`CurveWorld.serving`, and every DEALER that
connects to one of those endpoints is a CURVE client with the key pair
registered for it (:meth:`CurveWorld.dial_as`). A ZAP handler (pyzmq's
ThreadAuthenticator, any key allowed) authenticates every client, so each
message carries its sender's key as User-Id, exactly as with ``security.mode =
"curve"``. :class:`CurvePeer` is tests/test_races.py's raw receiver with a key of
its own (and, optionally, a chosen routing id).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvxferd.transfer import control
from kvxferd.transfer.sender import Sender
from tests.test_races import RawPeer


@dataclass(frozen=True)
class Keys:
    """A CURVE key pair; ``identity`` is what kvxferd.auth.peer_identity reads for it."""

    public: bytes
    secret: bytes

    @classmethod
    def new(cls) -> Keys:
        return cls(*zmq.curve_keypair())

    @property
    def identity(self) -> str:
        return self.public.decode()


class _CurveSocket(zmq.Socket):  # type: ignore[type-arg]
    world: CurveWorld

    def bind(self, addr: str) -> Any:
        keys = self.world.server_keys
        if keys is not None:
            self.curve_server = True
            self.curve_secretkey = keys.secret
            self.curve_publickey = keys.public
        out = super().bind(addr)
        if keys is not None:
            bound = self.getsockopt(zmq.LAST_ENDPOINT)
            self.world.servers[bound.decode() if isinstance(bound, bytes) else str(bound)] = keys
        return out

    def connect(self, addr: str) -> Any:
        server = self.world.servers.get(addr)
        if server is not None:
            me = self.world.clients.get(addr) or self.world.default_client
            self.curve_serverkey = server.public
            self.curve_publickey = me.public
            self.curve_secretkey = me.secret
        return super().connect(addr)


class CurveWorld:
    """A process context whose kvxferd sockets are CURVE servers and clients (see module doc)."""

    def __init__(self) -> None:
        world = self

        class Sock(_CurveSocket):
            pass

        Sock.world = world

        class Ctx(zmq.Context):  # type: ignore[type-arg]
            _socket_class = Sock

        self.ctx = Ctx()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        self.lock = threading.Lock()
        self.server_keys: Keys | None = None
        self.servers: dict[str, Keys] = {}  # bound endpoint -> its server keys
        self.clients: dict[str, Keys] = {}  # endpoint -> the keys kvxferd's DEALERs dial it with
        self.default_client = Keys.new()

    def serving(self, keys: Keys) -> CurveWorld:
        """ROUTERs bound from now on serve with ``keys`` (set it before building a daemon)."""
        self.server_keys = keys
        return self

    def dial_as(self, endpoint: str, keys: Keys) -> None:
        """kvxferd's DEALERs connecting to ``endpoint`` authenticate with ``keys``."""
        self.clients[endpoint] = keys

    def server_of(self, endpoint: str) -> Keys:
        return self.servers[endpoint]

    def close(self) -> None:
        self.auth.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[CurveWorld]:
    w = CurveWorld()
    monkeypatch.setattr(control, "_context", w.ctx)
    try:
        yield w
    finally:
        monkeypatch.undo()
        w.close()


class CurvePeer(RawPeer):
    """A raw receiver whose DEALER authenticates with ``keys`` (routing id ``route`` if given)."""

    def __init__(
        self,
        world: CurveWorld,
        sx: Sender,
        keys: Keys,
        receiver_id: str,
        result_endpoint: str | None = None,
        *,
        route: bytes | None = None,
        metadata: bytes | None = None,
    ) -> None:
        super().__init__(sx, receiver_id, result_endpoint)
        self.dealer.close(linger=0)
        self.keys = keys
        self.metadata = metadata if metadata is not None else receiver_id.encode()
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.curve_serverkey = world.server_of(sx.bound_endpoint).public
        d.curve_publickey = keys.public
        d.curve_secretkey = keys.secret
        if route is not None:
            d.setsockopt(zmq.ROUTING_ID, route)
        d.connect(sx.bound_endpoint)
        self.dealer = d

    def try_register(self) -> Any:
        from kvxferd.transfer import protocol as wire

        self._send(
            wire.Register(
                receiver_id=self.receiver_id,
                result_endpoint=self.result_endpoint,
                agent_metadata=self.metadata,
                layout=self.layout,
                kv_base=0,
                aux_base=0,
            )
        )
        reply = self.next_message()
        assert isinstance(reply, wire.RegisterReply), reply
        return reply
