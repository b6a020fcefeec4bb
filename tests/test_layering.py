"""kvxferd's imports point one way: the core never imports the service, nothing imports an integration.

Read from the sources (AST), no module is imported: every ``import`` and
``from ... import`` counts, inside functions and ``TYPE_CHECKING`` blocks too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvxferd"

TOOLS = ("kvxferd.bench", "kvxferd.faults", "kvxferd.cli")
# (which modules, what they must not import, why)
RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "transfer",
        ("kvxferd.service", "kvxferd.engine", *TOOLS, "kvxferd.integrations"),
        "the transfer core sits at the bottom: sessions and planes, no daemon, engine API or tool",
    ),
    (
        "engine",
        ("kvxferd.service", *TOOLS, "kvxferd.integrations"),
        "the engine side runs inside engines too: it must not pull in the daemon's shell",
    ),
    (
        "discovery",
        ("kvxferd.service", "kvxferd.engine", *TOOLS, "kvxferd.integrations"),
        "the receiver (transfer core) imports discovery's events: discovery sits as low as it",
    ),
    (
        "shared",
        ("kvxferd.service", "kvxferd.engine", *TOOLS, "kvxferd.integrations"),
        "configuration, errors, stats, auth, endpoints and logs are used by every side",
    ),
)
SHARED = ("config.py", "errors.py", "stats.py", "auth.py", "endpoints.py", "logs.py")
SUBPACKAGES = ("transfer", "engine", "service")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything a source file imports, ``from a import b`` as a and a.b."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def files_of(which: str) -> list[Path]:
    if which == "shared":
        return [PACKAGE / name for name in SHARED]
    return sorted((PACKAGE / which).rglob("*.py"))


def violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in paths:
        for line, name in imported(path):
            for bad in forbidden:
                if name == bad or name.startswith(bad + "."):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return sorted(set(found))


def test_the_scan_sees_imports_across_the_subpackages() -> None:
    """The scanner finds the daemon importing the sender and the gateway, so the rules below can fail."""
    names = {name for _, name in imported(PACKAGE / "service" / "daemon.py")}
    assert "kvxferd.transfer.sender" in names and "kvxferd.engine.gateway" in names


@pytest.mark.parametrize("which, forbidden, why", RULES, ids=[r[0] for r in RULES])
def test_imports_point_one_way(which: str, forbidden: tuple[str, ...], why: str) -> None:
    """No module of the transfer core, discovery, the engine side or the shared top level imports a layer above it."""
    paths = files_of(which)
    assert paths, f"no modules found for {which}"
    bad = violations(paths, forbidden)
    assert not bad, f"{why}:\n" + "\n".join(bad)


def test_nothing_outside_an_integration_imports_it() -> None:
    """No module of kvxferd outside kvxferd/integrations/ imports kvxferd.integrations."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if "integrations" not in p.parts]
    bad = violations(outside, ("kvxferd.integrations",))
    assert not bad, "integrations plug into kvxferd, never the reverse:\n" + "\n".join(bad)


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_subpackage_draws_its_modules_and_imports_nothing(sub: str) -> None:
    """A subpackage's __init__ docstring names each of its modules, one line each, and imports nothing."""
    init = PACKAGE / sub / "__init__.py"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree) or ""
    drawn = set(re.findall(r"^\s+(\w+\.py)\s", doc, flags=re.M))
    present = {p.name for p in (PACKAGE / sub).glob("*.py")} - {"__init__.py"}
    assert drawn == present, (
        f"kvxferd/{sub}/__init__.py draws {sorted(drawn)}, has {sorted(present)}"
    )
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
