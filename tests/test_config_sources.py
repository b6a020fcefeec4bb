"""One precedence (flags > KVXFERD_* > TRTLLM_KV_TRANSFER_NUM_THREADS > file > defaults), shown by --sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.config import load_sender_settings
from kvxferd.errors import ConfigError

pytestmark = pytest.mark.integration

THREADS = "TRTLLM_KV_TRANSFER_NUM_THREADS"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVXFERD_") or name == THREADS:
            monkeypatch.delenv(name)


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def test_trtllm_variable_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTLLM_KV_TRANSFER_NUM_THREADS wins over the file, which wins over the default."""
    assert load_sender_settings(_file(tmp_path, "num_threads = 2\n")).num_threads == 2
    monkeypatch.setenv(THREADS, "6")
    assert load_sender_settings(_file(tmp_path, "num_threads = 2\n")).num_threads == 6


def test_kvxferd_variable_beats_trtllm_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVXFERD_NUM_THREADS wins over TRTLLM_KV_TRANSFER_NUM_THREADS, a flag over both."""
    monkeypatch.setenv(THREADS, "6")
    monkeypatch.setenv("KVXFERD_NUM_THREADS", "7")
    assert load_sender_settings().num_threads == 7
    assert load_sender_settings(num_threads=9).num_threads == 9


def test_bad_trtllm_value_ignored_below_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-range TRTLLM_KV_TRANSFER_NUM_THREADS under a flag or KVXFERD_NUM_THREADS is not used."""
    monkeypatch.setenv(THREADS, "0")
    assert load_sender_settings(num_threads=3).num_threads == 3
    monkeypatch.setenv("KVXFERD_NUM_THREADS", "5")
    assert load_sender_settings().num_threads == 5


@pytest.mark.parametrize(
    ("env", "source"),
    [
        ({THREADS: "300"}, f"env {THREADS}"),
        ({"KVXFERD_NUM_THREADS": "0"}, "env KVXFERD_NUM_THREADS"),
        ({"KVXFERD_DEADLINES__CLOCK_SKEW_MS": "999999"}, "env KVXFERD_DEADLINES__CLOCK_SKEW_MS"),
    ],
)
def test_out_of_range_names_source_and_limit(
    env: dict[str, str], source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-range value's error names the variable it came from and the limit."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_sender_settings()
    assert source in str(e.value)
    assert any(w in str(e.value) for w in ("less than or equal", "greater than or equal"))


def test_out_of_range_in_file_names_file(tmp_path: Path) -> None:
    """An out-of-range value in the TOML file names the file and the limit."""
    path = _file(tmp_path, "num_threads = 999\n")
    with pytest.raises(ConfigError) as e:
        load_sender_settings(path)
    assert f"file {path}" in str(e.value) and "256" in str(e.value)


def test_print_config_sources_subprocess(tmp_path: Path) -> None:
    """print-config --sources says for each setting whether it came from default, file or env."""
    path = _file(
        tmp_path, "num_threads = 2\nname = 'ctx-1'\n[deadlines]\ndrain_timeout_ms = 1234\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        THREADS: "6",
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": "2000",
    }
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd", "print-config", "--role", "sender"]
        + ["--config", str(path), "--sources"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" = ", 1) for line in out.stdout.splitlines())
    assert lines["num_threads"] == f"6  # env {THREADS}"
    assert lines["name"] == f'"ctx-1"  # file {path}'
    assert lines["deadlines.drain_timeout_ms"] == "2000  # env KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS"
    assert lines["deadlines.send_timeout_ms"] == "100  # default"

    flagged = subprocess.run(
        [sys.executable, "-m", "kvxferd", "print-config", "--role", "sender"]
        + ["--config", str(path), "--sources", "--num-threads", "9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "num_threads = 9  # flag" in flagged.stdout.splitlines(), flagged.stderr


def test_sender_with_bad_trtllm_variable_exits_2_naming_it() -> None:
    """A sender whose only thread setting is TRTLLM_KV_TRANSFER_NUM_THREADS=300 exits 2 naming it and 256."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), THREADS: "300"}
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd", "sender"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert THREADS in out.stderr and "256" in out.stderr and "Traceback" not in out.stderr
