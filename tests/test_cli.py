"""Command-line manners: --version, hidden private commands, a closed pipe, SIGHUP (cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvxferd import __version__
from kvxferd.cli import _parser

pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def _kvxferd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxferd", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version() -> None:
    """kvxferd --version prints the package version and the protocol versions spoken, newest
    first, and exits 0."""
    out = _kvxferd("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == (
        f"kvxferd {__version__} (wire protocol 4, 3; engine protocol 5, 4)"
    )


def test_private_bench_commands_hidden_from_help() -> None:
    """--help lists the public commands and none of the private _bench-* ones, which still parse."""
    out = _kvxferd("--help")
    assert out.returncode == 0
    assert "_bench" not in out.stdout
    for cmd in ("sender", "receiver", "print-config", "demo", "bench", "faults"):
        assert cmd in out.stdout
    assert _parser().parse_args(["_bench-tx", "spec"]).cmd == "_bench-tx"


def test_a_refusal_and_keygen_import_neither_torch_nor_nixl() -> None:
    """A configuration refusal (and `keygen`) answers without importing torch or NIXL: the
    tools' options are built only when the command line names the tool."""
    probe = (
        "import sys\n"
        "from kvxferd.cli import main\n"
        "code = main(['sender', '--num-threads', '0'])\n"
        "heavy = sorted(m for m in ('torch', 'nixl', 'kvxferd.bench', 'kvxferd.faults')"
        " if m in sys.modules)\n"
        "print(code, heavy)\n"
        "from kvxferd.cli import _parser\n"
        "print(_parser('bench').parse_args(['bench', '--reps', '2']).reps == 2,"
        " 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.splitlines()
    assert first == "2 []", (first, out.stderr[-500:])
    assert second == "True True", "naming the tool adds its options"


def test_print_config_into_closed_pipe_has_no_traceback() -> None:
    """print-config writing into a pipe whose reader is gone ends quietly, without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvxferd", "print-config", "--role", "sender"],
            env=_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.returncode == 0


def test_print_config_head_one_in_shell() -> None:
    """`kvxferd print-config | head -1` prints one line and no traceback."""
    cmd = f"{sys.executable} -m kvxferd print-config --role receiver --sources | head -1"
    out = subprocess.run(["sh", "-c", cmd], env=_env(), capture_output=True, text=True, timeout=60)
    assert len(out.stdout.splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_serve_ignores_sighup() -> None:
    """The daemon entry point sets SIGHUP to ignored before serving (no reload exists)."""
    code = (
        "import signal, kvxferd.service.daemon as d, kvxferd.cli as c\n"
        "d.serve = lambda role, s: 0 if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else 9\n"
        "raise SystemExit(c.main(['sender']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
