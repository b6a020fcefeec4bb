"""The connector's cost next to vLLM's own NixlConnector: same model, same machine, same run.

``python -m tests_vllm.bench_pd [--reps 3] [--singles 10] [--json out.json]`` starts three
1P1D pairs side by side (kvxferd copying through the daemons' pools: prefill + sender
daemon, receiver daemon + decode; kvxferd with ``zero_copy``, vLLM's KV cache seated on
its own pair of daemons' pools; NIXL: prefill and decode engines reading each other's KV
directly) and alternates them:

* **16-prompt run**: the 16 prompts of tests_vllm/test_pd.py (1 to 504 tokens) prefilled
  together (max_tokens 1), then decoded together (8 tokens) with the prefill's params;
  end-to-end seconds.
* **per request, prefill end to decode start**: one 256-token prompt at a time; the decode
  call with max_tokens 1 (load the KV, recompute the last prompt token, sample one token)
  minus nothing: both paths do the same compute, so the difference is the connector's.

Prints a Markdown table (and writes ``--json``); the decoded tokens of both paths must
equal monolithic ones, else it exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests_vllm.conftest import Rig
from tests_vllm.rig import build_model
from tests_vllm.test_pd import DECODE_TOKENS, LENGTHS, prompts

ZC_BLOCKS = 512  # zero copy: vLLM's blocks (num_gpu_blocks_override), as the copy pool has


def _pd_run(pre: Any, dec: Any, tag: str, ps: list[list[int]]) -> tuple[float, list[list[int]]]:
    t0 = time.monotonic()
    reqs = [
        {"id": f"{tag}p{i}", "prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
        for i, p in enumerate(ps)
    ]
    out = pre.run(reqs)["outputs"]
    dreqs = [
        {
            "id": f"{tag}d{i}",
            "prompt": p,
            "max_tokens": DECODE_TOKENS,
            "params": out[f"{tag}p{i}"]["kv_transfer_params"],
        }
        for i, p in enumerate(ps)
    ]
    dout = dec.run(dreqs)["outputs"]
    return time.monotonic() - t0, [dout[f"{tag}d{i}"]["tokens"] for i in range(len(ps))]


def _single(pre: Any, dec: Any, tag: str, p: list[int]) -> float:
    out = pre.run(
        [{"id": f"{tag}p", "prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}]
    )
    params = out["outputs"][f"{tag}p"]["kv_transfer_params"]
    t0 = time.monotonic()
    dec.run([{"id": f"{tag}d", "prompt": p, "max_tokens": 1, "params": params}])
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--singles", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--sender-threads", type=int, default=1)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kxb"))
    rig = Rig(str(tmp), build_model(tmp / "model"))
    try:
        tx = rig.daemon("sender", "tx", threads=args.sender_threads)
        rx = rig.daemon("receiver", "rx")
        ztx = rig.daemon("sender", "ztx", ZC_BLOCKS, threads=args.sender_threads, zero_copy=True)
        zrx = rig.daemon("receiver", "zrx", ZC_BLOCKS, zero_copy=True)
        for d in (tx, rx, ztx, zrx):
            d.wait_ready()
        zc = ["--zero-copy", "--num-blocks", str(ZC_BLOCKS)]
        paths = {
            "kvxferd": (
                rig.engine("kx-prefill", "producer", tx),
                rig.engine("kx-decode", "consumer", rx),
            ),
            "kvxferd zero copy": (
                rig.engine("kz-prefill", "producer", ztx, *zc),
                rig.engine("kz-decode", "consumer", zrx, *zc),
            ),
            "nixl": (
                rig.engine("nx-prefill", "nixl-producer", None, "--nixl-port", "5611"),
                rig.engine("nx-decode", "nixl-consumer", None, "--nixl-port", "5622"),
            ),
        }
        plain = rig.engine("plain", "plain", None)
        for pre, dec in paths.values():
            pre.wait_ready()
            dec.wait_ready()
        plain.wait_ready()
        ps = prompts(LENGTHS, seed=1)
        mono_out = plain.run(
            [{"id": f"m{i}", "prompt": p, "max_tokens": DECODE_TOKENS} for i, p in enumerate(ps)]
        )["outputs"]
        mono = [mono_out[f"m{i}"]["tokens"] for i in range(len(ps))]
        runs: dict[str, list[float]] = {k: [] for k in paths}
        singles: dict[str, list[float]] = {k: [] for k in paths}
        single_prompt = prompts([256], seed=3)[0]
        for name, (pre, dec) in paths.items():  # warm-up: first handshakes, first allocations
            _pd_run(pre, dec, f"w{name}", ps[:2])
        ok = True
        for rep in range(args.reps):
            order = list(paths) if rep % 2 == 0 else list(paths)[::-1]
            for name in order:
                pre, dec = paths[name]
                took, toks = _pd_run(pre, dec, f"r{rep}{name}", ps)
                runs[name].append(took)
                if toks != mono:
                    ok = False
                    print(f"{name}: tokens differ from monolithic in rep {rep}", file=sys.stderr)
            for i in range(args.singles):
                for name in order:
                    pre, dec = paths[name]
                    singles[name].append(_single(pre, dec, f"s{rep}.{i}{name}", single_prompt))
        result = {
            name: {
                "run16_s": runs[name],
                "run16_median_s": statistics.median(runs[name]),
                "single_decode_ms_median": 1000 * statistics.median(singles[name]),
                "single_decode_ms_p90": 1000
                * sorted(singles[name])[int(0.9 * (len(singles[name]) - 1))],
            }
            for name in paths
        }
        print(
            "| path | 16-prompt run, median (s) | decode of one loaded 256-token prompt, median / p90 (ms) |"
        )
        print("|---|---|---|")
        for name, r in result.items():
            print(
                f"| {name} | {r['run16_median_s']:.3f} | "
                f"{r['single_decode_ms_median']:.1f} / {r['single_decode_ms_p90']:.1f} |"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0 if ok else 1
    finally:
        rig.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
