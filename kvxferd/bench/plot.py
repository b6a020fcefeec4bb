"""The ``--plot`` charts: GB/s of every path per workload, and the ``--curves`` panels (matplotlib)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxferd.bench.workload import _size


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(report: dict[str, Any], path: str) -> None:
    """Grouped bars: median GB/s (min-max whiskers) of every path of every workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = report["workloads"]
    x = np.arange(len(ws))
    names = ("kvxferd", "engine", "nixl", "nixl-default", "zmq")
    labels_ = ("kvxferd", "engine path", "raw NIXL (tuned)", "raw NIXL (default)", "ZMQ copy")
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(ws) + 3), 5.5))
    nan = {"median": np.nan, "min": np.nan, "max": np.nan}
    for j, (name, label) in enumerate(zip(names, labels_, strict=True)):
        g = [w["paths"][name]["gbps"] if name in w["paths"] else nan for w in ws]
        if all(np.isnan(v["median"]) for v in g):
            continue
        med = np.array([v["median"] for v in g])
        err = np.array([[v["median"] - v["min"] for v in g], [v["max"] - v["median"] for v in g]])
        ax.bar(x + (j - 2) * width, med, width, yerr=err, capsize=2, label=label)
    labels = [
        f"{w['name']}\n{_size(w['block_bytes'])} x {w['blocks']}"
        + (f" x {w['layers']}L" if w["layers"] > 1 else "")
        + f" = {_size(w['request_bytes'])}"
        for w in ws
    ]
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median of repetitions; whiskers min-max)")
    ax.set_title(
        f"kvxferd bench ({report['preset']} preset)\n{report['dataplane_text']}", fontsize=8
    )
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_curves_plot(doc: dict[str, Any], path: str) -> None:
    """The ``--curves`` chart: one panel per axis and figure, kvxferd beside raw NIXL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = doc["axes"]
    fig, grid = plt.subplots(2, 4, figsize=(18, 8.5))
    panels = [
        ("inflight", "rps", "requests/s (band: min-max of repetitions)", True),
        ("inflight", "p50_ms", "p50 latency ms (p99 dotted)", True),
        ("workers-small", "rps", "requests/s (band: min-max of repetitions)", True),
        ("workers-bulk", "gbps", "GB/s (band: min-max of repetitions)", True),
        ("blocks", "p50_us", "p50 us per request (a + c x blocks dashed)", True),
        ("blocks", "p50_us_per_block", "p50 us per block", True),
        ("peers", "rps", "requests/s, all receivers (band: min-max)", True),
    ]
    for ax, (axis, key, ylabel, logy) in zip(grid.flat, panels, strict=False):
        a = axes[axis]
        pts = [p for p in a["points"] if not p["skipped"]]
        for name, label, style in ((a["path"], a["path"], "o-"), ("nixl", "raw NIXL", "s-")):
            xs = [p["x"] for p in pts]
            ys = [p["paths"][name][key] for p in pts]
            (line,) = ax.plot(xs, ys, style, label=label, ms=4)
            if key in ("rps", "gbps"):  # min-max over the repetitions
                lo = [p["paths"][name][f"{key}_min"] for p in pts]
                hi = [p["paths"][name][f"{key}_max"] for p in pts]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
            if key == "p50_ms":
                ax.plot(xs, [p["paths"][name]["p99_ms"] for p in pts], ":", color=line.get_color())
            fit = doc.get("blocks_fit", {}).get(name)
            if key == "p50_us" and fit and xs:
                fx = np.geomspace(min(xs), max(xs), 50)
                ax.plot(
                    fx,
                    fit["fixed_us"] + fit["us_per_block"] * fx,
                    "--",
                    lw=0.8,
                    color=line.get_color(),
                )
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(a["x"])
        ax.set_ylabel(ylabel)
        ax.set_title(f"{axis}: {a['what']}", fontsize=7)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7)
    last = grid.flat[7]
    prep = doc["prep"]
    labels_ = [f"{q['layers']}L {q['ids'][:5]}" for q in prep]
    x = np.arange(len(prep))
    last.bar(x - 0.2, [q["median_us"] for q in prep], 0.4, label="median")
    last.bar(x + 0.2, [q["p99_us"] for q in prep], 0.4, label="p99")
    last.axhline(100, color="red", lw=0.8, ls="--", label="target 0.1 ms")
    last.axhline(424, color="gray", lw=0.8, ls=":", label="TensorRT-LLM 0.42 ms")
    last.set_xticks(x, labels_, fontsize=7)
    last.set_yscale("log")
    last.set_ylabel("us")
    last.set_title("preparing a 1000-block request (no transfer)", fontsize=7)
    last.legend(fontsize=7)
    fig.suptitle(
        f"kvxferd bench --curves ({doc['elapsed_s']:.0f} s, load {doc['load_start'][0]} -> "
        f"{doc['load_end'][0]}); {doc['dataplane_text']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
