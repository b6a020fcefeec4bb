"""The shipped monitoring (deploy/prometheus, deploy/grafana, deploy/k8s/monitoring) reads what kvxferd exports.

* **Rules** (deploy/prometheus/kvxferd-rules.yml): the file against a JSON schema of
  Prometheus rule files (tests/schemas/prometheus-rules.schema.json); each alert with a
  ``for``, a ``severity`` label, ``summary``, ``description`` and a ``runbook`` annotation
  naming a section of docs/operations.md; the runbook's alert table and the alerts are
  the same set (each row starts with the names of its alerts); thresholds taken from
  deadlines equal the shipped defaults. With ``promtool`` on PATH, ``promtool check
  rules`` and the rule unit tests (deploy/prometheus/kvxferd-rules.test.yml).
* **Dashboard** (deploy/grafana/kvxferd-dashboard.json): against a JSON schema of the
  parts it uses (tests/schemas/grafana-dashboard.schema.json), unique panel ids, no two
  panels overlapping on the grid, the ``datasource``, ``role`` and ``instance``
  variables, every query filtered by ``$instance``, and a panel for each subject.
* **Names**: every metric name in a rule or a query is a family /metrics exports (the
  sample names a sender's and a receiver's collector produce from the stats catalogue,
  kvxferd/stats.py, and service/metrics.py), or a recording rule of the file; every
  label it matches or groups by exists on that family (or is a target label Prometheus
  adds: ``job``, ``instance``); a value it matches against a label with a fixed set of
  values is one of them. The families another change of the same release adds
  (:data:`ARRIVING`) are taken with their declared labels until the catalogue has them.
* **Kubernetes**: deploy/k8s/monitoring/prometheusrule.yaml is the rules file as a
  PrometheusRule, text for text (``python tests/test_monitoring.py`` writes it), and the
  PodMonitor selects both roles' pods on their probe port.

``test_check_catches`` breaks a copy of each file the way each check guards against and
requires the check to fail.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema not installed (pip install jsonschema)"
)

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "kvxferd-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvxferd-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvxferd-dashboard.json"
PROMETHEUSRULE = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
PODMONITOR = ROOT / "deploy" / "k8s" / "monitoring" / "podmonitor.yaml"
RUNBOOK = ROOT / "docs" / "operations.md"
SCHEMAS = ROOT / "tests" / "schemas"
ALERT_SECTION = "### What to alert on, and what to do"

# Families another change of this release adds (named in its contract), with their labels:
# taken as they are declared only while the catalogue does not export them yet.
ARRIVING: dict[str, frozenset[str]] = {
    "kvxferd_link_gbps": frozenset({"peer"}),
    "kvxferd_link_probes_total": frozenset({"result"}),
    "kvxferd_handover_requests_total": frozenset({"result"}),
}
TARGET_LABELS = frozenset({"job", "instance"})  # added by Prometheus at the scrape
# Labels whose values are not a fixed set (peers, worker indices, the version, the buckets).
OPEN_LABELS = frozenset({"peer", "worker", "version", "le"})
SEVERITIES = frozenset({"critical", "warning", "info"})
# PromQL functions and aggregations the files may use (a misspelled one is an error).
FUNCTIONS = frozenset(
    {
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "topk",
        "bottomk",
        "quantile",
        "rate",
        "irate",
        "increase",
        "delta",
        "changes",
        "resets",
        "histogram_quantile",
        "max_over_time",
        "min_over_time",
        "avg_over_time",
        "absent",
        "clamp_min",
        "clamp_max",
        "abs",
        "vector",
        "time",
    }
)
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


# -- what kvxferd exports ----------------------------------------------------------------------


@dataclass
class Family:
    """A sample name /metrics exports: its labels and, where the set is fixed, their values."""

    labels: dict[str, set[str] | None] = field(default_factory=dict)  # None: any value


Catalogue = dict[str, Family]


@dataclass(frozen=True)
class _Fixed:
    """A probe whose every snapshot is the one it was given."""

    snap: Any

    def snapshot(self) -> Any:
        return self.snap


def exported() -> Catalogue:
    """Each sample name a sender or receiver exports (with its engine gateway), and its labels.

    Built from the collectors /metrics serves, over a snapshot with every labelled table
    filled (a peer in each per-peer histogram, a worker, sessions); a family with no sample
    still gives its declared labels (any value); the families another change adds
    (:data:`ARRIVING`) join while missing.
    """
    from kvxferd.service.metrics import (
        GatewayReading,
        ReadinessCollector,
        Snapshot,
        SnapshotCollector,
    )
    from kvxferd.transfer.journal import PHASES, Histogram

    out: Catalogue = {}
    buckets = Histogram().cumulative()
    for role in ("sender", "receiver"):
        snap = Snapshot(
            role=role,
            stats={},
            sessions_by_state={"published" if role == "sender" else "requested": 1},
            queue_depths=[0],
            writes_in_flight=0,
            peers=0,
            histograms={(phase, "tcp://127.0.0.1:5555"): buckets for phase in PHASES},
            gateway=GatewayReading(stats={}, handles=0, calls_in_flight=0),
        )

        families = [
            *SnapshotCollector(_Fixed(snap), {"version": "0"}).collect(),
            *ReadinessCollector(lambda: (True, [])).collect(),
        ]
        for fam in families:
            if fam.samples:
                _add_samples(out, fam.samples)
            else:  # e.g. a per-link gauge with no link yet: its declared labels, any value
                _add_declared(out, fam)
    return _finish(out)


# The sample names of a family of each type (prometheus_client writes counters with _total).
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}


def _add_declared(out: Catalogue, fam: Any) -> None:
    labels = getattr(fam, "_labelnames", None)
    assert labels is not None, f"{fam.name}: no sample and no declared labels"
    for suffix in _SUFFIXES.get(fam.type, ("",)):
        entry = out.setdefault(fam.name + suffix, Family())
        for label in (*labels, "le") if suffix == "_bucket" else labels:
            entry.labels[label] = None


def _add_samples(out: Catalogue, samples: Any) -> None:
    for s in samples:
        entry = out.setdefault(s.name, Family())
        for label, value in s.labels.items():
            values = entry.labels.setdefault(label, set())
            if values is not None:
                values.add(value)


def _finish(out: Catalogue) -> Catalogue:
    """Open the labels whose values are not a fixed set; add the families still arriving."""
    out["kvxferd_sessions"].labels = {"state": None}  # whatever states the table holds
    for f in out.values():
        for label in OPEN_LABELS & f.labels.keys():
            f.labels[label] = None
    for name, arriving in ARRIVING.items():
        out.setdefault(name, Family({label: None for label in arriving}))
    return out


def scraped(texts: list[str]) -> Catalogue:
    """The catalogue of real /metrics bodies (Prometheus text), as :func:`exported` makes it."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Catalogue = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            _add_samples(out, fam.samples)
    return _finish(out)


# -- reading PromQL ----------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:ms|[smhdwy])?(?:\d+(?:ms|[smhdwy]))*)
  | (?P<var>\$\{?\w+\}?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}\[\]@])
    """,
    re.X,
)


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    grouping: list[str] = field(default_factory=list)  # labels of by/without/on/ignoring/group_*
    functions: list[str] = field(default_factory=list)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def parse_promql(expr: str) -> Query:
    """The selectors, grouping labels and functions of one PromQL expression.

    Enough PromQL for rule files and dashboards: a name followed by ``(`` is a function or
    aggregation, a grouping keyword's parenthesised list is labels, a ``[...]`` range is
    skipped, any other name is a metric selector with its optional ``{matchers}``.
    """
    toks, q, i = _tokens(expr), Query(), 0

    def at(j: int) -> str:
        return toks[j][1] if j < len(toks) else ""

    while i < len(toks):
        kind, text = toks[i]
        if text == "[":
            while i < len(toks) and toks[i][1] != "]":
                i += 1
            i += 1
        elif text == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        elif kind != "ident":
            i += 1
        elif text in GROUPING:
            i += 1
            if at(i) == "(":
                i += 1
                while at(i) != ")":
                    if toks[i][0] == "ident":
                        q.grouping.append(toks[i][1])
                    elif toks[i][1] != ",":
                        raise ValueError(f"{text} (...) holds {toks[i][1]!r} in {expr!r}")
                    i += 1
                i += 1
        elif text in KEYWORDS:
            i += 1
        elif text in FUNCTIONS or at(i + 1) == "(":
            q.functions.append(text)
            i += 1
        else:
            i += 1
            matchers = []
            if at(i) == "{":
                i += 1
                while at(i) != "}":
                    label, op, value = toks[i : i + 3]
                    if (
                        label[0] != "ident"
                        or op[1] not in ("=", "!=", "=~", "!~")
                        or value[0] != "str"
                    ):
                        raise ValueError(f"bad matcher {label[1]}{op[1]}{value[1]} in {expr!r}")
                    matchers.append((label[1], op[1], ast.literal_eval(value[1])))
                    i += 3
                    if at(i) == ",":
                        i += 1
                i += 1
            q.selectors.append(Selector(text, tuple(matchers)))
    return q


_ALTERNATION = re.compile(r"[a-z0-9_]+(\|[a-z0-9_]+)*")


def check_expr(expr: str, where: str, families: Catalogue) -> list[str]:
    """What in ``expr`` is not exported: unknown families, labels, label values, functions."""
    try:
        q = parse_promql(expr)
    except ValueError as e:
        return [f"{where}: {e}"]
    problems = []
    if not q.selectors:
        problems.append(f"{where}: reads no kvxferd family")
    for fn in q.functions:
        if fn not in FUNCTIONS:
            problems.append(f"{where}: unknown function {fn}")
    seen: set[str] = set(TARGET_LABELS)
    for sel in q.selectors:
        fam = families.get(sel.name)
        if fam is None:
            problems.append(f"{where}: {sel.name} is not a family kvxferd exports")
            continue
        seen |= fam.labels.keys()
        for label, op, value in sel.matchers:
            if label in TARGET_LABELS:
                continue
            if label not in fam.labels:
                problems.append(f"{where}: {sel.name} has no label {label!r}")
                continue
            values = fam.labels[label]
            if values is None or "$" in value:
                continue
            if op in ("=", "!="):
                wanted = [value]
            elif _ALTERNATION.fullmatch(value):
                wanted = value.split("|")
            else:
                continue
            for v in wanted:
                if v not in values:
                    problems.append(f"{where}: {sel.name}{{{label}}} never takes the value {v!r}")
    for label in q.grouping:
        if label not in seen:
            problems.append(f"{where}: groups by {label!r}, a label none of its families has")
    return problems


# -- the rules file ----------------------------------------------------------------------------


def load_rules(text: str | None = None) -> dict[str, Any]:
    data = yaml.safe_load(RULES.read_text() if text is None else text)
    assert isinstance(data, dict)
    return data


def rules_of(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in data.get("groups", []):
        yield from group.get("rules", [])


def with_records(data: dict[str, Any], families: Catalogue) -> Catalogue:
    """``families`` plus each recording rule's series: the labels its aggregations keep."""
    out = dict(families)
    for rule in rules_of(data):
        if "record" in rule:
            q = parse_promql(rule["expr"])
            kept = set(q.grouping) - {"le"} | set(rule.get("labels", {}))
            out[rule["record"]] = Family({label: None for label in kept})
    return out


def schema(name: str) -> dict[str, Any]:
    loaded = json.loads((SCHEMAS / name).read_text())
    assert isinstance(loaded, dict)
    return loaded


def check_rules_schema(data: dict[str, Any]) -> None:
    """The file is a Prometheus rule file (the JSON schema), with unique group and alert names."""
    jsonschema.validate(data, schema("prometheus-rules.schema.json"))
    groups = [g["name"] for g in data["groups"]]
    assert len(groups) == len(set(groups)), f"group names repeat: {groups}"
    alerts = [r["alert"] for r in rules_of(data) if "alert" in r]
    assert len(alerts) == len(set(alerts)), f"alert names repeat: {sorted(alerts)}"


def check_rules_names(data: dict[str, Any], families: Catalogue | None = None) -> None:
    """Every family, label and label value a rule reads is one kvxferd exports."""
    families = with_records(data, exported() if families is None else families)
    problems = []
    for rule in rules_of(data):
        name = rule.get("alert") or rule.get("record")
        problems += check_expr(rule["expr"], str(name), families)
    assert not problems, "\n".join(problems)


def slugs(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def check_alert_policy(data: dict[str, Any], runbook: str) -> None:
    """Each alert has a ``for``, a severity, a summary, a description and a runbook section."""
    anchors = slugs(runbook)
    problems = []
    for rule in rules_of(data):
        if "alert" not in rule:
            continue
        name = rule["alert"]
        if not re.fullmatch(r"Kvxferd[A-Z][A-Za-z]+", name):
            problems.append(f"{name}: alert names are Kvxferd<CamelCase>")
        if "for" not in rule:
            problems.append(f"{name}: no `for`")
        if rule.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity not one of {sorted(SEVERITIES)}")
        notes = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            if not notes.get(key):
                problems.append(f"{name}: no {key} annotation")
        link = notes.get("runbook", "")
        page, _, anchor = link.partition("#")
        if page != "docs/operations.md" or anchor not in anchors:
            problems.append(f"{name}: runbook {link!r} is not a section of docs/operations.md")
    assert not problems, "\n".join(problems)


def runbook_alerts(runbook: str) -> list[tuple[str, list[str]]]:
    """Each row of the runbook's alert table: (the row, the alert names it starts with)."""
    start = runbook.index(ALERT_SECTION)
    end = min(
        (i for i in (runbook.find("\n## ", start), runbook.find("\n### ", start + 1)) if i > 0),
        default=len(runbook),
    )
    rows = [line for line in runbook[start:end].splitlines() if line.startswith("| ")]
    out = []
    for row in rows[1:]:  # the header
        head = re.match(r"\| ((?:`Kvxferd\w+`(?:, )?)+):", row)
        out.append((row, re.findall(r"`(Kvxferd\w+)`", head.group(1)) if head else []))
    return out


def check_runbook_table(data: dict[str, Any], runbook: str) -> None:
    """Every row of the runbook's alert table names its alerts, and the names are the rules'."""
    rows = runbook_alerts(runbook)
    assert len(rows) >= 15, f"found {len(rows)} rows under {ALERT_SECTION!r}: is it the table?"
    problems = [
        f"row names no alert (`KvxferdX`: ...): {row[:70]}" for row, names in rows if not names
    ]
    in_table = [n for _, names in rows for n in names]
    alerts = {r["alert"] for r in rules_of(data) if "alert" in r}
    problems += [f"{n}: in the runbook table twice" for n in set(in_table) if in_table.count(n) > 1]
    problems += [f"{n}: in the runbook table, no such rule" for n in sorted(set(in_table) - alerts)]
    problems += [
        f"{n}: a rule the runbook table does not name" for n in sorted(alerts - set(in_table))
    ]
    assert not problems, "\n".join(problems)


MONITORING_SECTION = "## Monitoring: rules and dashboard"


def check_monitoring_doc(data: dict[str, Any], runbook: str) -> None:
    """docs/operations.md's Monitoring table lists every alert with its severity and ``for``."""
    section = runbook[runbook.index(MONITORING_SECTION) :]
    end = section.find("\n## ", 1)
    rows = re.findall(
        r"^\| `(Kvxferd\w+)` \| (\w+) \| (\w+) \|", section[: end if end > 0 else None], re.M
    )
    doc = {name: (severity, for_) for name, severity, for_ in rows}
    rules = {
        r["alert"]: (r.get("labels", {}).get("severity"), r.get("for"))
        for r in rules_of(data)
        if "alert" in r
    }
    assert len(rows) == len(doc), "an alert is listed twice"
    assert doc == rules, {
        n: (doc.get(n), rules.get(n))
        for n in doc.keys() | rules.keys()
        if doc.get(n) != rules.get(n)
    }


def _threshold(data: dict[str, Any], alert: str, family: str) -> float:
    (rule,) = [r for r in rules_of(data) if r.get("alert") == alert]
    m = re.search(rf"{family} > ([0-9.]+)", rule["expr"])
    assert m, f"{alert}: no `{family} > N` in {rule['expr']!r}"
    return float(m.group(1))


def check_thresholds(data: dict[str, Any]) -> None:
    """Thresholds the runbook derives from settings equal the shipped defaults."""
    from kvxferd.config import Deadlines
    from kvxferd.engine.handles import MAX_HANDLES

    d = Deadlines()
    oldest = "kvxferd_oldest_in_flight_seconds"
    rx = (d.kv_transfer_timeout_ms + d.cancel_fence_ms) / 1000 + 30
    tx = (d.publish_ttl_ms + d.xfer_stall_timeout_ms) / 1000
    got = _threshold(data, "KvxferdReceiverFetchPastDeadlines", oldest)
    assert got == rx, f"receiver: {got} s, kv_transfer_timeout_ms + cancel_fence_ms + 30 s = {rx}"
    got = _threshold(data, "KvxferdSenderSessionPastDeadlines", oldest)
    assert got == tx, f"sender: {got} s, publish_ttl_ms + xfer_stall_timeout_ms = {tx}"
    got = _threshold(data, "KvxferdGatewaySaturated", "kvxferd_gateway_handles")
    assert got == int(0.9 * MAX_HANDLES), f"gateway: {got} handles, 90% of {MAX_HANDLES}"


# -- the dashboard -----------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return list(dash.get("panels", []))


def check_dashboard_schema(dash: dict[str, Any]) -> None:
    """The JSON schema of the parts used, unique panel ids, and no two panels on one cell."""
    jsonschema.validate(dash, schema("grafana-dashboard.schema.json"))
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} runs past the 24 columns"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                other = cells.setdefault((x, y), p["title"])
                assert other == p["title"], (
                    f"panels {other!r} and {p['title']!r} overlap at {x},{y}"
                )


def check_dashboard_variables(dash: dict[str, Any]) -> None:
    """``datasource`` (Prometheus), ``role`` and ``instance`` variables; every query uses them."""
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables.get("datasource", {}).get("type") == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("role", "instance"):
        assert variables.get(name, {}).get("type") == "query", f"no query variable {name!r}"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    assert "$role" in variables["instance"]["query"]["query"], "instance does not follow role"
    problems = []
    for p in panels(dash):
        if p["type"] == "row":
            continue
        if p["datasource"]["uid"] != "${datasource}":
            problems.append(f"{p['title']}: datasource is not ${{datasource}}")
        for t in p["targets"]:
            if t["datasource"]["uid"] != "${datasource}":
                problems.append(f"{p['title']}: target {t['refId']} not on ${{datasource}}")
            for sel in parse_promql(t["expr"]).selectors:
                if ("instance", "=~", "$instance") not in sel.matchers:
                    problems.append(f"{p['title']}: {sel.name} not filtered by $instance")
    assert not problems, "\n".join(problems)


_LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")


def check_dashboard_names(dash: dict[str, Any], families: Catalogue | None = None) -> None:
    """Every family, label and value a panel or a variable reads is one kvxferd exports."""
    families = exported() if families is None else families
    problems = []
    for p in panels(dash):
        for t in p.get("targets", []):
            problems += check_expr(t["expr"], f"panel {p['title']!r} {t['refId']}", families)
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = _LABEL_VALUES.fullmatch(v["query"]["query"])
        assert m, f"variable {v['name']}: not label_values(selector, label)"
        problems += check_expr(m.group(1), f"variable {v['name']}", families)
        for sel in parse_promql(m.group(1)).selectors:
            if m.group(2) not in families.get(sel.name, Family()).labels.keys() | TARGET_LABELS:
                problems.append(f"variable {v['name']}: {sel.name} has no label {m.group(2)!r}")
    assert not problems, "\n".join(problems)


# What the dashboard must show: a family for each subject the runbook asks about.
SUBJECTS: dict[str, tuple[str, ...]] = {
    "throughput": ("kvxferd_bytes_total",),
    "per-peer latency": (
        "kvxferd_peer_end_to_end_seconds_bucket",
        "kvxferd_peer_transfer_seconds_bucket",
        "kvxferd_peer_post_seconds_bucket",
    ),
    "in flight": ("kvxferd_transfers_in_flight", "kvxferd_oldest_in_flight_seconds"),
    "in doubt": ("kvxferd_in_doubt_untracked_total",),
    "readiness": ("kvxferd_ready", "kvxferd_not_ready"),
    "drains": ("kvxferd_drain_dropped_never_fetched_total", "kvxferd_drain_dropped_cut_total"),
    "links": ("kvxferd_link_gbps", "kvxferd_peer_cache_entries"),
    "errors": ("kvxferd_rejections_total", "kvxferd_thread_errors_total"),
}


def check_dashboard_subjects(dash: dict[str, Any]) -> None:
    """A panel reads each subject's families."""
    used = {
        sel.name
        for p in panels(dash)
        for t in p.get("targets", [])
        for sel in parse_promql(t["expr"]).selectors
    }
    missing = {s: [f for f in fams if f not in used] for s, fams in SUBJECTS.items()}
    assert not any(missing.values()), {s: m for s, m in missing.items() if m}


# -- Kubernetes --------------------------------------------------------------------------------

PROMETHEUSRULE_HEAD = """\
# Generated from deploy/prometheus/kvxferd-rules.yml by `python tests/test_monitoring.py`:
# edit that file, then run it (tests/test_monitoring.py checks the two are the same).
# The Prometheus Operator's form of the rules; its Prometheus must select this label set
# (ruleSelector), e.g. add `release: <your release>` through kustomize's `labels`.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvxferd
  labels:
    app.kubernetes.io/name: kvxferd
spec:
"""


def render_prometheusrule(rules_text: str) -> str:
    """The PrometheusRule holding the rules file's groups, the file's own text indented."""
    body = rules_text[rules_text.index("\ngroups:\n") + 1 :]
    lines = body.splitlines(keepends=True)
    return PROMETHEUSRULE_HEAD + "".join("  " + ln if ln.strip() else ln for ln in lines)


def check_prometheusrule(manifest: str, rules_text: str) -> None:
    """The manifest is the rules file rendered, and its spec parses to the same groups."""
    doc = yaml.safe_load(manifest)
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["spec"] == yaml.safe_load(rules_text), "PrometheusRule spec != the rules file"
    assert manifest == render_prometheusrule(rules_text), (
        "deploy/k8s/monitoring/prometheusrule.yaml is stale: run `python tests/test_monitoring.py`"
    )


def _pod_templates() -> dict[str, dict[str, Any]]:
    out = {}
    for role in ("sender", "receiver"):
        for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / f"{role}.yaml").read_text()):
            if doc and doc["kind"] == "StatefulSet":
                out[role] = doc["spec"]["template"]
    return out


def check_podmonitor(monitor: dict[str, Any], templates: dict[str, dict[str, Any]]) -> None:
    """The PodMonitor selects both roles' pods and scrapes /metrics on the daemon's probe port."""
    assert monitor["kind"] == "PodMonitor"
    want = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for role, template in templates.items():
        labels = template["metadata"]["labels"]
        assert want.items() <= labels.items(), f"{role} pods not selected: {labels}"
        spec = template["spec"]
        daemons = [
            c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "kvxferd"
        ]
        ports = {p["name"] for c in daemons for p in c.get("ports", [])}
        assert endpoint["port"] in ports, f"{role}: the daemon has no port {endpoint['port']!r}"


# -- the tests ---------------------------------------------------------------------------------


def test_rules_file_is_a_prometheus_rule_file() -> None:
    """The rules file validates against the JSON schema of Prometheus rule files."""
    check_rules_schema(load_rules())


def test_rules_read_only_exported_families_and_labels() -> None:
    """Every family, label and label value in a rule expression is one kvxferd exports."""
    check_rules_names(load_rules())


def test_every_alert_has_for_severity_and_runbook() -> None:
    """Each alert has ``for``, a severity label, summary/description and a runbook section."""
    check_alert_policy(load_rules(), RUNBOOK.read_text())


def test_runbook_alert_table_and_rules_are_the_same_alerts() -> None:
    """Each row of the runbook's alert table names its rules, and every rule is in a row."""
    check_runbook_table(load_rules(), RUNBOOK.read_text())


def test_monitoring_doc_lists_each_alert_with_its_severity() -> None:
    """The Monitoring section's table has every alert, its severity and ``for``, as the rules do."""
    check_monitoring_doc(load_rules(), RUNBOOK.read_text())


def test_thresholds_follow_the_default_deadlines() -> None:
    """Deadline-derived thresholds equal the defaults (kvxferd.config) they are computed from."""
    check_thresholds(load_rules())


def _promtool() -> str:
    """promtool on PATH, or the one `make promtool` put beside this venv's python."""
    beside = Path(sys.executable).with_name("promtool")
    tool = shutil.which("promtool") or (str(beside) if beside.is_file() else None)
    if tool is None:
        pytest.skip(
            "promtool not found: `make promtool` (unpacks it from Debian's prometheus package"
            " into .venv/bin), or put the promtool of a Prometheus release on PATH; the JSON"
            " schema and name checks still ran"
        )
    return tool


def test_promtool_check_rules() -> None:
    """``promtool check rules`` accepts the file (PromQL parses, templates render)."""
    out = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rule_unit_tests() -> None:
    """``promtool test rules``: the joins and windows fire on the series they are meant for, only."""
    out = subprocess.run(
        [_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "old, new",
    [
        ('kvxferd_not_ready{reason!="draining"} == 1', "kvxferd_not_ready == 1"),
        ('95 and on (job, instance) kvxferd_build_info{role="receiver"}', "95"),
        ("kvxferd_aux_slots) > 0", "kvxferd_aux_slots) >= 0"),
        ('{outcome!~"done|cancelled"}', '{outcome!="done"}'),
    ],
    ids=[
        "draining-alerts",
        "receiver-rule-any-role",
        "aux-rule-no-slots",
        "cancels-count-as-failures",
    ],
)
def test_promtool_rule_unit_tests_catch_a_broken_rule(old: str, new: str, tmp_path: Path) -> None:
    """The rule unit tests fail on a copy of the rules whose filter or join was loosened."""
    tool = _promtool()
    text = RULES.read_text()
    assert text.count(old) == 1, old
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    out = subprocess.run(
        [tool, "test", "rules", str(tmp_path / RULE_TESTS.name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0, out.stdout


def test_dashboard_matches_its_schema_without_overlaps() -> None:
    """The dashboard validates against the schema of the parts it uses; ids unique, no overlap."""
    check_dashboard_schema(load_dashboard())


def test_dashboard_variables_filter_every_query() -> None:
    """datasource, role and instance variables; every selector is filtered by $instance."""
    check_dashboard_variables(load_dashboard())


def test_dashboard_reads_only_exported_families_and_labels() -> None:
    """Every family, label and value in a panel query or a variable is one kvxferd exports."""
    check_dashboard_names(load_dashboard())


def test_dashboard_shows_each_subject() -> None:
    """Throughput, per-peer latency, in flight, in doubt, readiness, drains, links, errors."""
    check_dashboard_subjects(load_dashboard())


def test_prometheusrule_is_the_rules_file() -> None:
    """deploy/k8s/monitoring/prometheusrule.yaml is the rules file as a PrometheusRule."""
    check_prometheusrule(PROMETHEUSRULE.read_text(), RULES.read_text())


def test_podmonitor_scrapes_both_roles() -> None:
    """The PodMonitor selects the sender and receiver pods on the daemon's probe port."""
    check_podmonitor(yaml.safe_load(PODMONITOR.read_text()), _pod_templates())


def test_monitoring_kustomization_lists_both() -> None:
    """deploy/k8s/monitoring/kustomization.yaml applies the PodMonitor and the PrometheusRule."""
    kust = yaml.safe_load((PROMETHEUSRULE.parent / "kustomization.yaml").read_text())
    assert kust["namespace"] == "kvxferd"
    assert sorted(kust["resources"]) == ["podmonitor.yaml", "prometheusrule.yaml"]


def test_monitoring_kustomization_builds() -> None:
    """`kubectl kustomize deploy/k8s/monitoring` builds both, in namespace kvxferd, rules intact."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found (it builds kustomizations offline: kubectl kustomize)")
    out = subprocess.run(
        [kubectl, "kustomize", str(PROMETHEUSRULE.parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout) if d}
    assert docs.keys() == {"PodMonitor", "PrometheusRule"}
    assert all(d["metadata"]["namespace"] == "kvxferd" for d in docs.values())
    assert docs["PrometheusRule"]["spec"] == load_rules()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_real_daemon_pairs_metrics_serve_the_rules_and_the_dashboard() -> None:
    """A real sender and receiver move a request; their /metrics hold every family, label and
    value the rules and the dashboard read, and the same sample names the collectors make here."""
    from tests.test_daemon import DaemonProcess, Engines, http_get
    from tests.test_metrics import CALL_S, STARTUP_S, pair_env

    sock_dir = tempfile.mkdtemp(prefix="kmon")  # short: an ipc path must fit in sockaddr_un
    tx = DaemonProcess("sender", "tx", sock_dir, pair_env(), ["--listen", "tcp://127.0.0.1:0"])
    rx = DaemonProcess("receiver", "rx", sock_dir, pair_env(), [])
    engines = Engines()
    try:
        tx.wait_ready(STARTUP_S), rx.wait_ready(STARTUP_S)
        ct, _ = engines.client(tx)
        cr, _ = engines.client(rx)
        ct.publish("mon-1", [1], aux=b"x")
        out = cr.wait(cr.fetch("mon-1", tx.endpoint, [1]), CALL_S)
        assert out is not None and out.state == "done", out
        bodies = []
        for d in (tx, rx):
            status, body = http_get(d.probe_port, "/metrics")
            assert status == 200, body
            bodies.append(body)
        engines.close()
        for d in (tx, rx):  # a drained stop removes the pool's /dev/shm segment
            d.signal(signal.SIGTERM)
        for d in (tx, rx):
            assert d.wait_exit(CALL_S)[0] == 0, d.describe()
    finally:
        engines.close()
        tx.kill()
        rx.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)
    real = scraped(bodies)
    for name in ("kvxferd_peer_end_to_end_seconds_bucket", "kvxferd_peer_post_seconds_bucket"):
        assert "peer" in real[name].labels, f"{name}: no peer series after a transfer"
    check_rules_names(load_rules(), real)
    check_dashboard_names(load_dashboard(), real)
    made = exported()
    assert real.keys() == made.keys(), sorted(real.keys() ^ made.keys())
    for name, fam in real.items():
        assert fam.labels.keys() == made[name].labels.keys(), name


def test_arriving_families_are_declared_as_the_catalogue_has_them() -> None:
    """A family listed as arriving with another change, once exported, has the labels declared."""
    families = exported()
    for name, labels in ARRIVING.items():
        assert families[name].labels.keys() == labels, (name, families[name].labels.keys())


# -- each check can fail -----------------------------------------------------------------------


def _rules_edit(old: str, new: str) -> Callable[[], None]:
    def run() -> None:
        text = RULES.read_text()
        if text.count(old) != 1:  # not an AssertionError: a stale edit must not pass as caught
            raise LookupError(f"{old!r} is not in the rules file exactly once")
        data = load_rules(text.replace(old, new))
        check_rules_schema(data)
        check_rules_names(data)
        check_alert_policy(data, RUNBOOK.read_text())
        check_runbook_table(data, RUNBOOK.read_text())
        check_monitoring_doc(data, RUNBOOK.read_text())
        check_thresholds(data)

    return run


def _dash_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    def run() -> None:
        dash = copy.deepcopy(load_dashboard())
        change(dash)
        check_dashboard_schema(dash)
        check_dashboard_variables(dash)
        check_dashboard_names(dash)
        check_dashboard_subjects(dash)

    return run


def _panel(title: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def find(dash: dict[str, Any]) -> dict[str, Any]:
        (p,) = [p for p in dash["panels"] if p["title"] == title]
        return p

    return find


_THROUGHPUT = _panel("Throughput")
_OUTCOMES = _panel("Outcomes")


def _set_expr(
    find: Callable[[dict[str, Any]], dict[str, Any]], old: str, new: str
) -> Callable[[dict[str, Any]], None]:
    def change(dash: dict[str, Any]) -> None:
        t = find(dash)["targets"][0]
        if old not in t["expr"]:
            raise LookupError(f"{old!r} not in {t['expr']!r}")
        t["expr"] = t["expr"].replace(old, new)

    return change


BROKEN: dict[str, Callable[[], None]] = {
    "rules-misspelled-family": _rules_edit(
        "rate(kvxferd_writes_stalled_total[5m])", "rate(kvxferd_write_stalled_total[5m])"
    ),
    "rules-label-not-on-family": _rules_edit('{state="in_doubt"} > 0', '{reason="in_doubt"} > 0'),
    "rules-label-value-never-exported": _rules_edit(
        'kvxferd_aux_slots{state="free"}', 'kvxferd_aux_slots{state="quarantine"}'
    ),
    "rules-regex-value-never-exported": _rules_edit("unknown_message|", "unknown_msg|"),
    "rules-group-by-missing-label": _rules_edit(
        "sum by (job, instance, peer, le) (rate(kvxferd_peer_post",
        "sum by (job, instance, reason, le) (rate(kvxferd_peer_post",
    ),
    "rules-misspelled-function": _rules_edit(
        "rate(kvxferd_transport_fresh_paths_total", "rat(kvxferd_transport_fresh_paths_total"
    ),
    "rules-unknown-record": _rules_edit(
        "expr: instance:kvxferd_outcomes_failed:ratio_rate5m > 0.05",
        "expr: instance:kvxferd_outcome_failed:ratio_rate5m > 0.05",
    ),
    "rules-schema-unknown-key": _rules_edit(
        '{state="in_doubt"} > 0\n        for: 10m', '{state="in_doubt"} > 0\n        four: 10m'
    ),
    "rules-schema-bad-duration": _rules_edit("for: 15m", "for: 15 minutes"),
    "rules-alert-without-severity": _rules_edit(
        "          severity: info\n", "          level: info\n"
    ),
    "rules-alert-without-for": _rules_edit(
        "        expr: kvxferd_link_gbps < 5\n        for: 5m\n",
        "        expr: kvxferd_link_gbps < 5\n",
    ),
    "rules-runbook-not-a-section": _rules_edit(
        "#stopping-the-drain-and-what-it-dropped", "#stopping-the-drain"
    ),
    "rules-alert-not-in-runbook": _rules_edit(
        "alert: KvxferdPeersEvicted", "alert: KvxferdPeerEvicted"
    ),
    "rules-severity-not-as-documented": _rules_edit(
        'severity: critical\n        annotations:\n          summary: "kvxferd {{ $labels.instance }} met a bug"',
        'severity: warning\n        annotations:\n          summary: "kvxferd {{ $labels.instance }} met a bug"',
    ),
    "rules-threshold-drifted": _rules_edit(
        "kvxferd_oldest_in_flight_seconds > 95", "kvxferd_oldest_in_flight_seconds > 90"
    ),
    "dashboard-duplicate-panel-id": _dash_edit(
        lambda d: _OUTCOMES(d).update(id=_THROUGHPUT(d)["id"])
    ),
    "dashboard-overlap": _dash_edit(
        lambda d: _OUTCOMES(d)["gridPos"].update(y=_THROUGHPUT(d)["gridPos"]["y"], x=16)
    ),
    "dashboard-past-24-columns": _dash_edit(lambda d: _THROUGHPUT(d)["gridPos"].update(x=20)),
    "dashboard-schema-typo": _dash_edit(lambda d: _THROUGHPUT(d)["targets"][0].update(exp="x")),
    "dashboard-misspelled-family": _dash_edit(
        _set_expr(_THROUGHPUT, "kvxferd_bytes_total", "kvxferd_byte_total")
    ),
    "dashboard-label-not-on-family": _dash_edit(
        _set_expr(_OUTCOMES, "instance, outcome", "instance, result")
    ),
    "dashboard-query-without-instance": _dash_edit(
        _set_expr(_THROUGHPUT, 'instance=~"$instance"', 'job=~".+"')
    ),
    "dashboard-fixed-datasource": _dash_edit(
        lambda d: _THROUGHPUT(d)["datasource"].update(uid="prometheus")
    ),
    "dashboard-no-role-variable": _dash_edit(lambda d: d["templating"]["list"].pop(1)),
    "dashboard-variable-label-missing": _dash_edit(
        lambda d: d["templating"]["list"][1]["query"].update(
            query="label_values(kvxferd_build_info, rank)"
        )
    ),
    "dashboard-subject-dropped": _dash_edit(lambda d: d["panels"].remove(_panel("Link speed")(d))),
    "prometheusrule-stale": lambda: check_prometheusrule(
        PROMETHEUSRULE.read_text(), RULES.read_text().replace("for: 10m", "for: 20m", 1)
    ),
    "podmonitor-wrong-port": lambda: check_podmonitor(
        {
            **yaml.safe_load(PODMONITOR.read_text()),
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": "kvxferd"}},
                "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics"}],
            },
        },
        _pod_templates(),
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_catches(name: str) -> None:
    """Each check fails on a copy broken the way it guards against."""
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        BROKEN[name]()


if __name__ == "__main__":
    PROMETHEUSRULE.parent.mkdir(parents=True, exist_ok=True)
    PROMETHEUSRULE.write_text(render_prometheusrule(RULES.read_text()))
    print(f"wrote {PROMETHEUSRULE.relative_to(ROOT)}")
