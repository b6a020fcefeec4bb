"""Start-up refusals: a vLLM instance whose daemon's pool does not fit, or whose daemon is absent, does not start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_vllm.conftest import Rig
from tests_vllm.rig import DAEMON_DEADLINES, EngineError, spawn_daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WRONG_POOL = """
[pool]
num_layers = 3
num_blocks = 4
block_elems = 2048
dtype = "float16"
"""


def test_pool_that_does_not_fit_refuses_start(rig: Rig) -> None:
    """A decode instance on a receiver whose [pool] is wrong fails at start, naming the values to set."""
    cfg = rig.sock_dir + "/wrong.toml"
    with open(cfg, "w") as f:
        f.write(WRONG_POOL + DAEMON_DEADLINES)
    rx = spawn_daemon("receiver", "rx", rig.sock_dir, Path(cfg))
    rig.daemons.append(rx)
    rx.wait_ready()
    e = rig.engine("decode", "consumer", rx)
    with pytest.raises(EngineError) as err:
        e.wait_ready()
    msg = str(err.value)
    for want in ("num_layers = 3, needs 2", "needs 4096", 'dtype = "float32"', "num_blocks = 16"):
        assert want in msg, msg


def test_absent_daemon_refuses_start(rig: Rig) -> None:
    """A prefill instance whose engine socket has no daemon fails at start, naming the setting."""
    e = rig.engine(
        "prefill", "producer", None, "--engine-socket", f"ipc://{rig.sock_dir}/none.sock"
    )
    with pytest.raises(EngineError) as err:
        e.wait_ready()
    assert "engine_socket" in str(err.value) and "no kvxferd sender daemon answers" in str(
        err.value
    )
