"""Advertised endpoints: what a daemon tells peers and engines is reachable, never a wildcard.

The unit tests check :func:`kvxferd.endpoints.advertised` and the preflight's
refusal; the integration test runs two real daemons bound to ``0.0.0.0`` that
advertise two other loopback addresses (127.0.0.2, 127.0.0.3: Linux routes all
of 127/8 to ``lo``), so only the advertised address can explain what the peers
and the engine see.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.endpoints import advertise_host, advertised
from kvxferd.errors import ConfigError
from kvxferd.service import preflight
from tests.conftest import SuiteKeys
from tests.test_daemon import DaemonProcess, Engines, http_get

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
LAYERS, BLOCKS, BLOCK_BYTES = 2, 64, 16 << 10


class TestAdvertised:
    """endpoints.advertised: the bound endpoint, as peers must be told it."""

    def test_a_wildcard_without_an_advertise_host_is_refused_naming_the_settings(self) -> None:
        """A wildcard bound address with nothing to advertise is a ConfigError naming the setting to set."""
        for bound in ("tcp://0.0.0.0:5555", "tcp://*:0", "tcp://[::]:5555"):
            with pytest.raises(ConfigError, match=r"listen = .*service\.advertise_host"):
                advertised(bound, None, "listen")

    def test_the_advertise_host_replaces_the_bound_host_and_keeps_the_port(self) -> None:
        """An advertise host replaces the bound host (a wildcard or not) and keeps the bound port."""
        assert advertised("tcp://0.0.0.0:41234", "10.1.2.3", "x") == "tcp://10.1.2.3:41234"
        assert advertised("tcp://127.0.0.1:5555", "node-7.svc", "x") == "tcp://node-7.svc:5555"
        assert advertised("tcp://0.0.0.0:5555", "fd00::7", "x") == "tcp://[fd00::7]:5555"

    def test_a_specific_bound_address_and_an_ipc_path_are_advertised_as_is(self) -> None:
        """Without an advertise host a specific address is advertised unchanged, and ipc paths always are."""
        assert advertised("tcp://127.0.0.1:5555", None, "x") == "tcp://127.0.0.1:5555"
        assert advertised("ipc:///run/k.sock", "10.0.0.1", "x") == "ipc:///run/k.sock"

    def test_an_interface_resolves_to_its_ipv4_address(self) -> None:
        """advertise_interface = lo gives 127.0.0.1; an unknown interface is a ConfigError naming the setting."""
        assert advertise_host(None, "lo") == "127.0.0.1"
        assert advertise_host("10.9.9.9", None) == "10.9.9.9"
        with pytest.raises(ConfigError, match="service.advertise_interface = 'nosuchif0'"):
            advertise_host(None, "nosuchif0")


class TestSettings:
    """The advertise settings are validated at load and checked by the preflight."""

    def test_a_wildcard_advertise_host_is_invalid(self) -> None:
        """service.advertise_host = 0.0.0.0 (or *) fails validation."""
        for host in ("0.0.0.0", "*", "::"):
            with pytest.raises(ConfigError, match="advertise_host"):
                load_sender_settings(service={"advertise_host": host})

    def test_host_and_interface_together_are_invalid(self) -> None:
        """Setting both advertise_host and advertise_interface fails validation."""
        with pytest.raises(ConfigError, match="not both"):
            load_receiver_settings(
                service={"advertise_host": "10.0.0.1", "advertise_interface": "lo"}
            )

    def test_preflight_refuses_a_wildcard_listen_without_an_advertise_host(
        self, suite_keys: SuiteKeys
    ) -> None:
        """The sender's preflight refuses listen = tcp://0.0.0.0:0 alone and accepts it with an advertise host."""
        svc = {"probe_port": 0, "engine_socket": "ipc://@kvxferd-adv-test"}
        sec = suite_keys.security
        bare = load_sender_settings(listen="tcp://0.0.0.0:0", service=svc, security=sec)
        with pytest.raises(ConfigError, match="listen = 'tcp://0.0.0.0:0'.*advertise_host"):
            preflight.check(bare)
        ok = load_sender_settings(
            listen="tcp://0.0.0.0:0",
            service={**svc, "advertise_host": "127.0.0.2"},
            security=sec,
        )
        preflight.check(ok)

    def test_preflight_refuses_a_wildcard_result_endpoint_via_the_env(
        self, monkeypatch: pytest.MonkeyPatch, suite_keys: SuiteKeys
    ) -> None:
        """A receiver with result_endpoint tcp://*:0 passes preflight only once KVXFERD_SERVICE__ADVERTISE_HOST is set."""
        for name, value in suite_keys.env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("KVXFERD_SERVICE__PROBE_PORT", "0")
        monkeypatch.setenv("KVXFERD_SERVICE__ENGINE_SOCKET", "ipc://@kvxferd-adv-test-rx")
        with pytest.raises(ConfigError, match="result_endpoint"):
            preflight.check(load_receiver_settings(result_endpoint="tcp://*:0"))
        monkeypatch.setenv("KVXFERD_SERVICE__ADVERTISE_HOST", "127.0.0.3")
        preflight.check(load_receiver_settings(result_endpoint="tcp://*:0"))


def test_the_daemon_exits_2_in_one_line_on_a_wildcard_listen(tmp_path: Path) -> None:
    """`kvxferd sender --listen tcp://0.0.0.0:0` alone exits 2 with one line naming service.advertise_host."""
    env = {
        "PYTHONPATH": str(ROOT),
        "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{tmp_path}/e.sock",
        "KVXFERD_SERVICE__PROBE_PORT": "0",
    }
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd", "sender", "--listen", "tcp://0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "service.advertise_host" in lines[0], out.stderr


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_daemons_bound_to_every_address_advertise_their_advertise_hosts(
    tmp_path: Path, suite_keys: SuiteKeys
) -> None:
    """A sender and a receiver bound to 0.0.0.0 tell the engine, the ready line and each other only their advertise hosts, and a fetch through them is byte-exact."""
    small = {
        "KVXFERD_POOL__NUM_LAYERS": str(LAYERS),
        "KVXFERD_POOL__NUM_BLOCKS": str(BLOCKS),
        "KVXFERD_POOL__BLOCK_ELEMS": str(BLOCK_BYTES),
        "KVXFERD_POOL__DTYPE": "uint8",
        "KVXFERD_NUM_THREADS": "1",
        "KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS": "10000",
        **suite_keys.env,  # bound to every address: plaintext is refused there
    }
    sock_dir = str(tmp_path)
    tx = DaemonProcess(
        "sender",
        "tx",
        sock_dir,
        {**small, "KVXFERD_SERVICE__ADVERTISE_HOST": "127.0.0.2"},
        ["--listen", "tcp://0.0.0.0:0"],
    )
    rx = DaemonProcess(
        "receiver",
        "rx",
        sock_dir,
        {**small, "KVXFERD_SERVICE__ADVERTISE_HOST": "127.0.0.3"},
        ["--result-endpoint", "tcp://0.0.0.0:0"],
    )
    engines = Engines()
    try:
        tx_ready, rx_ready = tx.wait_ready(), rx.wait_ready()
        assert re.fullmatch(r"tcp://127\.0\.0\.2:\d+", tx_ready["endpoint"]), tx_ready
        assert re.fullmatch(r"tcp://127\.0\.0\.3:\d+", rx_ready["endpoint"]), rx_ready
        assert not tx_ready["endpoint"].endswith(":0")
        ct, pt = engines.client(tx)
        cr, pr = engines.client(rx)
        assert ct.describe().endpoint == tx_ready["endpoint"]  # PoolInfo: what engines pass on
        assert cr.describe().endpoint == rx_ready["endpoint"]
        want = torch.randint(0, 255, (LAYERS, 4, BLOCK_BYTES), dtype=torch.uint8)
        pt[:, [1, 2, 3, 4], :] = want
        published = ct.publish("adv-1", [1, 2, 3, 4])
        fetch = cr.fetch("adv-1", ct.describe().endpoint, [10, 11, 12, 13])
        out = cr.wait(fetch, timeout=20.0)
        assert out is not None and out.state == "done", out
        assert torch.equal(pr[:, [10, 11, 12, 13], :], want)
        # The sender connects its results back to what the receiver's Register advertised.
        status, body = http_get(tx.probe_port, "/debug/state")
        assert status == 200, body
        peers = json.loads(body)["peers"]
        assert [p["endpoint"] for p in peers] == [rx_ready["endpoint"]], peers
        ct.close(published, timeout=5.0)
        cr.close(fetch, timeout=5.0)
    finally:
        engines.close()
        tx.kill(), rx.kill()
