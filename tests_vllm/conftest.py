"""Fixtures of the vLLM tests: the tiny model, pool-config'd daemons, prefill and decode engines.

The healthy 1P1D rig (sender, receiver, a producer engine, a consumer engine) is
started once per module and shared; tests that break something build their own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_daemon import DaemonProcess
from tests_vllm.engine import MAX_MODEL_LEN
from tests_vllm.rig import (
    DAEMON_DEADLINES,
    EngineProcess,
    build_model,
    pool_config,
    spawn_daemon,
)

POOL_BLOCKS = 512  # daemon pool blocks: 16 prompts of up to 16 blocks each, twice over


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model"))


@dataclass
class Rig:
    """Processes of one test setup; ``close`` kills them all."""

    sock_dir: str
    model: Path
    daemons: list[DaemonProcess] = field(default_factory=list)
    engines: list[EngineProcess] = field(default_factory=list)

    def daemon(
        self,
        role: str,
        name: str,
        pool_blocks: int = POOL_BLOCKS,
        threads: int = 1,
        listen: str = "",
        zero_copy: bool = False,
        env: dict[str, str] | None = None,
    ) -> DaemonProcess:
        """A daemon whose [pool] pool-config printed; with ``zero_copy``, ``pool_blocks`` is
        vLLM's; ``env`` adds to its environment (e.g. tests.test_daemon.TCP_DATA_PLANE)."""
        cfg = Path(self.sock_dir) / f"{name}.toml"
        extra = ("--zero-copy", "--max-model-len", str(MAX_MODEL_LEN)) if zero_copy else ()
        cfg.write_text(pool_config(self.model, pool_blocks, *extra) + DAEMON_DEADLINES)
        d = spawn_daemon(role, name, self.sock_dir, cfg, threads, listen, env)
        self.daemons.append(d)
        return d

    def engine(
        self, name: str, role: str, daemon: DaemonProcess | None, *extra: str
    ) -> EngineProcess:
        args = ["--model", str(self.model), "--role", role]
        if daemon is not None:
            args += ["--engine-socket", daemon.engine_socket]
        e = EngineProcess(name, Path(self.sock_dir), [*args, *extra])
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.kill()
        for d in self.daemons:
            d.kill()


def _rig(model: Path) -> Iterator[Rig]:
    # A short private path: an ipc:// path must fit in sockaddr_un (107 bytes).
    d = tempfile.mkdtemp(prefix="kxv")
    rig = Rig(d, model)
    try:
        yield rig
    finally:
        rig.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def rig(model_dir: Path) -> Iterator[Rig]:
    """A fresh, empty rig for one test."""
    yield from _rig(model_dir)


@dataclass
class PD:
    rig: Rig
    sender: DaemonProcess
    receiver: DaemonProcess
    prefill: EngineProcess
    decode: EngineProcess


@pytest.fixture(scope="module")
def pd(model_dir: Path) -> Iterator[PD]:
    """One prefill instance and one decode instance with their daemons, started once per module."""
    for rig in _rig(model_dir):
        sender = rig.daemon("sender", "tx")
        receiver = rig.daemon("receiver", "rx")
        sender.wait_ready()
        receiver.wait_ready()
        prefill = rig.engine("prefill", "producer", sender)
        decode = rig.engine("decode", "consumer", receiver)
        prefill.wait_ready()
        decode.wait_ready()
        yield PD(rig, sender, receiver, prefill, decode)
