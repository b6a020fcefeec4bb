"""docs/vllm.md's 1P1D recipe: two OpenAI servers, the daemons and the example proxy give monolithic tokens.

The servers run as docs/vllm.md starts them (the CPU wheel's ``vllm serve`` cannot
read its own version, so ``python -m vllm.entrypoints.openai.api_server``), with
vLLM's engine core in its own process (the default), and the proxy forwards
``kv_transfer_params`` from the prefill server's response to the decode server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.conditions import wait_until
from tests_vllm.conftest import Rig
from tests_vllm.rig import ROOT, counter
from tests_vllm.test_pd import BLOCK, BLOCK_BYTES, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SERVER_START_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Children:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, stdout=log, stderr=log, env=env
        )
        self.procs.append((p, log))

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        for p, log in self.procs:
            p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            log.close()


@pytest.fixture
def children(rig: Rig) -> Iterator[Children]:
    c = Children(Path(rig.sock_dir))
    yield c
    c.close()


def server_args(model: Path, port: int, role: str, socket_: str) -> list[str]:
    ktc = {
        "kv_connector": "KvxferdConnector",
        "kv_connector_module_path": "kvxferd.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"engine_socket": socket_},
    }
    return [
        "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--port", str(port), "--block-size", str(BLOCK),
        "--max-model-len", "512", "--no-enable-prefix-caching", "--dtype", "float32",
        "--enforce-eager", "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(64 << 20),
        "--kv-transfer-config", json.dumps(ktc),
    ]  # fmt: skip


def stream(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return int(r.status), r.read().decode()


def test_proxy_between_two_servers(rig: Rig, children: Children) -> None:
    """Completions through the proxy, prefill-first and decode-first, equal the decode
    server's own; each prompt's KV crossed the daemons, and each response's receipt and
    the proxy's log line say loaded."""
    tx, rx = rig.daemon("sender", "tx"), rig.daemon("receiver", "rx")
    tx.wait_ready()
    rx.wait_ready()
    p_port, d_port, x_port, f_port = free_port(), free_port(), free_port(), free_port()
    children.start("prefill", server_args(rig.model, p_port, "kv_producer", tx.engine_socket))
    children.start("decode", server_args(rig.model, d_port, "kv_consumer", rx.engine_socket))
    for name, port, mode in (
        ("proxy", x_port, "prefill-first"),
        ("proxy-df", f_port, "decode-first"),
    ):
        children.start(
            name,
            ["kvxferd.integrations.vllm", "proxy", "--prefill", f"http://127.0.0.1:{p_port}",
             "--decode", f"http://127.0.0.1:{d_port}", "--port", str(port), "--mode", mode,
             "--timeout-s", "120"],
        )  # fmt: skip
    for name, port in (
        ("prefill", p_port),
        ("decode", d_port),
        ("proxy", x_port),
        ("proxy-df", f_port),
    ):
        path = "/healthz" if name.startswith("proxy") else "/health"
        try:
            wait_until(
                lambda port=port, path=path: up(f"http://127.0.0.1:{port}{path}"),
                SERVER_START_S,
                name,
                0.5,
            )
        except AssertionError:
            raise AssertionError(f"{name} did not come up\n{children.tail(name)}") from None

    ps = prompts([1, 36, 64, 150], seed=21)
    for port in (x_port, f_port):  # the decode-first proxy's first request learns the senders
        before = counter(rx.probe_port, "kvxferd_bytes")
        receipts = []
        for p in ps:
            body = {"model": str(rig.model), "prompt": p, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            answer = post(f"http://127.0.0.1:{port}/v1/completions", body)
            via = answer["choices"][0]["token_ids"]
            mono = post(f"http://127.0.0.1:{d_port}/v1/completions", body)["choices"][0][
                "token_ids"
            ]
            assert via == mono and len(via) == 8
            receipts.append(answer["kv_transfer_params"]["kvxferd_receipt"])
        want = sum(-(-len(p) // BLOCK) for p in ps) * 2 * BLOCK_BYTES
        assert counter(rx.probe_port, "kvxferd_bytes") - before == want
        assert all(r["loaded"] for r in receipts) and sum(r["bytes"] for r in receipts) == want
    # A streamed response is relayed as it comes (its receipt is not in a stream).
    body = {"model": str(rig.model), "prompt": ps[2], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    status, text = stream(f"http://127.0.0.1:{f_port}/v1/completions", body)
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]

    # The decode-first proxy's log: one line per request (written once the response ended),
    # all but the first decode-first.
    def logged() -> list[dict[str, Any]]:
        return [
            json.loads(ln.split(" request ", 1)[1])
            for ln in (Path(rig.sock_dir) / "proxy-df.log").read_text().splitlines()
            if "kvxferd.integrations.vllm.proxy request {" in ln
        ]

    wait_until(lambda: len(logged()) == len(ps) + 1, 30, "a log line per request")
    lines = logged()
    assert [x["flow"] for x in lines] == ["prefill-first"] + ["decode-first"] * len(ps), lines
    assert all(x["receipt"]["loaded"] and x["receipt"]["bytes"] > 0 for x in lines[:-1]), lines
    assert lines[-1]["receipt"] is None and lines[-1]["status"] == 200, lines[-1]
    # vLLM's own Prometheus metrics count the same loads (the connector's KV connector stats).
    wait_until(
        lambda: (
            prom(f"http://127.0.0.1:{d_port}/metrics", "vllm:kvxferd_kv_loaded_total")
            == 2 * len(ps) + 1
        ),
        30,
        "vLLM's metrics count every load",
    )
    # ... and its periodic log line (every VLLM_LOG_STATS_INTERVAL, 10 s).
    wait_until(
        lambda: "KV Transfer metrics: loaded=" in children.tail("decode", 400),
        30,
        "vLLM's log line of the connector's counts",
    )


def prom(url: str, name: str) -> float:
    """A Prometheus family's value summed over its samples (0 when absent)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith(name + "{") or ln.startswith(name + " ")
    )
