"""Every configuration refusal is one line on stderr, exit 2, no traceback (issue 23, item 6).

Each case starts the real CLI (``python -m kvxferd sender|receiver``) with a configuration
that must be refused before anything starts, and checks what an operator sees: one line
that names the setting and says what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EXIT_CONFIG = 2


class Refusal(NamedTuple):
    name: str
    role: str
    args: tuple[str, ...]
    env: dict[str, str]
    toml: str | None
    names: str  # the setting the line must name


CASES = [
    Refusal(
        "plaintext-off-loopback",
        "sender",
        ("--listen", "tcp://0.0.0.0:5555"),
        {"KVXFERD_SECURITY__MODE": "off"},
        None,
        "security.mode",
    ),
    Refusal(
        "plaintext-off-loopback-toml",
        "sender",
        (),
        {},
        'listen = "tcp://0.0.0.0:5555"\n[security]\nmode = "off"\n',
        "security.mode",
    ),
    Refusal(
        "key-file-missing",
        "sender",
        (),
        {
            "KVXFERD_SECURITY__MODE": "curve",
            "KVXFERD_SECURITY__KEY_FILE": "/nonexistent/k.key_secret",
            "KVXFERD_SECURITY__ALLOWED_KEYS_DIR": "/nonexistent",
        },
        None,
        "security.key_file",
    ),
    Refusal("threads-zero", "sender", (), {"TRTLLM_KV_TRANSFER_NUM_THREADS": "0"}, None, "THREADS"),
    Refusal(
        "threads-not-a-number",
        "sender",
        (),
        {"TRTLLM_KV_TRANSFER_NUM_THREADS": "many"},
        None,
        "THREADS",
    ),
    Refusal("threads-flag-zero", "sender", ("--num-threads", "0"), {}, None, "num_threads"),
    Refusal(
        "threads-flag-not-a-number", "sender", ("--num-threads", "x"), {}, None, "--num-threads"
    ),
    Refusal("log-level-flag-unknown", "receiver", ("--log-level", "loud"), {}, None, "--log-level"),
    Refusal("listen-not-here", "sender", ("--listen", "tcp://10.1.2.3:0"), {}, None, "listen"),
    Refusal(
        "a-bad-number",
        "receiver",
        (),
        {"KVXFERD_LIMITS__MAX_FRAME_BYTES": "lots"},
        None,
        "limits.max_frame_bytes",
    ),
    Refusal(
        "ipc-listen-in-a-missing-directory",
        "sender",
        ("--listen", "ipc:///nonexistent-kvxferd-dir/tx.sock"),
        {"KVXFERD_SECURITY__MODE": "off"},
        None,
        "listen",
    ),
    Refusal("an-unknown-setting", "sender", (), {}, "[pool]\nsize_of_everything = 3\n", "pool"),
    Refusal("not-toml", "receiver", (), {}, "[pool\n", "config file"),
    Refusal(
        "two-errors",
        "receiver",
        (),
        {"KVXFERD_LIMITS__MAX_FRAME_BYTES": "lots", "KVXFERD_DEADLINES__SEND_TIMEOUT_MS": "x"},
        None,
        "limits.max_frame_bytes",
    ),
]


def _run(case: Refusal, tmp: Path) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "kvxferd", case.role, *case.args]
    if case.toml is not None:
        path = tmp / f"{case.name}.toml"
        path.write_text(case.toml)
        args += ["--config", str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    env.pop("TRTLLM_KV_TRANSFER_NUM_THREADS", None)
    env.update(case.env)
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, cwd=tmp)


@pytest.fixture(scope="module")
def outcomes(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("refusals")
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda c: _run(c, tmp), CASES))
    return {c.name: r for c, r in zip(CASES, runs, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_refusal_is_one_line_exit_2_no_traceback(
    case: Refusal, outcomes: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    run = outcomes[case.name]
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode == EXIT_CONFIG, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(lines) == 1, f"{len(lines)} lines:\n" + "\n".join(lines)
    assert lines[0].startswith("kvxferd: "), lines[0]
    assert case.names in lines[0], lines[0]
    assert len(lines[0]) < 600, f"a dump, not a refusal: {len(lines[0])} characters"
