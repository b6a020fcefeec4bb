"""The suite runs its daemons on loopback and ipc: security off there, unless a test says.

``security.mode`` defaults to "curve" (fail closed). Tests that build senders,
receivers or daemons on 127.0.0.1 and ipc sockets (nearly all of them) would
each need a key pair; instead the whole session runs with
``KVXFERD_SECURITY__MODE=off``, which the settings accept only because every
endpoint is loopback or ipc. Child processes inherit it. Tests of security
itself (tests/test_auth*.py) pass ``security=`` explicitly, which wins over the
environment; tests of the defaults remove the variable (``monkeypatch.delenv``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ["KVXFERD_SECURITY__MODE"] = "off"


@dataclass(frozen=True)
class SuiteKeys:
    """One key pair for every daemon of a test that needs CURVE, allowed by itself."""

    key_file: str
    allowed_keys_dir: str
    public: str

    @property
    def security(self) -> dict[str, object]:
        """``security=`` for settings: CURVE on; every sender must present this key."""
        return {
            "mode": "curve",
            "key_file": self.key_file,
            "allowed_keys_dir": self.allowed_keys_dir,
            "sender_keys": {"*": self.public},
        }

    @property
    def env(self) -> dict[str, str]:
        """The same as ``KVXFERD_SECURITY__*`` variables, for daemons in child processes."""
        return {
            "KVXFERD_SECURITY__MODE": "curve",
            "KVXFERD_SECURITY__KEY_FILE": self.key_file,
            "KVXFERD_SECURITY__ALLOWED_KEYS_DIR": self.allowed_keys_dir,
            "KVXFERD_SECURITY__SENDER_KEYS": json.dumps({"*": self.public}),
        }


@pytest.fixture(scope="session")
def suite_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteKeys]:
    """A key pair made once per session with `kvxferd keygen`'s code, and its allow-list."""
    from kvxferd.auth import keygen, load_public_key

    root: Path = tmp_path_factory.mktemp("keys")
    public, secret = keygen(root / "own", "suite")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "suite.key").write_bytes(public.read_bytes())
    yield SuiteKeys(str(secret), str(allowed), load_public_key(public))
