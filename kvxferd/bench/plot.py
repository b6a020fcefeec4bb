"""The ``--plot`` chart: median GB/s of the three paths for every workload (needs matplotlib)."""

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
