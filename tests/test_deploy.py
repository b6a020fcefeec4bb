"""Offline checks of deploy/: the systemd units and the Kubernetes manifests.

Always run: a structural check of every unit (configparser) and of every
manifest (PyYAML), tied to the settings defaults in kvxferd.config. When the
tools exist: ``systemd-analyze verify`` on each unit and ``kubernetes-validate``
(strict schemas) on each manifest; otherwise those tests skip and say why.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvxferd.config import (
    THREADS_ENV,
    Deadlines,
    ServiceSettings,
    load_receiver_settings,
    load_sender_settings,
)

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
K8S = ROOT / "deploy" / "k8s"
UNITS = sorted(SYSTEMD.glob("*.service"))
ROLES = ("sender", "receiver")
INSTALLED_BINARY = "/usr/local/bin/kvxferd"
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
# Oldest Kubernetes with the preStop `sleep` action on by default (beta in 1.30).
MIN_K8S = "1.30.0"
# The daemon exits within shutdown_timeout_ms + this (kvxferd/daemon.py).
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


def _yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")


def _kustomization() -> dict[str, Any]:
    return _yaml().safe_load((K8S / "kustomization.yaml").read_text())


def _docs() -> list[dict[str, Any]]:
    docs = []
    for name in _kustomization()["resources"]:
        docs += [d for d in _yaml().safe_load_all((K8S / name).read_text()) if d]
    return docs


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    containers = sts["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == "kvxferd"]
    assert len(found) == 1
    return found[0]


def _port(container: dict[str, Any], ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    return next(p["containerPort"] for p in container["ports"] if p["name"] == ref)


def _toml(docs: list[dict[str, Any]], sts: dict[str, Any], role: str) -> str:
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    cms = [v["configMap"] for v in volumes if "configMap" in v]
    assert len(cms) == 1, "one ConfigMap volume with the TOML file"
    return _find(docs, "ConfigMap", cms[0]["name"])["data"][f"{role}.toml"]


def test_kustomization_lists_every_manifest() -> None:
    """kustomization.yaml names every manifest in deploy/k8s, and the image it pins."""
    kust = _kustomization()
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    images = {c["image"] for d in _docs() if d["kind"] == "StatefulSet" for c in [_container(d)]}
    assert images == {"kvxferd:0.1.0"}
    assert {"name": "kvxferd", "newName": "kvxferd", "newTag": "0.1.0"} in kust["images"]


@pytest.mark.parametrize("role", ROLES)
def test_statefulset_structure(role: str) -> None:
    """Each StatefulSet has a headless Service, the three probes, a long enough grace period, rank env and volumes."""
    docs = _docs()
    sts = _find(docs, "StatefulSet", f"kvxferd-{role}")
    pod = sts["spec"]["template"]
    c = _container(sts)

    # Headless Service for stable per-rank names, selecting these pods.
    svc = _find(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    # Ports: control plane (sender) or result endpoint (receiver), probes.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == ({"control": 5555} if role == "sender" else {"result": 5556}) | {"probe": 9400}
    assert {p["name"]: _port(c, p["targetPort"]) for p in svc["spec"]["ports"]} == ports

    # Probes: liveness and startup on /healthz (never peers), readiness on /readyz.
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz")) + (
        ("readinessProbe", "/readyz"),
    ):
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _port(c, get["port"]) == ports["probe"], probe

    # Grace period > preStop + drain + close (the daemon's whole shutdown bound).
    prestop = c["lifecycle"]["preStop"]
    sleep_s = (
        prestop["sleep"]["seconds"] if "sleep" in prestop else int(prestop["exec"]["command"][-1])
    )
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    shutdown_s = Deadlines().shutdown_timeout_ms / 1000 + EXIT_SLACK_S
    assert grace > sleep_s + shutdown_s

    # Environment: the rank from the pod index, the name from the pod; threads from the file.
    env = {e["name"]: e for e in c["env"]}
    assert THREADS_ENV not in env and "KVXFERD_NUM_THREADS" not in env
    assert env["KVXFERD_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_FIELD
    assert env["KVXFERD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVXFERD_SERVICE__PROBE_HOST"]["value"] == "0.0.0.0"

    # Volumes: the ConfigMap at /etc/kvxferd, /dev/shm in memory with a bound.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    config = volumes[mounts["/etc/kvxferd"]]["configMap"]
    assert {"key": f"{role}.toml", "path": f"{role}.toml"} in config["items"]
    assert c["args"] == [role, "--config", f"/etc/kvxferd/{role}.toml"]
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert "/run/kvxferd" in mounts, "the engine socket needs a writable directory"

    # Non-root, bounded resources.
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= c["resources"][kind].keys()


@pytest.mark.parametrize("role", ROLES)
def test_configmap_loads_with_pod_env(
    role: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The ConfigMap's TOML plus the pod's env give valid settings that match the declared ports and grace period."""
    docs = _docs()
    sts = _find(docs, "StatefulSet", f"kvxferd-{role}")
    c = _container(sts)
    for key in list(os.environ):
        if key.startswith("KVXFERD_") or key == THREADS_ENV:
            monkeypatch.delenv(key)
    fields = {
        "metadata.name": f"kvxferd-{role}-0",
        POD_INDEX_FIELD: "0",
        "status.podIP": "10.1.2.3",
    }
    env: dict[str, str] = {}
    for e in c["env"]:  # Kubernetes expands $(VAR) from earlier entries
        raw = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], raw)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    path = tmp_path / f"{role}.toml"
    path.write_text(_toml(docs, sts, role))
    load = load_sender_settings if role == "sender" else load_receiver_settings
    settings = load(path)

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert settings.name == f"kvxferd-{role}-0"
    assert settings.service.probe_host == "0.0.0.0"
    assert settings.service.probe_port == ports["probe"]
    assert settings.service.engine_socket.startswith("ipc:///run/kvxferd/")
    if role == "sender":
        assert settings.listen == f"tcp://0.0.0.0:{ports['control']}"
        assert settings.num_threads == tomllib.loads(_toml(docs, sts, role))["num_threads"]
    else:
        # The receiver sends the address it bound to the senders: it must be routable.
        assert settings.result_endpoint == f"tcp://10.1.2.3:{ports['result']}"
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    sleep_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace > sleep_s + settings.deadlines.shutdown_timeout_ms / 1000 + EXIT_SLACK_S
    assert settings.deadlines.drain_timeout_ms < settings.deadlines.shutdown_timeout_ms


@pytest.mark.parametrize("version", [MIN_K8S, "latest"])
def test_kubernetes_validate(version: str) -> None:
    """Every manifest passes kubernetes-validate's strict schema for the oldest supported and the latest Kubernetes."""
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install it)"
    )
    target = kv.latest_version() if version == "latest" else version
    for doc in _docs():
        kind, name = doc["kind"], doc["metadata"]["name"]
        try:
            kv.validate(doc, target, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{kind}/{name} against {target}: {e.message} at {list(e.path)}")
