"""Offline checks of deploy/: the systemd units and the Kubernetes manifests.

Always run: a structural check of every unit (configparser) and of every
manifest (PyYAML), tied to kvxferd.config: the pods' settings are loaded from
the ConfigMap's TOML and the pods' env with kvxferd's own loader, and the /dev/shm
size, probe ports, grace period and NetworkPolicy ports are checked against them.
Each manifest check also runs on a copy broken the way it guards against and
must fail there. When the tools exist: ``systemd-analyze verify`` on each unit,
``kubernetes-validate`` (strict schemas) and ``kubectl kustomize`` on the
manifests; otherwise those tests skip and say how to run them.
"""

from __future__ import annotations

import configparser
import contextlib
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvxferd import __version__
from kvxferd.config import (
    THREADS_ENV,
    Deadlines,
    PoolSettings,
    ReceiverSettings,
    SenderSettings,
    ServiceSettings,
    load_receiver_settings,
    load_sender_settings,
)
from kvxferd.endpoints import advertise_host, advertised
from kvxferd.launch import LaunchError
from tests.support.child import ChildProcess
from tests.support.conditions import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
K8S = ROOT / "deploy" / "k8s"
UNITS = sorted(SYSTEMD.glob("*.service"))
ROLES = ("sender", "receiver")
INSTALLED_BINARY = "/usr/local/bin/kvxferd"
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
# Oldest Kubernetes with the preStop `sleep` action on by default (beta in 1.30).
MIN_K8S = "1.30.0"
# The daemon exits within shutdown_timeout_ms + this (kvxferd/service/daemon.py).
EXIT_SLACK_S = 1.0

# ---------------------------------------------------------------- systemd


def _role_of(unit: Path) -> str:
    m = re.fullmatch(r"kvxferd-(sender|receiver)(@?)\.service", unit.name)
    assert m, f"{unit.name}: expected kvxferd-<sender|receiver>[@].service"
    return m.group(1)


def _parse_unit(unit: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    cp.read_string(unit.read_text(), source=str(unit))
    return cp


def _all_values(unit: Path, section: str, key: str) -> list[str]:
    """Every value of a key that may repeat (configparser keeps only the last one)."""
    values, current = [], None
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and line.startswith(f"{key}="):
            values.append(line[len(key) + 1 :])
    return values


_SPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def _seconds(span: str) -> float:
    """A systemd time span ('20', '20s', '1min 30s', '500ms') in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), span
    return sum(float(n) * _SPAN_UNITS[u or "s"] for n, u in parts)


def test_unit_files_present() -> None:
    """deploy/systemd holds a plain and a per-rank template unit for each role."""
    names = {u.name for u in UNITS}
    for role in ROLES:
        assert f"kvxferd-{role}.service" in names
        assert f"kvxferd-{role}@.service" in names


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_structure(unit: Path) -> None:
    """Each unit is a notify service with the stop, restart, user and sandbox settings the daemon needs."""
    role, template = _role_of(unit), "@." in unit.name
    svc = _parse_unit(unit)["Service"]
    deadlines = Deadlines()

    assert svc["Type"] == "notify"
    assert svc["NotifyAccess"] == "main"
    assert _seconds(svc["WatchdogSec"]) > 0
    assert svc["KillMode"] == "mixed"
    assert svc["KillSignal"] == "SIGTERM"
    stop_bound = deadlines.shutdown_timeout_ms / 1000 + EXIT_SLACK_S
    assert _seconds(svc["TimeoutStopSec"]) > stop_bound, "SIGKILL before the daemon's own bound"
    assert svc["Restart"] == "on-failure"
    assert "2" in svc.get("RestartPreventExitStatus", "").split(), "a config error loops"
    assert svc["User"] == "kvxferd"
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["RuntimeDirectoryMode"] == "0700"
    environment = " ".join(_all_values(unit, "Service", "Environment"))
    assert THREADS_ENV not in environment, "it would override num_threads in the TOML file"

    exec_start = svc["ExecStart"].split()
    assert exec_start[:2] == [INSTALLED_BINARY, role]
    assert exec_start[2:] == ["--config", f"/etc/kvxferd/{role}.toml"]

    # The engine socket lives in the unit's own runtime directory.
    runtime_dir = "/run/" + svc["RuntimeDirectory"]
    if template:
        assert "%i" in svc["RuntimeDirectory"], "ranks would remove each other's directory"
        assert svc["EnvironmentFile"] == f"/etc/kvxferd/{role}-%i.env"
        socket = f"KVXFERD_SERVICE__ENGINE_SOCKET=ipc://{runtime_dir}/engine.sock"
        assert socket in environment.split()
    else:
        assert svc["RuntimeDirectory"] == "kvxferd"
        default_socket = ServiceSettings().engine_socket
        assert default_socket == f"ipc://{runtime_dir}/engine.sock"

    # Shared memory (/dev/shm), GPUs and RDMA devices stay usable.
    for key in ("PrivateDevices", "RemoveIPC", "DynamicUser", "MemoryDenyWriteExecute"):
        assert svc.get(key, "no") in ("no", "false", "0"), f"{key} breaks shm or devices"
    for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem", "DevicePolicy"):
        assert key not in svc, f"{key} may hide /dev/shm or the devices"
    for key in ("SystemCallFilter", "RestrictAddressFamilies"):
        assert not svc.get(key, "").startswith("~"), f"review {key} against shm/RDMA"


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not found (Debian: apt-get install systemd)")
    return exe


def _verify(exe: str, unit: Path) -> subprocess.CompletedProcess[str]:
    cmd = [exe, "verify", "--man=no", "--generators=no"]
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10).stdout
    if "--recursive-errors" in helptext:  # systemd >= 250: judge this unit, not the host's
        cmd.append("--recursive-errors=no")
    return subprocess.run(
        [*cmd, str(unit)], capture_output=True, text=True, timeout=30, cwd=unit.parent
    )


def _verifiable_copy(unit: Path, tmp_path: Path) -> Path:
    """The unit with ExecStart on a stub executable, a template as instance 0.

    verify checks that the ExecStart binary exists, and that is
    /usr/local/bin/kvxferd only on an installed host; a template cannot be
    verified without an instance name.
    """
    stub = tmp_path / "kvxferd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = unit.read_text()
    assert f"ExecStart={INSTALLED_BINARY} " in text
    copy = tmp_path / unit.name.replace("@.", "@0.")
    copy.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={stub} "))
    return copy


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    """systemd-analyze verify accepts the unit without an error or a warning."""
    exe = _systemd_analyze()
    copy = _verifiable_copy(unit, tmp_path)
    res = _verify(exe, copy)
    ours = [line for line in (res.stdout + res.stderr).splitlines() if copy.name in line]
    assert res.returncode == 0 and not ours, res.stdout + res.stderr


def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path) -> None:
    """The verify check is not vacuous: a misspelt key and a bad time span fail it."""
    exe = _systemd_analyze()
    copy = _verifiable_copy(SYSTEMD / "kvxferd-sender.service", tmp_path)
    text = copy.read_text().replace("TimeoutStopSec=", "TimeoutStopSecs=")
    copy.write_text(text.replace("RestartSec=2", "RestartSec=twoseconds"))
    res = _verify(exe, copy)
    out = res.stdout + res.stderr
    assert "TimeoutStopSecs" in out and "twoseconds" in out, out


# ------------------------------------------------------------- Kubernetes
#
# Each check_* function below takes the parsed manifests and raises AssertionError
# naming what is wrong; a test runs it on deploy/k8s, and test_check_catches runs it
# on a copy broken one way, so no check can pass vacuously.

Docs = list[dict[str, Any]]
PEER = {"sender": "receiver", "receiver": "sender"}
SOCKET_DIR = "/run/kvxferd"
SHM_DIR = "/dev/shm"
# Room in /dev/shm beyond the pool: UCX's own segments and the engine's.
SHM_HEADROOM_BYTES = 64 << 20
# The daemon's own memory besides the pool (measured idle: about 280 MiB RSS).
DAEMON_RSS_BYTES = 300 << 20
ENGINE_STOP_ANNOTATION = "kvxferd.io/engine-stop-seconds"
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"
# Values of the downward-API fields the pods read, for loading their settings here.
POD_IP = "10.1.2.3"


def _yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")


def _kustomization() -> dict[str, Any]:
    return _yaml().safe_load((K8S / "kustomization.yaml").read_text())


def _docs() -> Docs:
    docs = []
    for name in _kustomization()["resources"]:
        docs += [d for d in _yaml().safe_load_all((K8S / name).read_text()) if d]
    return docs


def _find(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _sts(docs: Docs, role: str) -> dict[str, Any]:
    return _find(docs, "StatefulSet", f"kvxferd-{role}")


def _daemon(sts: dict[str, Any]) -> dict[str, Any]:
    """The kvxferd container: a native sidecar (an init container that keeps running)."""
    spec = sts["spec"]["template"]["spec"]
    found = [c for c in spec.get("initContainers", []) if c["name"] == "kvxferd"]
    assert len(found) == 1, "kvxferd is not an init container (a native sidecar)"
    assert found[0].get("restartPolicy") == "Always", "kvxferd: not a sidecar (restartPolicy)"
    assert not [c for c in spec["containers"] if c["name"] == "kvxferd"], "kvxferd twice"
    return found[0]


def _engine(sts: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert len(found) == 1, "no engine container"
    return found[0]


def _port(container: dict[str, Any], ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    found = [p["containerPort"] for p in container.get("ports", []) if p["name"] == ref]
    assert len(found) == 1, f"{container['name']}: no port named {ref}"
    return found[0]


def _endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_QUANTITY |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity ('1Gi', '512Mi', '1000000') in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGT]i?|Ki)?", str(quantity))
    assert m, f"cannot read quantity {quantity!r}"
    return int(float(m.group(1)) * _QUANTITY[m.group(2) or ""])


def _toml(docs: Docs, sts: dict[str, Any], role: str) -> str:
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    cms = [v["configMap"] for v in volumes if "configMap" in v]
    assert len(cms) == 1, "one ConfigMap volume with the TOML file"
    return _find(docs, "ConfigMap", cms[0]["name"])["data"][f"{role}.toml"]


def _pod_env(container: dict[str, Any], pod_name: str, pod_ip: str = POD_IP) -> dict[str, str]:
    """The container's environment as Kubernetes sets it ($(VAR) expands earlier entries)."""
    fields = {"metadata.name": pod_name, POD_INDEX_FIELD: "0", "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        raw = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], raw)
    return env


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Exactly these settings variables in os.environ for the duration."""
    ours = [k for k in os.environ if k.startswith("KVXFERD_") or k == THREADS_ENV]
    saved = {k: os.environ.pop(k) for k in ours}
    os.environ.update(env)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


def _settings(docs: Docs, role: str) -> SenderSettings | ReceiverSettings:
    """The daemon's effective settings in pod 0: the ConfigMap's TOML plus the pod's env."""
    sts = _sts(docs, role)
    env = _pod_env(_daemon(sts), f"kvxferd-{role}-0")
    env = {k: v for k, v in env.items() if k.startswith("KVXFERD_") or k == THREADS_ENV}
    load = load_sender_settings if role == "sender" else load_receiver_settings
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{role}.toml"
        path.write_text(_toml(docs, sts, role))
        with _environ(env):
            return load(path)


def _shm_bytes(pool: PoolSettings) -> int:
    """What the daemon puts in /dev/shm: the aux slots, and the KV pool unless it is on a GPU."""
    return pool.aux_slots * pool.aux_slot_bytes + (pool.kv_bytes if pool.device == "cpu" else 0)


def _volume_at(sts: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    mounts = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(mounts) == 1, f"{container['name']}: nothing mounted at {path}"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    return volumes[mounts[0]] | {"name": mounts[0]}


def _ucx_ports(daemon: dict[str, Any]) -> tuple[int, int]:
    env = _pod_env(daemon, "pod")
    assert UCX_PORT_RANGE_ENV in env, f"{UCX_PORT_RANGE_ENV} unset: UCX listens on any port"
    m = re.fullmatch(r"(\d+)-(\d+)", env[UCX_PORT_RANGE_ENV])
    assert m, f"{UCX_PORT_RANGE_ENV}={env[UCX_PORT_RANGE_ENV]!r} is not a range"
    return int(m.group(1)), int(m.group(2))


def _prestop_s(container: dict[str, Any]) -> float:
    prestop = container.get("lifecycle", {}).get("preStop")
    if prestop is None:
        return 0.0
    if "sleep" in prestop:
        return float(prestop["sleep"]["seconds"])
    return float(prestop["exec"]["command"][-1])  # exec: [sleep, N]


def check_sidecar(docs: Docs, role: str) -> None:
    """The engine and its daemon in one pod: the daemon a native sidecar, sharing socket and /dev/shm."""
    sts = _sts(docs, role)
    daemon, engine = _daemon(sts), _engine(sts)
    assert "startupProbe" in daemon, "the engine would start before the daemon is up"
    assert daemon["args"] == [role, "--config", f"/etc/kvxferd/{role}.toml"]

    socket = _settings(docs, role).service.engine_socket
    assert socket.startswith("ipc://"), socket
    socket_dir = str(Path(socket.removeprefix("ipc://")).parent)
    assert socket_dir == SOCKET_DIR, f"engine_socket {socket} outside {SOCKET_DIR}"
    for path in (socket_dir, SHM_DIR):
        mine, theirs = _volume_at(sts, daemon, path), _volume_at(sts, engine, path)
        assert mine["name"] == theirs["name"], f"{path}: the containers mount different volumes"
        assert "emptyDir" in mine, f"{path}: not an emptyDir of this pod"

    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in (daemon, engine):  # the socket and the pool are 0600: one uid for both
        assert "runAsUser" not in c.get("securityContext", {}), f"{c['name']}: own uid"
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert not sc["capabilities"].get("add"), f"{c['name']}: added capabilities"
        for kind in ("requests", "limits"):
            assert "memory" in c["resources"][kind], f"{c['name']}: no memory {kind}"


def check_shm(docs: Docs, role: str) -> None:
    """/dev/shm is memory-backed and holds the pool the ConfigMap configures, plus headroom."""
    sts = _sts(docs, role)
    daemon = _daemon(sts)
    pool = _settings(docs, role).pool
    shm = _volume_at(sts, daemon, SHM_DIR)["emptyDir"]
    assert shm.get("medium") == "Memory", "/dev/shm on disk"
    need = _shm_bytes(pool) + SHM_HEADROOM_BYTES
    size = _bytes(shm["sizeLimit"])
    assert size >= need, f"/dev/shm sizeLimit {shm['sizeLimit']} < pool + headroom ({need} B)"
    limit = _bytes(daemon["resources"]["limits"]["memory"])
    assert limit >= _shm_bytes(pool) + DAEMON_RSS_BYTES, "daemon memory limit below pool + process"


def check_probes(docs: Docs, role: str) -> None:
    """The daemon's probes and scrape annotation use the probe port its settings configure."""
    sts = _sts(docs, role)
    daemon = _daemon(sts)
    service = _settings(docs, role).service
    assert service.probe_host == "0.0.0.0", "the kubelet probes the pod IP, not loopback"
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        get = daemon[probe]["httpGet"]
        assert get["path"] == path, probe
        port = _port(daemon, get["port"])
        assert port == service.probe_port, f"{probe} on {port}, probe_port {service.probe_port}"
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(service.probe_port)


def check_grace(docs: Docs, role: str) -> None:
    """The grace period covers the engine's stop, then the daemon's whole shutdown bound."""
    sts = _sts(docs, role)
    daemon, engine = _daemon(sts), _engine(sts)
    deadlines = _settings(docs, role).deadlines
    template = sts["spec"]["template"]
    engine_stop_s = float(template["metadata"]["annotations"][ENGINE_STOP_ANNOTATION])
    # Native sidecar order: engine preStop and stop first, then the daemon's preStop and stop.
    need = _prestop_s(engine) + engine_stop_s + _prestop_s(daemon)
    need += deadlines.shutdown_timeout_ms / 1000 + EXIT_SLACK_S
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace > need, f"terminationGracePeriodSeconds {grace} <= {need}"
    assert deadlines.drain_timeout_ms < deadlines.shutdown_timeout_ms


def check_pdb(docs: Docs, role: str) -> None:
    """One PodDisruptionBudget covers the role's pods and lets at most some of them go."""
    sts = _sts(docs, role)
    labels = sts["spec"]["selector"]["matchLabels"]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    mine = [p for p in pdbs if p["spec"]["selector"].get("matchLabels") == labels]
    assert len(mine) == 1, f"{role}: {len(mine)} PodDisruptionBudgets select its pods"
    spec = mine[0]["spec"]
    if "maxUnavailable" in spec:
        assert 0 < int(spec["maxUnavailable"]) < sts["spec"]["replicas"], spec
    else:
        assert 0 < int(spec["minAvailable"]) < sts["spec"]["replicas"], spec


def _policy(docs: Docs, role: str) -> dict[str, Any]:
    """The one NetworkPolicy that selects exactly the role's pods."""
    labels = _sts(docs, role)["spec"]["selector"]["matchLabels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    mine = [p for p in policies if p["spec"]["podSelector"].get("matchLabels") == labels]
    assert len(mine) == 1, f"{role}: {len(mine)} NetworkPolicies select its pods"
    assert "Ingress" in mine[0]["spec"]["policyTypes"]
    return mine[0]


def _admitted(docs: Docs, role: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The role's ingress: (port, end port) -> the sources admitted to it."""
    admitted: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rule in _policy(docs, role)["spec"].get("ingress", []):
        sources = rule.get("from")
        assert sources, "a rule without `from` admits every source"
        for source in sources:
            assert source and "ipBlock" not in source, f"an open source: {source}"
        assert rule.get("ports"), "a rule without ports admits every port"
        for p in rule["ports"]:
            assert p.get("protocol", "TCP") == "TCP", p
            assert isinstance(p["port"], int), f"named port {p['port']}: say the number"
            admitted.setdefault((p["port"], p.get("endPort", p["port"])), []).extend(sources)
    return admitted


def _control_port(settings: SenderSettings | ReceiverSettings) -> int:
    """The port the peer role connects to: the sender's listen, the receiver's result endpoint."""
    if isinstance(settings, SenderSettings):
        return _endpoint_port(settings.listen)
    return _endpoint_port(settings.result_endpoint)


def _only_peer(docs: Docs, role: str) -> list[dict[str, Any]]:
    peer_labels = _sts(docs, PEER[role])["spec"]["selector"]["matchLabels"]
    return [{"podSelector": {"matchLabels": peer_labels}}]


def check_netpol(docs: Docs, role: str) -> None:
    """The role's NetworkPolicy admits only the peer role on the configured control and UCX ports."""
    sts = _sts(docs, role)
    daemon = _daemon(sts)
    settings = _settings(docs, role)
    control = _control_port(settings)
    port_name = "control" if role == "sender" else "result"
    assert _port(daemon, port_name) == control, f"port {port_name} is not {control}"
    ucx = _ucx_ports(daemon)
    engine_ports = {p["containerPort"] for p in _engine(sts).get("ports", [])}

    admitted = _admitted(docs, role)
    only_peer = _only_peer(docs, role)
    assert admitted.get((control, control)) == only_peer, f"control port {control}"
    assert admitted.get(ucx) == only_peer, f"UCX ports {ucx[0]}-{ucx[1]}"
    probe = settings.service.probe_port
    assert (probe, probe) in admitted, f"probe port {probe} closed to monitoring"
    assert all("namespaceSelector" in s for s in admitted[(probe, probe)]), "probe port: who?"
    others = set(admitted) - {(control, control), ucx, (probe, probe)}
    assert all(lo == hi and lo in engine_ports for lo, hi in others), f"stray ports {others}"


CHECKS = [check_sidecar, check_shm, check_probes, check_grace, check_pdb, check_netpol]


def test_kustomization_lists_every_manifest() -> None:
    """kustomization.yaml names every manifest in deploy/k8s, and the images it pins: the
    daemon's tag is the package version (a release bumps both)."""
    kust = _kustomization()
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    docs = _docs()
    daemons = {_daemon(_sts(docs, role))["image"] for role in ROLES}
    engines = {_engine(_sts(docs, role))["image"] for role in ROLES}
    assert daemons == {f"kvxferd:{__version__}"}
    assert engines == {"engine:placeholder"}
    assert {"name": "kvxferd", "newName": "kvxferd", "newTag": __version__} in kust["images"]
    assert {"name": "engine", "newName": "engine", "newTag": "placeholder"} in kust["images"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("role", ROLES)
def test_manifest_check(check: Callable[[Docs, str], None], role: str) -> None:
    """Each role's pod, PodDisruptionBudget and NetworkPolicy pass the check (see its docstring)."""
    check(_docs(), role)


def _set(path: str, value: Any) -> Callable[[Docs], None]:
    """A mutation: set kind/name:dotted.path (list items by index or by name) to value."""
    target, dotted = path.split(":")
    kind, name = target.split("/")

    def mutate(docs: Docs) -> None:
        node: Any = _find(docs, kind, name)
        keys = dotted.split(".")
        for key in keys[:-1]:
            if isinstance(node, list):
                node = (
                    node[int(key)]
                    if key.isdigit()
                    else next(n for n in node if n.get("name") == key)
                )
            else:
                node = node[key]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value

    return mutate


_DELETE = object()
STS_S = "StatefulSet/kvxferd-sender:spec.template"
STS_R = "StatefulSet/kvxferd-receiver:spec.template"


def _edit_toml(role: str, old: str, new: str) -> Callable[[Docs], None]:
    def mutate(docs: Docs) -> None:
        data = _find(docs, "ConfigMap", "kvxferd-config")["data"]
        assert old in data[f"{role}.toml"]
        data[f"{role}.toml"] = data[f"{role}.toml"].replace(old, new)

    return mutate


def _daemon_in_containers(docs: Docs) -> None:
    spec = _sts(docs, "sender")["spec"]["template"]["spec"]
    daemon = spec.pop("initContainers")[0]
    del daemon["restartPolicy"]
    spec["containers"].append(daemon)


def _both(*mutations: Callable[[Docs], None]) -> Callable[[Docs], None]:
    def mutate(docs: Docs) -> None:
        for m in mutations:
            m(docs)

    return mutate


def _drop_kind(kind: str, name: str) -> Callable[[Docs], None]:
    def mutate(docs: Docs) -> None:
        docs.remove(_find(docs, kind, name))

    return mutate


BROKEN = {
    # name: (what breaks, which check, which role)
    "daemon-not-a-sidecar": (_daemon_in_containers, check_sidecar, "sender"),
    "engine-without-socket-dir": (
        _set(f"{STS_R}.spec.containers.engine.volumeMounts.1.mountPath", "/run/engine"),
        check_sidecar,
        "receiver",
    ),
    "engine-own-shm": (
        _set(f"{STS_S}.spec.containers.engine.volumeMounts.0.name", "engine-tmp"),
        check_sidecar,
        "sender",
    ),
    "engine-socket-elsewhere": (
        _edit_toml("sender", "ipc:///run/kvxferd/engine.sock", "ipc:///tmp/engine.sock"),
        check_sidecar,
        "sender",
    ),
    "shm-too-small": (
        _set(f"{STS_S}.spec.volumes.dshm.emptyDir.sizeLimit", "256Mi"),
        check_shm,
        "sender",
    ),
    "shm-on-disk": (
        _set(f"{STS_R}.spec.volumes.dshm.emptyDir.medium", ""),
        check_shm,
        "receiver",
    ),
    "pool-grown-in-toml": (
        _edit_toml("receiver", "num_blocks = 2048", "num_blocks = 8192"),
        check_shm,
        "receiver",
    ),
    "probe-port-moved-in-toml": (
        _edit_toml("sender", "probe_port = 9400", "probe_port = 9500"),
        check_probes,
        "sender",
    ),
    "liveness-on-wrong-port": (
        _set(f"{STS_R}.spec.initContainers.kvxferd.livenessProbe.httpGet.port", 8000),
        check_probes,
        "receiver",
    ),
    "grace-too-short": (
        _set(f"{STS_S}.spec.terminationGracePeriodSeconds", 45),
        check_grace,
        "sender",
    ),
    "shutdown-raised-in-toml": (
        _edit_toml("receiver", "shutdown_timeout_ms = 15000", "shutdown_timeout_ms = 30000"),
        check_grace,
        "receiver",
    ),
    "no-receiver-pdb": (
        _drop_kind("PodDisruptionBudget", "kvxferd-receiver"),
        check_pdb,
        "receiver",
    ),
    "no-sender-netpol": (_drop_kind("NetworkPolicy", "kvxferd-sender"), check_netpol, "sender"),
    "netpol-result-port-drift": (
        _set("NetworkPolicy/kvxferd-receiver:spec.ingress.0.ports.0.port", 5557),
        check_netpol,
        "receiver",
    ),
    "control-port-moved-in-toml": (
        _edit_toml("sender", 'listen = "tcp://0.0.0.0:5555"', 'listen = "tcp://0.0.0.0:6000"'),
        check_netpol,
        "sender",
    ),
    "control-port-moved-but-not-in-netpol": (
        _both(
            _edit_toml("sender", "tcp://0.0.0.0:5555", "tcp://0.0.0.0:6000"),
            _set(f"{STS_S}.spec.initContainers.kvxferd.ports.control.containerPort", 6000),
        ),
        check_netpol,
        "sender",
    ),
    "netpol-open-to-all-pods": (
        _set("NetworkPolicy/kvxferd-sender:spec.ingress.0.from", [{"podSelector": {}}]),
        check_netpol,
        "sender",
    ),
    "ucx-range-drift": (
        _set(f"{STS_R}.spec.initContainers.kvxferd.env.UCX_TCP_PORT_RANGE.value", "30000-30099"),
        check_netpol,
        "receiver",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_catches(name: str) -> None:
    """Each check fails on a manifest (or ConfigMap) broken the way it guards against."""
    mutate, check, role = BROKEN[name]
    docs = copy.deepcopy(_docs())
    check(docs, role)  # the copy passes before the break
    mutate(docs)
    with pytest.raises(AssertionError):
        check(docs, role)


@pytest.mark.parametrize("role", ROLES)
def test_statefulset_structure(role: str) -> None:
    """Each StatefulSet has a headless Service on the daemon's ports, rank env, the ConfigMap and no threads env."""
    docs = _docs()
    sts = _sts(docs, role)
    pod = sts["spec"]["template"]
    daemon = _daemon(sts)

    svc = _find(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == ({"control": 5555} if role == "sender" else {"result": 5556}) | {"probe": 9400}
    assert {p["name"]: _port(daemon, p["targetPort"]) for p in svc["spec"]["ports"]} == ports

    # The rank from the pod index, the name from the pod; threads from the file only.
    env = {e["name"]: e for e in daemon["env"]}
    for container in (daemon, _engine(sts)):
        names = {e["name"] for e in container.get("env", [])}
        assert THREADS_ENV not in names and "KVXFERD_NUM_THREADS" not in names
    assert env["KVXFERD_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_FIELD
    assert env["KVXFERD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    config = _volume_at(sts, daemon, "/etc/kvxferd")["configMap"]
    assert {"key": f"{role}.toml", "path": f"{role}.toml"} in config["items"]


@pytest.mark.parametrize("role", ROLES)
def test_configmap_loads_with_pod_env(role: str) -> None:
    """The ConfigMap's TOML plus the pod's env give valid settings: the pod's name, routable endpoints, threads from the file."""
    docs = _docs()
    sts = _sts(docs, role)
    settings = _settings(docs, role)
    text = _toml(docs, sts, role)
    assert settings.name == f"kvxferd-{role}-0"
    assert {"num_layers", "num_blocks", "block_elems", "dtype"} <= tomllib.loads(text)[
        "pool"
    ].keys()
    if isinstance(settings, SenderSettings):
        assert settings.num_threads == tomllib.loads(text)["num_threads"]
        bound = settings.listen
    else:
        bound = settings.result_endpoint
    # Bound on every address, advertised as the pod IP (the downward API's status.podIP).
    assert bound.startswith("tcp://0.0.0.0:")
    svc = settings.service
    host = advertise_host(svc.advertise_host, svc.advertise_interface)
    assert advertised(bound, host, "endpoint") == f"tcp://{POD_IP}:{_endpoint_port(bound)}"


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install it)"
    )


def _validate(kv: Any, docs: Docs, version: str) -> list[str]:
    errors = []
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            kind, name = doc["kind"], doc["metadata"]["name"]
            errors.append(f"{kind}/{name} against {version}: {e.message} at {list(e.path)}")
    return errors


@pytest.mark.parametrize("version", [MIN_K8S, "latest"])
def test_kubernetes_validate(version: str) -> None:
    """Every manifest passes kubernetes-validate's strict schema for the oldest supported and the latest Kubernetes."""
    kv = _kubernetes_validate()
    errors = _validate(kv, _docs(), kv.latest_version() if version == "latest" else version)
    assert not errors, "\n".join(errors)


def test_kubernetes_validate_catches_a_broken_manifest() -> None:
    """The schema check is not vacuous: a misspelt field and a wrong type fail it."""
    kv = _kubernetes_validate()
    docs = _docs()
    _set(f"{STS_S}.spec.terminationGracePeriodSecond", 60)(docs)
    _set("NetworkPolicy/kvxferd-receiver:spec.ingress.0.ports.1.endPort", "20099")(docs)
    errors = _validate(kv, docs, MIN_K8S)
    assert len(errors) == 2, errors


# The commented-out lines an operator enables for GPUs and RDMA (sender.yaml, receiver.yaml).
OPTIONS = (
    "resourceClaims:",
    "- name: gpu",
    "resourceClaimTemplateName:",
    "- name: UCX_NET_DEVICES",
    "value: mlx5_0:1,eth0",
    "rdma/hca_shared_devices_a: 1",
    "nvidia.com/cx7_sriov: 1",
    "claims:",
    'add: ["IPC_LOCK"]',
    "nvidia.com/gpu: 1",
)


@pytest.mark.parametrize("role", ROLES)
def test_kubernetes_validate_with_gpu_and_rdma_options(role: str) -> None:
    """The commented-out GPU and RDMA lines, once enabled, still give valid manifests."""
    kv = _kubernetes_validate()
    lines, found = [], set()
    for line in (K8S / f"{role}.yaml").read_text().splitlines():
        body = line.lstrip()
        text = body[2:].lstrip() if body.startswith("# ") else ""
        option = next((o for o in OPTIONS if text.startswith(o)), None)
        if option is not None:
            found.add(option)
            line = line[: len(line) - len(body)] + body[2:]
        lines.append(line)
    assert found == set(OPTIONS), f"options no longer in {role}.yaml: {set(OPTIONS) - found}"
    docs = [d for d in _yaml().safe_load_all("\n".join(lines)) if d]
    daemon = _daemon(_sts(docs, role))
    assert daemon["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    errors = _validate(kv, docs, kv.latest_version())
    assert not errors, "\n".join(errors)


def test_kustomize_build() -> None:
    """`kubectl kustomize deploy/k8s` builds every resource into the kvxferd namespace with the pinned images."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found (it builds kustomizations offline: kubectl kustomize)")
    res = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    built = [d for d in _yaml().safe_load_all(res.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in _docs()
    )
    namespaced = [d for d in built if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"kvxferd"}


# ------------------------------------------- the pods' daemons, live, against the policy

STARTUP_S = 60.0  # a daemon imports torch and NIXL and creates an agent


class _PodDaemon(ChildProcess):
    """``kvxferd ROLE`` with a role's ConfigMap TOML and its pod's env; its ready line."""

    def __init__(self, role: str, toml: Path, env: dict[str, str], tmp: Path) -> None:
        args = [role, "--config", str(toml)]
        super().__init__("kvxferd", args, tmp / f"{role}.stderr", role, env)

    def wait_ready(self) -> dict[str, Any]:
        try:
            return self.child.wait_ready(time.monotonic() + STARTUP_S)
        except LaunchError:
            raise AssertionError(self.describe()) from None


def _host_ip() -> str:
    """This host's address on its default route, standing in for a pod IP (loopback if none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent; the kernel picks the source
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _tcp(pid: int) -> tuple[set[int], set[tuple[int, int]]]:
    """A process's TCP sockets: (listening ports, established (local, remote) port pairs)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
            if m:
                inodes.add(m.group(1))
    listening, established = set(), set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
            if fields[3] == "0A":  # LISTEN
                listening.add(local)
            elif fields[3] == "01":  # ESTABLISHED
                established.add((local, remote))
    return listening, established


def _pod_keys(docs: Docs, tmp_path: Path) -> dict[str, dict[str, str]]:
    """`kvxferd keygen` pairs laid out as each pod's Secret volumes lay them out (under
    ``tmp_path`` instead of the mount paths): the settings variables that point there."""
    from kvxferd.auth import keygen

    made = {role: keygen(tmp_path / "keygen", role) for role in ROLES}
    out: dict[str, dict[str, str]] = {}
    for role in ROLES:
        sts = _sts(docs, role)
        daemon = _daemon(sts)
        settings = _settings(docs, role).security
        env = {"KVXFERD_SECURITY__MODE": settings.mode}
        for mount in daemon["volumeMounts"]:
            volume = _volume_at(sts, daemon, mount["mountPath"])
            if "secret" not in volume:
                continue
            local = tmp_path / f"{role}-{volume['name']}"
            local.mkdir()
            owner = volume["secret"]["secretName"].removeprefix("kvxferd-").removesuffix("-key")
            for item in volume["secret"]["items"]:
                public, secret = made[owner]
                src = secret if item["key"].endswith("_secret") else public
                shutil.copy(src, local / item["path"])
                os.chmod(local / item["path"], volume["secret"]["defaultMode"])
            mounted = mount["mountPath"]
            if settings.key_file and settings.key_file.startswith(mounted + "/"):
                env["KVXFERD_SECURITY__KEY_FILE"] = str(local) + settings.key_file[len(mounted) :]
            if settings.allowed_keys_dir == mounted:
                env["KVXFERD_SECURITY__ALLOWED_KEYS_DIR"] = str(local)
            moved = {
                ep: str(local) + key[len(mounted) :]
                for ep, key in settings.sender_keys.items()
                if key.startswith(mounted + "/")
            }
            if moved:
                env["KVXFERD_SECURITY__SENDER_KEYS"] = json.dumps(moved)
        out[role] = env
    return out


@pytest.mark.parametrize("role", ROLES)
def test_pods_run_curve_with_keys_from_secrets(role: str) -> None:
    """Each role runs CURVE: its key file from its own role's Secret (secret half only), its allow-list the other role's public half, a receiver expecting the senders' key."""
    docs = _docs()
    sts = _sts(docs, role)
    daemon = _daemon(sts)
    sec = _settings(docs, role).security
    peer = "receiver" if role == "sender" else "sender"
    assert sec.mode == "curve"
    assert sec.key_file is not None and sec.allowed_keys_dir is not None
    own = _volume_at(sts, daemon, os.path.dirname(sec.key_file))["secret"]
    assert own["secretName"] == f"kvxferd-{role}-key"
    assert own["items"] == [{"key": f"{role}.key_secret", "path": os.path.basename(sec.key_file)}]
    assert own["defaultMode"] & 0o027 == 0, "the secret would be open to others"
    allowed = _volume_at(sts, daemon, sec.allowed_keys_dir)["secret"]
    assert allowed["secretName"] == f"kvxferd-{peer}-key"
    assert [i["key"] for i in allowed["items"]] == [f"{peer}.key"], "only the public half"
    engine_mounts = {m["mountPath"] for m in _engine(sts).get("volumeMounts", [])}
    assert os.path.dirname(sec.key_file) not in engine_mounts, "the engine sees the secret"
    if role == "receiver":
        assert sec.sender_keys == {"*": f"{sec.allowed_keys_dir}/sender.key"}


@pytest.mark.parametrize("role", ROLES)
def test_shipped_configs_run_curve(role: str) -> None:
    """configs/<role>.toml runs CURVE with its keys under /etc/kvxferd/keys, and each systemd unit reloads the allow-list with SIGHUP."""
    text = (ROOT / "configs" / f"{role}.toml").read_text()
    sec = tomllib.loads(text)["security"]
    assert sec["mode"] == "curve"
    assert sec["key_file"] == f"/etc/kvxferd/keys/{role}.key_secret"
    assert sec["allowed_keys_dir"] == "/etc/kvxferd/keys/allowed"
    for unit in UNITS:
        if _role_of(unit) == role:
            assert _parse_unit(unit)["Service"]["ExecReload"] == "/bin/kill -HUP $MAINPID"


def test_daemons_connect_only_where_the_policy_admits(tmp_path: Path) -> None:
    """Both daemons, run from the ConfigMap and the pods' env, move a request over connections each NetworkPolicy admits."""
    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("needs /proc/<pid>/net/tcp (Linux) to list the daemons' connections")
    from kvxferd.engine.client import Client, attach_pool

    docs = _docs()
    ip = _host_ip()
    keys = _pod_keys(docs, tmp_path)
    daemons: dict[str, _PodDaemon] = {}
    try:
        for role in ROLES:
            sts = _sts(docs, role)
            env = _pod_env(_daemon(sts), f"kvxferd-{role}-0", pod_ip=ip)
            # Only what this host must change: its own sockets, free ports, and the key
            # files where the pod's Secret volumes would put them.
            env["KVXFERD_SERVICE__ENGINE_SOCKET"] = f"ipc://{tmp_path}/{role}.sock"
            env["KVXFERD_SERVICE__PROBE_PORT"] = "0"
            env.update(keys[role])
            if role == "sender":
                env["KVXFERD_LISTEN"] = "tcp://0.0.0.0:0"
            else:
                env["KVXFERD_RESULT_ENDPOINT"] = "tcp://0.0.0.0:0"
                env["KVXFERD_ACCESS__DIAL_ALLOW"] = f'["{ip}"]'  # the pod network's CIDR
            toml = tmp_path / f"{role}.toml"
            toml.write_text(_toml(docs, sts, role))
            daemons[role] = _PodDaemon(role, toml, env, tmp_path)
        ready = {role: d.wait_ready() for role, d in daemons.items()}

        tx = Client(ready["sender"]["engine_socket"], timeout_s=10.0)
        rx = Client(ready["receiver"]["engine_socket"], timeout_s=10.0)
        attach_pool(tx.describe())[:, [3, 4], :] = 7
        published = tx.publish("req-1", [3, 4], aux=b"tok", expected_fetches=1)
        sender_at = f"tcp://{ip}:{_endpoint_port(ready['sender']['endpoint'])}"
        fetch = rx.fetch("req-1", sender_at, [40, 41])
        outcome = rx.wait(fetch, timeout=30.0)
        assert outcome is not None and outcome.state == "done", outcome
        assert (attach_pool(rx.describe())[:, [40, 41], :] == 7).all()
        # A done fetch is told by a NIXL notification; a failed one by a Result on the
        # sender's connection to the receiver's result port: a fetch parked before its
        # publish, refused when the publish brings another block count.
        refused = rx.fetch("req-2", sender_at, [42])
        probe = f"http://127.0.0.1:{ready['sender']['probe_port']}/metrics"
        parked = 'kvxferd_transfers_in_flight{state="parked"} 1.0'
        wait_until(
            lambda: parked in urllib.request.urlopen(probe, timeout=5).read().decode(),
            10.0,
            "the fetch parked at the sender",
            poll=0.05,
        )
        tx.publish("req-2", [3, 4])
        failed = rx.wait(refused, timeout=10.0)
        assert failed is not None and failed.state == "failed", failed

        # Every connection between the two: who opened it, to which port.
        sockets = {role: _tcp(d.pid) for role, d in daemons.items()}
        seen = set()
        for client, server in (("sender", "receiver"), ("receiver", "sender")):
            for local, remote in sockets[client][1]:
                if (remote, local) in sockets[server][1] and remote in sockets[server][0]:
                    seen.add((client, server, remote))

        # Map this host's free ports back to the ports the pods declare.
        declared = {
            _endpoint_port(ready[role]["endpoint"]): _control_port(_settings(docs, role))
            for role in ROLES
        }
        kinds: set[tuple[str, str, int | str]] = set()
        for client, server, port in sorted(seen):
            port = declared.get(port, port)
            admitted = _admitted(docs, server)
            rules = [sources for (lo, hi), sources in admitted.items() if lo <= port <= hi]
            assert rules, f"{client} -> {server} port {port}: no rule admits it"
            assert all(r == _only_peer(docs, server) for r in rules), f"{server} port {port}"
            ucx_lo, ucx_hi = _ucx_ports(_daemon(_sts(docs, server)))
            kinds.add((client, server, "ucx" if ucx_lo <= port <= ucx_hi else port))
        expected = {("receiver", "sender", 5555), ("sender", "receiver", 5556)}
        assert expected <= kinds, f"control connections missing: {sorted(seen)}"
        assert ("sender", "receiver", "ucx") in kinds, f"no UCX connection: {sorted(seen)}"
        tx.close(published, timeout=5.0)
        rx.close(fetch, timeout=5.0)
        rx.close(refused, timeout=5.0)
    finally:
        for d in daemons.values():
            d.kill()
