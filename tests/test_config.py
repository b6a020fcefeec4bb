"""Settings: defaults < TOML < environment < CLI flags, and readable errors (config.py, cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import ConfigError
from tests.conftest import SuiteKeys

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRTLLM_KV_TRANSFER_NUM_THREADS", "KVXFERD_NUM_THREADS", "KVXFERD_LISTEN"):
        monkeypatch.delenv(name, raising=False)


def test_precedence_is_defaults_toml_env_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TOML value beats the default, the environment beats TOML, a flag beats both."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(
        'listen = "tcp://127.0.0.1:7001"\nnum_threads = 2\n[deadlines]\ndrain_timeout_ms = 1234\n'
    )
    s = load_sender_settings(cfg)
    assert (s.listen, s.num_threads, s.deadlines.drain_timeout_ms) == (
        "tcp://127.0.0.1:7001",
        2,
        1234,
    )
    monkeypatch.setenv("KVXFERD_LISTEN", "tcp://127.0.0.1:7002")
    monkeypatch.setenv("KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS", "999")
    s = load_sender_settings(cfg)
    assert (s.listen, s.deadlines.drain_timeout_ms) == ("tcp://127.0.0.1:7002", 999)
    assert load_sender_settings(cfg, listen="tcp://127.0.0.1:7003").listen == "tcp://127.0.0.1:7003"


def test_trtllm_thread_variable_sets_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTLLM_KV_TRANSFER_NUM_THREADS is read as num_threads."""
    monkeypatch.setenv("TRTLLM_KV_TRANSFER_NUM_THREADS", "6")
    assert load_sender_settings().num_threads == 6


@pytest.mark.parametrize(
    "toml, fragment",
    [
        ("[deadlines]\ndrain_timeout_ms = 20000\n", "drain_timeout_ms must be below"),
        ("num_threads = 0\n", "num_threads"),
        ("[pool]\ndtype = 'float64'\n", "pool.dtype"),
        ("bogus = 1\n", "bogus"),
        ("[pool\n", "not valid TOML"),
    ],
)
def test_invalid_settings_name_the_setting(tmp_path: Path, toml: str, fragment: str) -> None:
    """An invalid file stops loading with a ConfigError that names what is wrong."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_sender_settings(cfg)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A config path that does not exist is reported, not ignored."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_receiver_settings(tmp_path / "nope.toml")


def test_print_config_prints_effective_json() -> None:
    """`kvxferd print-config` prints the effective settings as JSON, environment included."""
    env = {"TRTLLM_KV_TRANSFER_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd", "print-config", "--role", "sender"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    cfg = json.loads(out.stdout)
    assert cfg["num_threads"] == 3
    assert cfg["deadlines"]["shutdown_timeout_ms"] == 15000


def test_bad_thread_variable_stops_the_cli_with_its_name() -> None:
    """A sender started with TRTLLM_KV_TRANSFER_NUM_THREADS=0 exits 2 naming the variable."""
    env = {"TRTLLM_KV_TRANSFER_NUM_THREADS": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd", "sender", "--listen", "tcp://127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "TRTLLM_KV_TRANSFER_NUM_THREADS" in out.stderr


def test_receiver_refuses_to_advertise_a_wildcard_address(suite_keys: SuiteKeys) -> None:
    """A receiver whose result endpoint is 0.0.0.0 stops with a ConfigError (senders would dial themselves)."""
    from kvxferd.transfer.receiver import Receiver

    with pytest.raises(ConfigError, match="wildcard"):
        Receiver(
            load_receiver_settings(result_endpoint="tcp://0.0.0.0:0", security=suite_keys.security)
        )
