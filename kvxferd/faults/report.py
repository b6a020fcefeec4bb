"""The figures of a fault run: one console line per scenario, a markdown table in the report.

The table goes between the ``<!-- faults:begin -->`` and ``<!-- faults:end -->``
markers of the report file; the rest of the file (the method) is left as it is.
"""

from __future__ import annotations

import datetime as dt
import math
import platform
from pathlib import Path

from kvxferd.faults.scenarios import FD_SLACK, THREAD_SLACK, Result

BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def _s(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f}"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def line(r: Result) -> str:
    if r.skipped:
        return f"SKIP  {r.name:20s} {r.skipped}"
    verdict = "ok  " if not r.broken else "FAIL"
    iso = (
        f", B p99 {_ms(r.base_p99_ms)} -> {_ms(r.fault_p99_ms)} ms (max {_ms(r.fault_max_ms)})"
        if r.b_failed >= 0
        else ""
    )
    why = f"  [{'; '.join(r.broken)}]" if r.broken else ""
    extra = "; ".join(f"{k}: {v}" for k, v in r.extra.items() if not k.startswith("_"))
    why += f"  ({extra})" if extra else ""
    return (
        f"{verdict}  {r.name:20s} {r.affected} affected, terminal in {_s(r.terminal_s)} s "
        f"(bound {r.bound_s:.0f}), {r.done} done, {r.verified_bytes / 1e6:.1f} MB verified, "
        f"{r.wrong_done} wrong, {r.lost} lost, {r.hung} hung{iso} ({r.seconds:.0f} s){why}"
    )


def table(results: list[Result]) -> str:
    head = (
        "| scenario | fault | affected | terminal s (bound) | done | MB verified | wrong done "
        "| lost | hung | open sessions | exit codes | shm left | +threads / +fds "
        "| B p99 ms base -> fault, max (B failed) | verdict |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        if r.skipped:
            rows.append(f"| {r.name} | {r.fault} | | | | | | | | | | | | | skipped: {r.skipped} |")
            continue
        iso = (
            f"{_ms(r.base_p99_ms)} -> {_ms(r.fault_p99_ms)}, max {_ms(r.fault_max_ms)} ({r.b_failed})"
            if r.b_failed >= 0
            else "-"
        )
        codes = ", ".join(f"{k} {v}" for k, v in r.exit_codes.items())
        extra = "; ".join(f"{k}: {v}" for k, v in r.extra.items() if not k.startswith("_"))
        verdict = "ok" if not r.broken else "**FAIL**: " + "; ".join(r.broken)
        if extra:
            verdict += f" ({extra})"
        rows.append(
            f"| {r.name} | {r.fault} | {r.affected} | {_s(r.terminal_s)} ({r.bound_s:.0f}) "
            f"| {r.done} | {r.verified_bytes / 1e6:.1f} | {r.wrong_done} | {r.lost} "
            f"| {r.hung} | {r.open_sessions} | {codes} | {r.shm_left} "
            f"| {r.thread_growth} / {r.fd_growth} | {iso} | {verdict} |"
        )
    return head + "\n".join(rows) + "\n"


def write_report(path: str, results: list[Result], *, quick: bool, ucx_tls: str | None) -> None:
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"{BEGIN}\n"
        f"Run {when}, {'`--quick`' if quick else 'full'} timings, UCX_TLS `{ucx_tls or 'default'}`, "
        f"{platform.machine()} Linux {platform.release()}, Python {platform.python_version()}. "
        f"Thread/fd slack {THREAD_SLACK}/{FD_SLACK}.\n\n" + table(results) + f"{END}\n"
    )
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        post = rest.split(END, 1)[1].lstrip("\n")
        text = pre + body + post
    else:
        text = text + ("\n" if text else "") + body
    p.write_text(text)
