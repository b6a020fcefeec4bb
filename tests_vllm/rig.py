"""The vLLM tests' shared parts: a tiny random Llama, daemons configured by pool-config, engine children.

Everything is a real process: ``python -m kvxferd sender|receiver`` daemons
(``tests.test_daemon.DaemonProcess``) and ``python -m tests_vllm.engine`` instances
(:class:`EngineProcess`), talking over real ipc/tcp sockets and NIXL. Waits are
bounded: every reply is awaited with a deadline, and every child is killed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tests.test_daemon import DaemonProcess, metrics

ROOT = Path(__file__).resolve().parent.parent
MODEL_LAYERS = 2
VOCAB = 512
STARTUP_S = 180.0  # an engine imports vLLM and torch and builds its model on a busy 2-core host
DAEMON_DEADLINES = """
[deadlines]
publish_ttl_ms = 30000
pending_fetch_ttl_ms = 20000
kv_transfer_timeout_ms = 20000
drain_timeout_ms = 1000
shutdown_timeout_ms = 3000
"""


@dataclass(frozen=True)
class Shape:
    """A random Llama's shape (the tests build each once, with random weights)."""

    layers: int = MODEL_LAYERS
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    max_len: int = 512

    @property
    def block_bytes(self) -> int:
        """One pool block of one layer: K and V of every KV head, 32 tokens, float32."""
        return 2 * self.kv_heads * 32 * self.head_dim * 4


TINY = Shape()
# Deeper and wider: 8 layers, 4 KV heads of 64; a 3000-token prompt's forward takes about
# 2.5 s on this machine: long enough to kill its engine (or its sender) while it streams.
DEEP = Shape(
    layers=8, hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=64, max_len=4096
)


def build_model(path: Path, shape: Shape = TINY) -> Path:
    """A random Llama of ``shape`` (default 2 layers, grouped-query heads, head_dim 32,
    512-token vocab), saved locally."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_len,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,  # wide weights: greedy tokens vary from step to step
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def pool_config(model: Path, num_blocks: int, *extra: str) -> str:
    """The ``[pool]`` section printed by ``python -m kvxferd.integrations.vllm pool-config``."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxferd.integrations.vllm",
            "pool-config",
            "--model",
            str(model),
            "--block-size",
            "32",
            "--num-blocks",
            str(num_blocks),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def spawn_daemon(
    role: str,
    name: str,
    sock_dir: str,
    config: Path,
    threads: int = 1,
    listen: str = "",
    extra_env: dict[str, str] | None = None,
) -> DaemonProcess:
    args = ["--config", str(config)]
    if role == "sender":
        args += ["--listen", listen or "tcp://127.0.0.1:0"]
    env = {"KVXFERD_NUM_THREADS": str(threads)} if role == "sender" else {}
    env["KVXFERD_SECURITY__MODE"] = "off"  # loopback and ipc only: plaintext is accepted
    env.update(extra_env or {})
    return DaemonProcess(role, name, sock_dir, env, args)


def counter(port: int, name: str) -> float:
    """A daemon's counter or gauge from /metrics, summed over its labels."""
    fam = metrics(port).get(name)
    if fam is None:
        return 0.0
    return float(sum(s.value for s in fam.samples if not s.name.endswith("_created")))


def sessions(port: int) -> float:
    """Open sessions (publishes or fetches) the daemon still holds."""
    return counter(port, "kvxferd_sessions")


class EngineError(AssertionError):
    pass


class EngineProcess:
    """``python -m tests_vllm.engine``: one command per line on stdin, one JSON reply per line on stdout."""

    def __init__(self, name: str, log_dir: Path, args: list[str]) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests_vllm.engine", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
        )
        self._cond = threading.Condition()
        self._lines: list[dict[str, Any]] = []
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if not line.startswith("{"):
                    continue
                with self._cond:
                    self._lines.append(json.loads(line))
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def _next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise EngineError(f"{self.name}: no reply within {timeout}s\n{self.describe()}")
                self._cond.wait(left)
            return self._lines.pop(0)

    def wait_ready(self, timeout: float = STARTUP_S) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._next(timeout)
        if self.ready.get("event") != "ready":
            raise EngineError(f"{self.name} did not start: {self.ready}\n{self.describe()}")
        return self.ready

    def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command; its reply (EngineError if the engine reported an error or died)."""
        self.send(cmd)
        return self.reply(timeout)

    def send(self, cmd: dict[str, Any]) -> None:
        """Send one command without waiting: two engines run at once, each answered by ``reply``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next reply (EngineError if the engine reported an error or died)."""
        reply = self._next(timeout)
        if reply.get("event") == "error":
            raise EngineError(f"{self.name}: {reply['error']}\n{self.describe()}")
        return reply

    def start_run(self, requests: list[dict[str, Any]], timeout: float = 120.0, **kw: Any) -> float:
        """Send a run command; the bound to pass to ``reply`` for its result."""
        self.send({"op": "run", "requests": requests, "timeout_s": timeout, **kw})
        return timeout + 30

    def run(
        self, requests: list[dict[str, Any]], timeout: float = 120.0, **kw: Any
    ) -> dict[str, Any]:
        return self.call(
            {"op": "run", "requests": requests, "timeout_s": timeout, **kw}, timeout + 30
        )

    def drain(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.call({"op": "drain", "timeout_s": timeout}, timeout + 30)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=5)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._stderr.close()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self, lines: int = 30) -> str:
        tail = "\n  ".join(self.stderr().splitlines()[-lines:])
        return f"[{self.name} pid {self.proc.pid} exit {self.proc.poll()}]\nstderr tail:\n  {tail}"
