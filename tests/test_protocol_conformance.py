"""A minimal peer written from docs/protocol.md alone drives a real sender (issue 23, item 7).

Nothing here encodes or decodes through ``kvxferd.transfer.protocol``: frames are built
as the document says (``b"KX"``, the version byte, one msgpack map with ``"t"``), with
plain msgpack and plain ZMQ sockets, and the version comes from the document's own
worked example. The peer registers with a real NIXL agent and pool, fetches a published
request into its pool (done Result on its result ROUTER, as §4 says for a RequestData
without ``notify``) and checks the bytes; every reply's keys must be fields of its
message's table in §4. So the document cannot drift from the sender without this failing.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvxferd.config import load_sender_settings
from kvxferd.transfer.sender import Sender
from tests.support.peers import request_content

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DOC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text(encoding="utf-8")
LAYERS, BLOCKS, BLOCK_BYTES, AUX_SLOTS, AUX_SLOT_BYTES = 2, 32, 4096, 16, 256
WAIT_MS = 10_000


def _worked_example() -> tuple[bytes, dict[str, Any]]:
    """§2's worked example: the bytes of its hex listing and the message it names."""
    m = re.search(r"A worked example, `Cancel\{(.*?)\}` .*?```\n(.*?)```", DOC, re.S)
    assert m is not None, "docs/protocol.md lost its worked example"
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\d+)', m.group(1)))
    msg: dict[str, Any] = {"t": "cancel"}
    for k, v in fields.items():
        msg[k] = v.strip('"') if v.startswith('"') else int(v)
    data = bytearray()
    for line in m.group(2).splitlines():  # the leading two-digit hex tokens of each line
        for token in line.split():
            if not re.fullmatch(r"[0-9a-f]{2}", token):
                break
            data.append(int(token, 16))
    return bytes(data), msg


FRAME, EXAMPLE = _worked_example()
VERSION = FRAME[2]


def encode(msg: dict[str, Any]) -> bytes:
    """A frame as §2 says: magic, version, one msgpack map."""
    return b"KX" + bytes([VERSION]) + msgspec.msgpack.encode(msg)


def decode(frame: bytes) -> dict[str, Any]:
    assert frame[:2] == b"KX" and frame[2] == VERSION, frame[:3]
    out = msgspec.msgpack.decode(frame[3:])
    assert isinstance(out, dict) and isinstance(out.get("t"), str), out
    return out


def doc_fields(tag: str) -> set[str]:
    """The first cells of the §4 table under the heading of message ``tag``."""
    m = re.search(rf'^### \w+ \(`"t": "{tag}"`\).*?\n(.*?)(?=^### |^## )', DOC, re.S | re.M)
    assert m is not None, f"no §4 section for {tag!r}"
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", m.group(1), re.M))


def check_keys(msg: dict[str, Any]) -> None:
    extra = set(msg) - {"t"} - doc_fields(msg["t"])
    assert not extra, f"{msg['t']} carries keys docs/protocol.md §4 does not list: {extra}"


def test_the_worked_example_is_what_a_peer_writes() -> None:
    """§2's hex listing is exactly the frame a peer builds from the example's fields."""
    assert encode(EXAMPLE) == FRAME
    assert decode(FRAME) == EXAMPLE
    assert f"version {VERSION}" in DOC.splitlines()[0] or f"version {VERSION}" in DOC[:2000]


class MinimalReceiver:
    """A receiver peer from the document: NIXL agent and pool, request DEALER, result ROUTER."""

    def __init__(
        self,
        sender_endpoint: str,
        curve: tuple[bytes, bytes, bytes] | None = None,
        curve_results: bool = True,
    ) -> None:
        """``curve``: (public, secret, the sender's public key): the request DEALER is a CURVE
        client with that pair, and the result ROUTER a CURVE server with it when
        ``curve_results`` (§1), else plaintext."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.receiver_id = f"conformance-{secrets.token_hex(6)}"
        self.agent = nixl_agent(
            self.receiver_id, nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "peer", "num_workers": "1"})
        self.kv = torch.zeros((LAYERS, BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        self.aux = torch.zeros((AUX_SLOTS, AUX_SLOT_BYTES), dtype=torch.uint8)
        self.regs = [
            self.agent.register_memory([self.kv], mem_type="DRAM"),
            self.agent.register_memory([self.aux], mem_type="DRAM"),
        ]
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.ROUTER)
        self.results.linger = 0
        if curve is not None and curve_results:
            self.results.curve_publickey, self.results.curve_secretkey = curve[:2]
            self.results.curve_server = True
        port = self.results.bind_to_random_port("tcp://127.0.0.1")
        self.result_endpoint = f"tcp://127.0.0.1:{port}"
        self.requests = self.ctx.socket(zmq.DEALER)
        self.requests.linger = 0
        if curve is not None:
            public, secret, server = curve
            self.requests.curve_publickey, self.requests.curve_secretkey = public, secret
            self.requests.curve_serverkey = server
        self.requests.connect(sender_endpoint)

    def send(self, msg: dict[str, Any]) -> None:
        self.requests.send(encode(msg), zmq.NOBLOCK)

    def reply(self) -> dict[str, Any]:
        assert self.requests.poll(WAIT_MS), "no reply from the sender's listener"
        msg = decode(self.requests.recv())
        check_keys(msg)
        return msg

    def result(self) -> dict[str, Any]:
        assert self.results.poll(WAIT_MS), "no message on the result ROUTER"
        *_, frame = self.results.recv_multipart()
        msg = decode(frame)
        check_keys(msg)
        return msg

    def result_anywhere(self) -> dict[str, Any]:
        """The next message on either socket (§4: a Result comes on either, §1)."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while time.monotonic() < deadline:
            self.agent.get_new_notifs()  # §7: the receiver's agent must be progressed
            if self.results.poll(1):
                return self.result()
            if self.requests.poll(1):
                return self.reply()
        raise AssertionError("no Result on either socket")

    def register(self) -> dict[str, Any]:
        self.send(
            {
                "t": "register",
                "receiver_id": self.receiver_id,
                "result_endpoint": self.result_endpoint,
                "agent_metadata": self.agent.get_agent_metadata(),
                "layout": {
                    "num_layers": LAYERS,
                    "num_blocks": BLOCKS,
                    "block_bytes": BLOCK_BYTES,
                    "dtype": "uint8",
                    "aux_slots": AUX_SLOTS,
                    "aux_slot_bytes": AUX_SLOT_BYTES,
                },
                "kv_base": self.kv.data_ptr(),
                "aux_base": self.aux.data_ptr(),
            }
        )
        return self.reply()

    def close(self) -> None:
        self.requests.close()
        self.results.close()
        self.ctx.term()
        for reg in self.regs:
            self.agent.deregister_memory(reg)


def _start_sender(**extra: Any) -> Sender:
    """A sender of the pool every test peer registers with."""
    return Sender(
        load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=1,
            pool=dict(
                num_layers=LAYERS,
                num_blocks=BLOCKS,
                block_elems=BLOCK_BYTES,
                dtype="uint8",
                aux_slots=AUX_SLOTS,
                aux_slot_bytes=AUX_SLOT_BYTES,
            ),
            deadlines=dict(
                kv_transfer_timeout_ms=5000, drain_timeout_ms=500, shutdown_timeout_ms=3000
            ),
            **extra,
        )
    ).start()


@pytest.fixture
def sender() -> Iterator[Sender]:
    tx = _start_sender()
    try:
        yield tx
    finally:
        tx.shutdown(3.0)


def test_a_peer_written_from_the_document_registers_fetches_and_is_refused_as_it_says(
    sender: Sender,
) -> None:
    peer = MinimalReceiver(sender.endpoint)
    try:
        # §4 RegisterReply: an accepted one carries t, ok and sender_id (fields at their
        # default are left out, §2)
        reply = peer.register()
        assert reply["t"] == "register_reply" and reply["ok"] is True, reply
        assert set(reply) <= {"t", "ok", "sender_id", "topology"}, reply
        assert isinstance(reply["sender_id"], str) and reply["sender_id"]

        # §9.2: a published request, a RequestData without notify -> Result{done} on the
        # result ROUTER once every WRITE completed; the bytes are in our pool
        src = np.arange(3, dtype=np.int64)
        dst = np.array([7, 11, 30], dtype=np.int64)
        content = request_content("conf-1", LAYERS, src.size, BLOCK_BYTES)
        sender.pool.kv_bytes_view()[:, torch.from_numpy(src)] = content
        handle = sender.publish("conf-1", src)
        peer.send(
            {
                "t": "request_data",
                "request_id": "conf-1",
                "fetch_id": 1001,
                "dst_blocks": dst.tolist(),
                "timeout_ms": 5000,
            }
        )
        res = peer.result_anywhere()
        assert res["t"] == "result" and res["fetch_id"] == 1001, res
        assert res["status"] == "done", (res, sender.stats.snapshot())
        assert torch.equal(peer.kv[:, torch.from_numpy(dst)], content), "bytes differ"
        handle.close()

        # §4 Result: a RequestData for a request nobody published parks, then a Cancel is
        # acknowledged (CancelAck with its fetch id) once no write toward it is in flight
        peer.send(
            {
                "t": "request_data",
                "request_id": "conf-never",
                "fetch_id": 1002,
                "dst_blocks": [1],
                "timeout_ms": 5000,
            }
        )
        peer.send({"t": "cancel", "request_id": "conf-never", "fetch_id": 1002})
        deadline = time.monotonic() + WAIT_MS / 1000
        acked = None
        while acked is None and time.monotonic() < deadline:
            for sock, get in ((peer.requests, peer.reply), (peer.results, peer.result)):
                if sock.poll(50):
                    msg = get()
                    if msg["t"] == "cancel_ack" and msg["fetch_id"] == 1002:
                        acked = msg
        assert acked is not None, "no CancelAck for the cancelled parked fetch"
        assert acked.get("in_doubt") is False, acked

        # §2 decoding: a version this sender does not speak -> Reject{unsupported_version};
        # a map without "t" -> Reject{malformed}
        peer.requests.send(b"KX" + bytes([VERSION + 1]) + msgspec.msgpack.encode({"t": "cancel"}))
        rej = peer.reply()
        assert rej["t"] == "reject" and rej["reason"] == "unsupported_version", rej
        peer.send({"request_id": "x", "fetch_id": 1})
        rej = peer.reply()
        assert rej["t"] == "reject" and rej["reason"] == "malformed", rej
    finally:
        peer.close()


@pytest.fixture
def curve_sender(tmp_path: Path) -> Iterator[tuple[Sender, tuple[bytes, bytes, bytes]]]:
    """A CURVE sender whose allow-list holds one peer key, and that peer's CURVE triple."""
    import zmq.auth

    for name in ("tx", "peer"):
        (tmp_path / name).mkdir()
        zmq.auth.create_certificates(str(tmp_path / name), name)
        (tmp_path / name / f"{name}.key_secret").chmod(0o600)
    allow = tmp_path / "allow"
    allow.mkdir()
    (allow / "peer.key").write_bytes((tmp_path / "peer" / "peer.key").read_bytes())
    tx_public, _ = zmq.auth.load_certificate(str(tmp_path / "tx" / "tx.key"))
    public, secret = zmq.auth.load_certificate(str(tmp_path / "peer" / "peer.key_secret"))
    assert secret is not None
    tx = _start_sender(
        security=dict(
            mode="curve",
            key_file=str(tmp_path / "tx" / "tx.key_secret"),
            allowed_keys_dir=str(allow),
        )
    )
    try:
        yield tx, (public, secret, tx_public)
    finally:
        tx.shutdown(3.0)


@pytest.mark.parametrize("curve_results", [True, False], ids=["curve-results", "plain-results"])
def test_with_curve_a_result_reaches_only_a_curve_result_router_with_the_register_key(
    curve_sender: tuple[Sender, tuple[bytes, bytes, bytes]], curve_results: bool
) -> None:
    """With CURVE on, the done Result reaches a result ROUTER that is a CURVE server with the Register's key pair; a plaintext one gets nothing although the bytes land (§1)."""
    sender, curve = curve_sender
    peer = MinimalReceiver(sender.endpoint, curve, curve_results)
    try:
        reply = peer.register()
        assert reply["ok"] is True, reply
        src = np.array([1], dtype=np.int64)
        sender.pool.kv_bytes_view()[:, torch.from_numpy(src)] = 7
        handle = sender.publish("curve-req", src)
        peer.send(
            {"t": "request_data", "request_id": "curve-req", "fetch_id": 9, "dst_blocks": [2]}
        )
        if curve_results:
            result = peer.result_anywhere()
            assert (result["t"], result["status"]) == ("result", "done"), result
        else:
            deadline = time.monotonic() + WAIT_MS / 1000
            while sender.stats.get("sent_result") < 1:  # the sender sent its done Result
                assert time.monotonic() < deadline, "the sender never sent the Result"
                peer.agent.get_new_notifs()
                time.sleep(0.02)
            assert bool((peer.kv[:, 2] == 7).all()), "the bytes did not land"
            # Nothing arrives in the time a CURVE result ROUTER gets it many times over.
            assert not peer.results.poll(1000), "a Result reached a plaintext result ROUTER"
        handle.close(timeout=WAIT_MS / 1000)
    finally:
        peer.close()
