"""The previous release, built from its own commit into a virtualenv of its own (kvxferd-free).

CHANGELOG.md names every release and its commit (a ``Commit: <40 hex>`` line under its
``## <version>`` heading, newest first; the release being made says ``Commit:
unreleased``). The previous release is the newest one before the current one with a
commit. Building it::

    git archive <commit>  -> .cache/release-<version>/src      (the old tree, as released)
    python -m venv --without-pip .cache/release-<version>/venv (this interpreter)
    venv site-packages/_kvxferd_deps.pth -> this venv's site-packages (its dependencies:
        no network, seconds; .pth files there are not run, so main's editable kvxferd is
        not on the old venv's path)
    venv python -m pip install --no-deps --no-build-isolation src  (pip and setuptools
        come from this venv through that path)
    venv/bin/kvxferd --version  must print ``kvxferd <version>``

A cache whose ``venv/.built`` names the commit is reused as is. Run the old release with
:func:`clean_env` (no PYTHONPATH: it would put this tree's kvxferd first) and a working
directory outside the repository (``python -m`` puts the working directory first).

Command line (``make prev-release``): build it and print one JSON line
``{"version", "commit", "python", "kvxferd"}``; exit 1 (with the reason) when it cannot
be built, e.g. a shallow clone without the commit (``git fetch --unshallow``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
# KVXFERD_RELEASE_ROOT: the checkout whose git history and .cache to use (tests/mutants.py
# runs tests in copies of this tree, which have neither .git nor .cache).
CHECKOUT = Path(os.environ.get("KVXFERD_RELEASE_ROOT") or ROOT)
CACHE = CHECKOUT / ".cache"
BUILD_TIMEOUT_S = 300.0  # pip building one pure-Python wheel: seconds in practice

_RELEASE = re.compile(r"^## \[?(\d+\.\d+\.\d+)\]?", re.M)
_COMMIT = re.compile(r"^Commit: (unreleased|[0-9a-f]{40})\s*$", re.M)


class NotBuildable(Exception):
    """The previous release cannot be built here; the message says why and what to do."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str  # 40 hex digits, or "unreleased"


@dataclass(frozen=True)
class Built:
    """A release installed in its own venv."""

    version: str
    commit: str
    root: Path  # .cache/release-<version>
    python: Path  # its venv's interpreter
    kvxferd: Path  # its venv's console script


def releases(text: str | None = None) -> list[Release]:
    """Every release CHANGELOG.md names, newest first, each with its commit line."""
    text = CHANGELOG.read_text(encoding="utf-8") if text is None else text
    heads = list(_RELEASE.finditer(text))
    out = []
    for i, h in enumerate(heads):
        body = text[h.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        commit = _COMMIT.search(body)
        if commit is None:
            raise NotBuildable(f"CHANGELOG.md: release {h.group(1)} has no `Commit:` line")
        out.append(Release(h.group(1), commit.group(1)))
    return out


def previous(text: str | None = None) -> Release:
    """The newest release before the current one (the first with a commit after the first)."""
    rels = releases(text)
    for r in rels[1:]:
        if r.commit != "unreleased":
            return r
    raise NotBuildable("CHANGELOG.md names no earlier release with a commit")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without what would make the old venv import another kvxferd."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    return {**env, **(extra or {})}


def _git(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", "-C", str(CHECKOUT), *args], capture_output=True, timeout=timeout, check=False
    )


def _has_commit(commit: str) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _version_of(kvxferd: Path, cwd: Path) -> str:
    run = subprocess.run(
        [str(kvxferd), "--version"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=cwd,
        timeout=60,
        check=False,
    )
    return run.stdout.strip() or run.stderr.strip()


def build(release: Release | None = None) -> Built:
    """The previous release (or ``release``) in its venv, built now or found in the cache.

    One process builds at a time (a lock file beside the cache dir: test files running in
    parallel ask together); the others wait for it and find the build done.
    """
    rel = release or previous()
    if rel.commit == "unreleased":
        raise NotBuildable(f"release {rel.version} is not cut yet")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"release-{rel.version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build(rel)


def _build(rel: Release) -> Built:
    root = CACHE / f"release-{rel.version}"
    venv = root / "venv"
    python = venv / "bin" / "python"
    kvxferd = venv / "bin" / "kvxferd"
    stamp = venv / ".built"
    built = Built(rel.version, rel.commit, root, python, kvxferd)
    if stamp.is_file() and stamp.read_text().strip() == rel.commit and kvxferd.is_file():
        return built
    if not _has_commit(rel.commit):
        raise NotBuildable(
            f"commit {rel.commit} of release {rel.version} is not in this clone (a shallow "
            "clone?): run `git fetch --unshallow` (or fetch that commit), then "
            "`make prev-release`"
        )
    shutil.rmtree(root, ignore_errors=True)
    src = root / "src"
    src.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(CHECKOUT), "archive", "--format=tar", rel.commit],
        stdout=subprocess.PIPE,
    )
    untar = subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, timeout=120)
    if archive.wait(timeout=120) != 0 or untar.returncode != 0:
        raise NotBuildable(f"git archive {rel.commit} failed")
    make_venv = [sys.executable, "-m", "venv", "--without-pip", str(venv)]
    subprocess.run(make_venv, check=True, timeout=120, env=clean_env())
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env=clean_env(),
        ).stdout.strip()
    )
    deps = Path(sysconfig.get_paths()["purelib"])  # this venv's: torch, nixl, zmq, pip...
    (site / "_kvxferd_deps.pth").write_text(f"{deps}\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env=clean_env(),
        cwd=root,
    )
    if install.returncode != 0:
        raise NotBuildable(
            f"pip install of release {rel.version} failed:\n{install.stderr[-2000:]}"
        )
    said = _version_of(kvxferd, root)
    if not said.startswith(f"kvxferd {rel.version}"):
        raise NotBuildable(f"{kvxferd} --version says {said!r}, not kvxferd {rel.version}")
    stamp.write_text(rel.commit + "\n")
    return built


def main() -> int:
    try:
        b = build()
    except NotBuildable as e:
        print(f"prev-release: {e}", file=sys.stderr)
        return 1
    said = _version_of(b.kvxferd, b.root)
    print(
        json.dumps(
            {
                "version": b.version,
                "commit": b.commit,
                "python": str(b.python),
                "kvxferd": str(b.kvxferd),
                "says": said,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
