"""A vLLM engine in a child process, driven by JSON lines on stdin (the tests' prefill and decode instances).

``python -m tests_vllm.engine --model DIR --role producer|consumer|plain|nixl-producer|nixl-consumer
[--engine-socket S] [--policy fail|recompute] [--nixl-port P]`` builds an in-process ``LLM`` (no
tokenizer, float32, eager, block size 32) with the kvxferd connector (vLLM's own NixlConnector
for the nixl roles, the reference it is measured against; none for ``plain``), prints
``{"event": "ready", ...}`` and then answers one line per command:

    {"op": "run", "requests": [{"id", "prompt": [ids], "max_tokens", "params": {...} | null}],
     "abort": [ids], "abort_after_steps": K, "timeout_s": T}
        -> {"event": "result", "outputs": {id: {"tokens", "finish_reason", "kv_transfer_params"}},
            "aborted": [ids], "steps": N, "preemptions": P, "elapsed_s": S}
    {"op": "drain", "timeout_s": T}  step until the scheduler holds no request
        -> {"event": "drained", "stats": connector stats, "elapsed_s": S}
    {"op": "stats"} -> {"event": "stats", "stats": ...}
    {"op": "quit"}

Greedy decoding (temperature 0, ignore_eos), so the same prompt gives the same tokens
on every instance that computes the same KV.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 64 << 20


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def build_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if args.role.startswith("nixl-"):
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.nixl_port)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer" if args.role == "nixl-producer" else "kv_consumer",
            kv_load_failure_policy=args.policy,
        )
    elif args.role != "plain":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferdConnector",
            kv_connector_module_path="kvxferd.integrations.vllm",
            kv_role="kv_producer" if args.role == "producer" else "kv_consumer",
            kv_load_failure_policy=args.policy,
            kv_connector_extra_config={
                "engine_socket": args.engine_socket,
                "transfer_timeout_s": args.transfer_timeout_s,
                "call_timeout_s": 3.0,
                "zero_copy": args.zero_copy,
            },
        )
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len,
        **({"max_num_batched_tokens": args.max_batched} if args.max_batched else {}),
        enable_prefix_caching=False,
        **kw,
    )


class Engine:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler

    def connector_stats(self) -> dict[str, int]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        stats = getattr(get_kv_transfer_group(), "stats", None)  # vLLM's own connectors have none
        return dict(stats()) if stats is not None else {}

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        t0 = time.monotonic()
        deadline = t0 + float(cmd.get("timeout_s", 120))
        pending: set[str] = set()
        for r in cmd["requests"]:
            extra = {"kv_transfer_params": r["params"]} if r.get("params") is not None else None
            sp = SamplingParams(
                temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, extra_args=extra
            )
            self.engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, sp)
            pending.add(r["id"])
        to_abort = list(cmd.get("abort", []))
        abort_after = int(cmd.get("abort_after_steps", 0))
        outputs: dict[str, Any] = {}
        preempted: dict[str, int] = {}
        first_token_at: dict[str, float] = {}
        steps = 0
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {sorted(pending)} not finished after {steps} steps")
            if to_abort and steps >= abort_after:
                self.engine.abort_request(to_abort)
                pending.difference_update(to_abort)
                to_abort = []
            idle = True
            for out in self.engine.step():
                idle = False
                now = time.monotonic()
                if out.outputs and out.outputs[0].token_ids:
                    first_token_at.setdefault(out.request_id, now)
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    c = out.outputs[0]
                    outputs[out.request_id] = {
                        "tokens": list(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "kv_transfer_params": out.kv_transfer_params,
                        # CLOCK_MONOTONIC is the host's: comparable across processes
                        "first_token_at": first_token_at.get(out.request_id, now),
                        "finished_at": now,
                    }
            steps += 1
            for req in list(self.scheduler.requests.values()):
                if req.num_preemptions:
                    preempted[req.request_id] = req.num_preemptions
            if idle:
                time.sleep(0.001)  # waiting on a transfer: do not spin a shared core
        return {
            "outputs": outputs,
            "aborted": list(cmd.get("abort", [])),
            "steps": steps,
            "preemptions": sum(preempted.values()),
            "elapsed_s": time.monotonic() - t0,
        }

    def drain(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Step until the scheduler holds nothing (late frees, aborted loads) and the pool is free."""
        t0 = time.monotonic()
        deadline = t0 + float(cmd.get("timeout_s", 30))
        while self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("scheduler still holds requests")
            self.engine.step()
            time.sleep(0.001)
        return {"stats": self.connector_stats(), "elapsed_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument(
        "--role",
        choices=["producer", "consumer", "plain", "nixl-producer", "nixl-consumer"],
        required=True,
    )
    p.add_argument("--nixl-port", type=int, default=5600, help="VLLM_NIXL_SIDE_CHANNEL_PORT")
    p.add_argument("--engine-socket", default="")
    p.add_argument("--policy", choices=["fail", "recompute"], default="fail")
    p.add_argument("--transfer-timeout-s", type=float, default=20.0)
    p.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES)
    p.add_argument("--zero-copy", action="store_true", help="the connector's zero_copy")
    p.add_argument("--num-blocks", type=int, default=0, help="num_gpu_blocks_override")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument(
        "--max-batched", type=int, default=0, help="max_num_batched_tokens (chunked prefill)"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.monotonic()
    try:
        llm = build_llm(args)
    except Exception as e:
        _emit("failed", error=f"{type(e).__name__}: {e}")
        return 1
    eng = Engine(llm)
    _emit("ready", startup_s=time.monotonic() - t0, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "run":
                _emit("result", **eng.run(cmd))
            elif op == "drain":
                _emit("drained", **eng.drain(cmd))
            elif op == "stats":
                _emit("stats", stats=eng.connector_stats())
            elif op == "quit":
                break
            else:
                _emit("error", error=f"unknown op {op}")
        except Exception as e:
            _emit("error", error=f"{type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
