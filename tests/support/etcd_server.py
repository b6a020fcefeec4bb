"""A real etcd for tests: loopback, free ports, a temporary data dir, killed at the end.

Tests that need it skip with :data:`SKIP_REASON` where the ``etcd`` binary is
missing (Debian: ``apt-get install -y etcd-server``; ``make setup`` does it as root).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd")
SKIP_REASON = (
    "etcd not installed: run `apt-get install -y etcd-server` (Debian/Ubuntu; `make setup` "
    "does it when run as root) to run the etcd discovery tests"
)
START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on 127.0.0.1; ``kill()`` and ``start()`` again keep its ports and data."""

    def __init__(self, data_dir: Path) -> None:
        assert ETCD is not None, SKIP_REASON
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"etcd-{self.client_port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            str(ETCD),
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--log-level=error",
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: see {self.log_path}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"etcd did not answer within {START_TIMEOUT_S}s")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        req = urllib.request.Request(f"{self.url}/v3/kv/range", data=b'{"key":"AA=="}')
        try:
            with urllib.request.urlopen(req, timeout=0.5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
