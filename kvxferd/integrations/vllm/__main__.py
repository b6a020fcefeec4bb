"""``python -m kvxferd.integrations.vllm pool-config | proxy``.

``pool-config --model DIR --block-size N --num-blocks M`` prints the ``[pool]`` TOML
section for the sender and receiver daemons that serve this model; the connector
refuses to start against a pool that differs (and its error names the values).
With ``--zero-copy`` (kv_connector_extra_config ``zero_copy``), ``--num-blocks`` is
vLLM's block count (pin it with ``num_gpu_blocks_override``) and the pool gets
that many plus one longest request of scratch; ``--planes 2`` for CUDA backends
that put K and V first (FlashAttention's ``[2, blocks, ...]``); ``--device cuda``;
``--tensor-parallel-size`` / ``--pipeline-parallel-size``: one worker's pool (one
section per stage). ``proxy --prefill URL --decode URL [--mode prefill-first|decode-first]``
runs the example P/D proxy (proxy.py).
"""

from __future__ import annotations

import argparse
import sys

from kvxferd.errors import ConfigError
from kvxferd.integrations.vllm.geometry import PoolShape, blocks_for, model_pool_shape


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvxferd.integrations.vllm")
    sub = p.add_subparsers(dest="command", required=True)
    pc = sub.add_parser("pool-config", help="print the daemons' [pool] section for a model")
    pc.add_argument("--model", required=True, help="the model directory (its config.json)")
    pc.add_argument("--block-size", type=int, required=True, help="vLLM's --block-size")
    pc.add_argument(
        "--num-blocks",
        type=int,
        required=True,
        help="pool blocks: the vLLM blocks of all transfers in flight at once",
    )
    pc.add_argument(
        "--dtype", default="auto", help="vLLM's KV cache dtype (auto: the model's dtype)"
    )
    pc.add_argument(
        "--zero-copy",
        action="store_true",
        help="vLLM's KV cache lives in the pool: --num-blocks is vLLM's block count",
    )
    pc.add_argument("--max-model-len", type=int, default=0, help="zero copy: scratch per request")
    pc.add_argument(
        "--planes", type=int, default=1, help="zero copy: planes per layer (2: K/V-first layouts)"
    )
    pc.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    pc.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vLLM's TP: one daemon per worker"
    )
    pc.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="vLLM's PP: a [pool] per stage (its layers differ when they do not divide)",
    )
    px = sub.add_parser("proxy", help="the example P/D proxy (docs/vllm.md)")
    px.add_argument("--prefill", action="append", required=True, help="a prefill server URL")
    px.add_argument("--decode", action="append", required=True, help="a decode server URL")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=8000)
    px.add_argument(
        "--mode",
        choices=["prefill-first", "decode-first"],
        default="prefill-first",
        help="prefill-first (vLLM's P/D flow, any connector) or decode-first (both requests "
        "at once; kvxferd on both sides)",
    )
    px.add_argument("--timeout-s", type=float, default=600.0, help="a whole upstream call, at most")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "proxy":
        from kvxferd.integrations.vllm.proxy import serve

        if not 0 < args.timeout_s <= 86400:
            print("kvxferd: --timeout-s must be in (0, 86400]", file=sys.stderr)
            return 2
        serve(args.prefill, args.decode, args.host, args.port, args.mode, args.timeout_s)
        return 0
    if args.block_size < 1 or args.num_blocks < 1 or args.planes not in (1, 2):
        print(
            "kvxferd: --block-size and --num-blocks must be at least 1, --planes 1 or 2",
            file=sys.stderr,
        )
        return 2
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    out = []
    for stage in range(max(1, pp)):
        try:
            shape = model_pool_shape(
                args.model, args.block_size, args.dtype, tp_size=tp, pp_size=pp, pp_stage=stage
            )
        except ConfigError as e:
            print(f"kvxferd: configuration error: {e}", file=sys.stderr)
            return 2
        comment = f"kvxferd [pool] for {args.model}, vLLM block size {args.block_size}"
        if tp * pp > 1:
            ranks = f"{stage * tp}..{stage * tp + tp - 1}" if tp > 1 else f"{stage * tp}"
            comment += (
                f"; TP {tp} x PP {pp}: the daemon of each worker of stage {stage} (ranks {ranks})"
            )
        else:
            comment += " (the same on the sender and the receiver when both run TP 1)"
        out.append(_section(args, shape, comment))
    sys.stdout.write("\n".join(out))
    return 0


def _section(args: argparse.Namespace, shape: PoolShape, comment: str) -> str:
    num_blocks = args.num_blocks
    if args.zero_copy:
        shape = PoolShape(
            shape.num_layers * args.planes, shape.block_elems // args.planes, shape.dtype
        )
        scratch = blocks_for(args.max_model_len, args.block_size) if args.max_model_len else 0
        num_blocks += scratch
        comment += (
            f"; zero copy: vLLM's {args.num_blocks} blocks (num_gpu_blocks_override) "
            f"+ {scratch} scratch"
        )
    text = shape.toml(num_blocks, comment)
    if args.device == "cuda":
        text += 'device = "cuda"\ncuda_device = 0\n'
    return text


if __name__ == "__main__":
    sys.exit(main())
