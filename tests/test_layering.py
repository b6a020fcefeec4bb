"""kvxferd's imports point one way: the core never imports the service, nothing imports an integration.

Read from the sources (AST), no module is imported: every ``import`` and
``from ... import`` counts, inside functions and ``TYPE_CHECKING`` blocks too
(the import circle check leaves ``TYPE_CHECKING`` blocks out: they never run).
The service shell reads the transfer core only through its views
(kvxferd/transfer/views.py): no module of kvxferd/service/ reads a private
attribute of anything but itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvxferd"

TOOLS = ("kvxferd.bench", "kvxferd.faults", "kvxferd.cli", "kvxferd.demo")
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
        "configuration, errors, stats, auth, endpoints, logs and the launcher are used by every side",
    ),
)
SHARED = ("config.py", "errors.py", "stats.py", "auth.py", "endpoints.py", "logs.py", "launch.py")
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


NESTED = sorted(
    p.parent.relative_to(PACKAGE).as_posix()
    for sub in SUBPACKAGES
    for p in (PACKAGE / sub).glob("*/__init__.py")
)


@pytest.mark.parametrize("nested", NESTED)
def test_each_nested_package_draws_its_modules(nested: str) -> None:
    """A package inside a subpackage (transfer/sender/) names each of its modules in its
    __init__ docstring, one line each; it may re-export their public names."""
    doc = ast.get_docstring(ast.parse((PACKAGE / nested / "__init__.py").read_text())) or ""
    drawn = set(re.findall(r"^\s+(\w+\.py)\s", doc, flags=re.M))
    present = {p.name for p in (PACKAGE / nested).glob("*.py")} - {"__init__.py"}
    assert drawn == present, (
        f"kvxferd/{nested}/__init__.py draws {sorted(drawn)}, has {sorted(present)}"
    )


# -- the service reads the core through its views ----------------------------------------------


def private_reads(source: str, filename: str = "<source>") -> Iterator[tuple[int, str]]:
    """(line, expression) of every read of a private attribute of something other than
    ``self``/``cls`` (``snd._lock``, ``getattr(dp, "_closed")``); attributes of modules from
    outside kvxferd (``os._exit``) are not the core's and do not count."""
    tree = ast.parse(source, filename)
    foreign = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if not alias.name.startswith("kvxferd")
    }

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", *foreign):
                continue
            yield node.lineno, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            yield node.lineno, ast.unparse(node)


def test_the_private_read_scan_sees_one() -> None:
    """The scan flags a core lock taken, a private table read and a private getattr, and lets
    ``self._x``, dunders and ``os._exit`` pass, so the rule below can fail."""
    source = (
        "import os\n"
        "def f(self, snd, dp):\n"
        "    with snd._lock:\n"
        "        n = len(self.sender._sessions)\n"
        "    closed = getattr(dp, '_closed', False)\n"
        "    os._exit(1)\n"
        "    return self._x, snd.__class__\n"
    )
    assert [expr for _, expr in sorted(private_reads(source))] == [
        "snd._lock",
        "self.sender._sessions",
        "getattr(dp, '_closed', False)",
    ]


def test_the_service_reads_no_private_attribute_of_the_core() -> None:
    """No module of kvxferd/service/ reads a private attribute of anything but itself: it
    formats the views the core objects take (``view()``), and never takes their locks."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} reads {expr}"
        for path in sorted((PACKAGE / "service").rglob("*.py"))
        for line, expr in private_reads(path.read_text(), str(path))
    ]
    assert not found, (
        "the service reads the core only through its views (kvxferd/transfer/views.py):\n"
        + "\n".join(found)
    )


# -- the shared top level sits below the transfer core; no import circle -------------------------


def test_the_shared_modules_import_nothing_of_the_transfer_core() -> None:
    """config, errors, stats, auth, endpoints, logs and launch import nothing of kvxferd.transfer,
    not even inside a function: the transfer core is built on them."""
    bad = violations(files_of("shared"), ("kvxferd.transfer",))
    assert not bad, "the shared modules sit below the transfer core:\n" + "\n".join(bad)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports that never run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports at run time: line}, among ``sources``
    ({dotted module name: (source, is a package __init__)}), function-level imports included."""
    graph: dict[str, dict[str, int]] = {}
    for name, (source, is_package) in sources.items():
        tree = ast.parse(source, name)
        skip = _type_checking_only(tree)
        package = name.split(".") if is_package else name.split(".")[:-1]
        edges = graph.setdefault(name, {})
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package[: len(package) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
            for target in targets:
                while target and target not in sources:  # a.b.NAME -> the module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import circle of ``graph`` as [a, b, ..., a], or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_cycle_scan_sees_a_circle_hidden_in_a_function() -> None:
    """A circle closed by a function-level import is found; one through TYPE_CHECKING is not."""
    sources = {
        "p.a": ("def f():\n    from p.b import g\n", False),
        "p.b": ("from p.a import f\n", False),
        "p.c": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.d import x\n",
            False,
        ),
        "p.d": ("import p.c\n", False),
    }
    assert find_cycle(import_graph(sources)) == ["p.a", "p.b", "p.a"]
    del sources["p.a"], sources["p.b"]
    assert find_cycle(import_graph(sources)) == []


def test_the_product_has_no_import_circle() -> None:
    """No kvxferd module imports, through any chain of imports run at import or call time,
    a module that imports it back."""
    sources = {
        _module_name(path): (path.read_text(), path.name == "__init__.py")
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    graph = import_graph(sources)
    cycle = find_cycle(graph)
    where = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in pairwise(cycle)]
    assert not cycle, "an import circle:\n" + "\n".join(where)


# A class that outgrows this is a module's worth of state in one object: split it by state
# (a table with no lock of its own, a thread with a named owner), as transfer/sender/ does.
MAX_CLASS_LINES = 420


def _class_sizes() -> list[tuple[int, str]]:
    sizes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                sizes.append((lines, f"{path.relative_to(PACKAGE.parent)}:{node.name}"))
    return sorted(sizes, reverse=True)


def test_the_size_scan_sees_every_class() -> None:
    """The scan finds the big classes of the core (it cannot pass by finding nothing)."""
    names = {name for _, name in _class_sizes()}
    assert {"kvxferd/transfer/sender/api.py:Sender", "kvxferd/engine/gateway.py:Gateway"} <= names


def test_no_class_outgrows_a_module() -> None:
    """No class in kvxferd/ is over about 400 lines."""
    big = [f"{name}: {lines} lines" for lines, name in _class_sizes() if lines > MAX_CLASS_LINES]
    assert not big, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(big)
