"""Endpoints kvxferd is told to connect to are checked before any socket sees them."""

from __future__ import annotations

import pytest
import zmq

from kvxferd.endpoints import IPC_PATH_MAX, connect_problem

GOOD = [
    "tcp://127.0.0.1:5555",
    "tcp://localhost:1",
    "tcp://kvxferd-sender-0.kvxferd-sender.kvxferd.svc.cluster.local:5555",
    "tcp://[::1]:5555",
    "ipc:///run/kvxferd/engine.sock",
]

BAD = {
    "tcp://no-port-here": "host:port",
    "tcp://*:5555": "wildcard",
    "tcp://0.0.0.0:5555": "wildcard",
    "tcp://[::]:5555": "wildcard",
    "tcp://127.0.0.1:1;127.0.0.1:2": "source-address",
    "tcp://127.0.0.1:0": "port",
    "tcp://127.0.0.1:70000": "port",
    "tcp://127.0.0.1:http": "port",
    "tcp://:5555": "host:port",
    "tcp://a b:5555": "not a host",
    "udp://127.0.0.1:5555": "only tcp",
    "inproc://x": "only tcp",
    "ipc://": "empty",
    "ipc:///" + "x" * IPC_PATH_MAX: "longer than",
}


@pytest.mark.parametrize("endpoint", GOOD)
def test_routable_endpoints_pass(endpoint: str) -> None:
    """A concrete host and port, or a short ipc path, is accepted."""
    assert connect_problem(endpoint) is None


@pytest.mark.parametrize(("endpoint", "why"), sorted(BAD.items()))
def test_unusable_endpoints_are_named(endpoint: str, why: str) -> None:
    """Each endpoint libzmq would reject or misroute gets a reason that names the problem."""
    problem = connect_problem(endpoint)
    assert problem is not None and why in problem


@pytest.mark.parametrize(
    "endpoint", ["tcp://no-port-here", "tcp://*:5555", "ipc:///" + "x" * (IPC_PATH_MAX + 20)]
)
def test_every_endpoint_libzmq_refuses_at_connect_is_refused_here(endpoint: str) -> None:
    """What would raise inside connect() on an io thread is caught before it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with pytest.raises(zmq.ZMQError):
            sock.connect(endpoint)
    finally:
        sock.close(linger=0)
    assert connect_problem(endpoint) is not None
