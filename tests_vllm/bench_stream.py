"""Streamed KV next to vLLM's NixlConnector: time to first token, and prefill's end to decode's first step.

``python -m tests_vllm.bench_stream [--lengths 1024,2048,3072] [--reps 3] [--json out.json]``
(in ``.venv-vllm``, about 6 minutes) builds one random Llama whose KV is a visible part of
the work (16 layers, 8 KV heads of 64, float32: 64 KiB of KV per token, 192 MiB for a
3k-token prompt), starts in one run

* **nixl**: a prefill and a decode engine with vLLM's NixlConnector (the decode engine
  READs the prefill engine's blocks itself once the prefill's answer came);
* **kvxferd**: a prefill and a decode engine with the kvxferd connector and their sender
  and receiver daemons, driven two ways:
    * **after prefill** (the prefill-first flow): the prefill's answer carries the params,
      then the decode request goes; its fetch is written once it arrives;
    * **streamed** (the decode-first flow with ``kvxferd_stream``): the decode and the
      prefill request go at once, the decode's fetch parks at the sender, and the sender
      writes each layer as the prefill's forward marks it ready;

with UCX on TCP only (``UCX_TLS=tcp``, as between hosts) for the daemons and NIXL's
engines alike, and alternates the paths, one request at a time, each prompt length in
turn. For each request, from the engines' own clocks (CLOCK_MONOTONIC, one per host):

* **TTFT**: from the router's first send to the decode engine's first token;
* **prefill end -> decode first step**: from the prefill engine's output (its forward
  ended) to the decode engine's first token (which also includes the decode's recompute
  of the prompt's last token: the same on every path).

The decoded tokens of every path must equal monolithic decode (a plain engine), else it
exits 1. Prints a Markdown table (medians, in ms) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvxferd.engine.client import Client
from kvxferd.integrations.vllm.proxy import Instance, decode_first_params
from tests_vllm.conftest import Rig
from tests_vllm.rig import EngineProcess, Shape, build_model
from tests_vllm.test_pd import prompts

BENCH = Shape(
    layers=16, hidden=256, intermediate=768, heads=8, kv_heads=8, head_dim=64, max_len=4096
)
POOL_BLOCKS = 256  # 2.6 prompts of 3k tokens in flight per daemon
DECODE_TOKENS = 2
TIMEOUT_S = 300.0
PATHS = ("nixl", "kvxferd after prefill", "kvxferd streamed")
DECODE_FIRST = "kvxferd decode-first"  # not streamed: the publish comes after the forward


def _prefill_first(pre: EngineProcess, dec: EngineProcess, tag: str, p: list[int]) -> dict:
    t0 = time.monotonic()
    out = pre.run(
        [{"id": f"{tag}p", "prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}],
        TIMEOUT_S,
    )["outputs"][f"{tag}p"]
    d = dec.run(
        [
            {
                "id": f"{tag}d",
                "prompt": p,
                "max_tokens": DECODE_TOKENS,
                "params": out["kv_transfer_params"],
            }
        ],
        TIMEOUT_S,
    )["outputs"][f"{tag}d"]
    return _figures(t0, out, d)


def _streamed(
    pre: EngineProcess,
    dec: EngineProcess,
    inst: Instance,
    tag: str,
    p: list[int],
    stream: bool = True,
) -> dict:
    tid, tok = f"b-{tag}-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    dparams = {**decode_first_params(inst, tid, tok), "kvxferd_stream": stream}
    pparams = {
        "do_remote_decode": True,
        "kvxferd_transfer_id": tid,
        "kvxferd_token": tok,
        "kvxferd_stream": stream,
    }
    t0 = time.monotonic()
    dec_bound = dec.start_run(
        [{"id": f"{tag}d", "prompt": p, "max_tokens": DECODE_TOKENS, "params": dparams}],
        TIMEOUT_S,
    )
    pre_bound = pre.start_run(
        [{"id": f"{tag}p", "prompt": p, "max_tokens": 1, "params": pparams}], TIMEOUT_S
    )
    out = _result(pre.reply(pre_bound))["outputs"][f"{tag}p"]
    d = _result(dec.reply(dec_bound))["outputs"][f"{tag}d"]
    return _figures(t0, out, d)


def _result(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("event") != "result":
        raise RuntimeError(f"engine answered {reply}")
    return reply


def _figures(t0: float, pre_out: dict, dec_out: dict) -> dict:
    receipt = (dec_out.get("kv_transfer_params") or {}).get("kvxferd_receipt")
    return {
        "ttft_ms": 1000 * (dec_out["first_token_at"] - t0),
        "gap_ms": 1000 * (dec_out["first_token_at"] - pre_out["finished_at"]),
        "prefill_ms": 1000 * (pre_out["finished_at"] - t0),
        "tokens": dec_out["tokens"],
        "receipt": receipt,
    }


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def _instance(sender_socket: str) -> Instance:
    with Client(sender_socket, timeout_s=10) as c:
        info = c.describe()
    return Instance((info.endpoint,), (info.public_key,))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,2048,3072")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for the daemons and NIXL engines")
    ap.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of every engine (1: a forward computes on one core and leaves"
        " the other to the processes that move KV, as a GPU computes apart from them)",
    )
    ap.add_argument("--zero-copy", action="store_true", help="kvxferd engines with zero_copy")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="prefill engines on CPU 0, everything else on the other CPUs (as a prefill GPU"
        " computes apart from the CPUs that move KV and serve decode)",
    )
    ap.add_argument("--decode-first", action="store_true", help=f"also the path {DECODE_FIRST!r}")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by every daemon and engine
    if args.omp_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)
    tmp = Path(tempfile.mkdtemp(prefix="kxs"))
    rig = Rig(str(tmp), build_model(tmp / "model", BENCH))
    try:
        zc = ["--zero-copy", "--num-blocks", str(POOL_BLOCKS)] if args.zero_copy else []
        tx = rig.daemon("sender", "tx", POOL_BLOCKS, zero_copy=args.zero_copy)
        rx = rig.daemon("receiver", "rx", POOL_BLOCKS, zero_copy=args.zero_copy)
        tx.wait_ready()
        rx.wait_ready()
        eng = [
            "--max-model-len",
            str(BENCH.max_len),
            "--kv-cache-bytes",
            str((POOL_BLOCKS + 8) * BENCH.layers * BENCH.block_bytes),
        ]
        slow = ["--transfer-timeout-s", str(TIMEOUT_S)]
        kx = (
            rig.engine("kx-prefill", "producer", tx, *eng, *zc),
            rig.engine("kx-decode", "consumer", rx, *eng, *slow, *zc),
        )
        nx = (
            rig.engine("nx-prefill", "nixl-producer", None, *eng, "--nixl-port", "5631"),
            rig.engine("nx-decode", "nixl-consumer", None, *eng, "--nixl-port", "5642"),
        )
        plain = rig.engine("plain", "plain", None, *eng)
        for e in (*kx, *nx, plain):
            e.wait_ready(timeout=300)
        if args.pin:
            rest = set(range(1, os.cpu_count() or 2)) or {0}
            for proc, cpus in [(kx[0], {0}), (nx[0], {0}), (kx[1], rest), (nx[1], rest)]:
                _pin(proc.proc.pid, cpus)
            for d in (tx, rx, plain):
                _pin(d.proc.pid, rest)
        inst = _instance(tx.engine_socket)
        ps = {n: prompts([n], seed=7 + n)[0] for n in lengths}
        mono = {
            n: plain.run([{"id": f"m{n}", "prompt": p, "max_tokens": DECODE_TOKENS}], TIMEOUT_S)[
                "outputs"
            ][f"m{n}"]["tokens"]
            for n, p in ps.items()
        }

        def one(path: str, tag: str, p: list[int]) -> dict:
            if path == "nixl":
                return _prefill_first(*nx, tag, p)
            if path == "kvxferd after prefill":
                return _prefill_first(*kx, tag, p)
            return _streamed(*kx, inst, tag, p, stream=path != DECODE_FIRST)

        paths = (*PATHS, DECODE_FIRST) if args.decode_first else PATHS
        for path in paths:  # warm-up: handshakes, first allocations, first long forward
            one(path, f"w{paths.index(path)}", ps[lengths[0]])
        rows: dict[tuple[str, int], list[dict]] = {}
        ok = True
        for rep in range(args.reps):
            for n in lengths:
                order = list(paths) if rep % 2 == 0 else list(paths)[::-1]
                for path in order:
                    f = one(path, f"r{rep}n{n}i{paths.index(path)}", ps[n])
                    if f["tokens"] != mono[n]:
                        ok = False
                        print(f"{path}, {n} tokens: tokens differ from monolithic", file=sys.stderr)
                    if path != "nixl" and not (f["receipt"] or {}).get("loaded"):
                        ok = False
                        print(f"{path}, {n} tokens: not loaded: {f['receipt']}", file=sys.stderr)
                    rows.setdefault((path, n), []).append(f)
        load = os.getloadavg()[0]
        print(
            f"\nUCX_TLS={args.ucx_tls}; OMP_NUM_THREADS={args.omp_threads or 'default'};"
            f" kvxferd {'zero copy' if args.zero_copy else 'copying through the pools'};"
            f"{' prefill engines pinned to CPU 0, the rest to the others;' if args.pin else ''}"
            f" {args.reps} requests per cell; load average {load:.1f}"
        )
        print(
            "| prompt (tokens) | KV (MiB) | path | TTFT, median (ms) |"
            " prefill end -> decode first step, median (ms) | prefill, median (ms) |"
        )
        print("|--:|--:|---|--:|--:|--:|")
        result: dict[str, Any] = {}
        for n in lengths:
            mib = n * BENCH.layers * BENCH.block_bytes / 32 / (1 << 20)
            for path in paths:
                fs = rows[(path, n)]
                med = {k: statistics.median(f[k] for f in fs) for k in ("ttft_ms", "gap_ms")}
                med["prefill_ms"] = statistics.median(f["prefill_ms"] for f in fs)
                result[f"{path}/{n}"] = {
                    **med,
                    "all": [{k: f[k] for k in ("ttft_ms", "gap_ms", "prefill_ms")} for f in fs],
                    "receipts": [f["receipt"] for f in fs],
                }
                print(
                    f"| {n} | {mib:.0f} | {path} | {med['ttft_ms']:.0f} | {med['gap_ms']:.0f}"
                    f" | {med['prefill_ms']:.0f} |"
                )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0 if ok else 1
    finally:
        rig.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
