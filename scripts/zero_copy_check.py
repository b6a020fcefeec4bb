"""The prepared zero-copy check: engine KV seated on two daemons' pools, one transfer, byte-exact.

Run on a GPU host (``make zero-copy-check``, or ``python scripts/zero_copy_check.py
--device cuda``); ``--device cpu`` runs the same path on DRAM (tests/test_zero_copy_check.py
does, in ``make test``). What it exercises, with no inference engine installed:

1. a sender and a receiver daemon whose ``[pool]`` is on the device (``device = "cuda"``:
   the KV region is one CUDA tensor registered with NIXL as VRAM);
2. this process as the engine of both: ``attach_pool`` maps each pool (CUDA IPC on a
   GPU, shared memory on the CPU) and ``KvGeometry.seat`` re-seats per-layer KV tensors
   laid out as vLLM's CUDA backends allocate them, ``[2, num_blocks, block_size,
   kv_heads, head_dim]`` (K/V planes first), onto the pool;
3. the "prefill" tensors filled through their own views, ``publish`` on the sender,
   ``fetch`` into other block ids on the receiver, and a comparison of the "decode"
   tensors' blocks with the prefill ones (and of an untouched block with zeros);
4. a bulk transfer of every engine block for a GB/s figure.

Exit 0: byte-exact. Exit 1: a mismatch or a failed transfer. Exit 77: this host
cannot run it (no CUDA, no NIXL), with the reason on stderr. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SKIP = 77
READY_S = 120.0


def _probe(device: str) -> str | None:
    """Why this host cannot run the check, or None."""
    try:
        import nixl._api  # noqa: F401
        import torch
    except ImportError as e:
        return f"missing {e.name}: install kvxferd (pip install -e .) first"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible to torch (torch.cuda.is_available() is False)"
    return None


class Daemon:
    """``python -m kvxferd ROLE`` with its ready line read under a deadline."""

    def __init__(self, role: str, workdir: Path, pool: str) -> None:
        cfg = workdir / f"{role}.toml"
        cfg.write_text(pool)
        args = [sys.executable, "-m", "kvxferd", role, "--config", str(cfg)]
        if role == "sender":
            args += ["--listen", "tcp://127.0.0.1:0"]
        env = {
            **os.environ,
            "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{workdir}/{role}.sock",
            "KVXFERD_SERVICE__PROBE_PORT": "0",
            "KVXFERD_SECURITY__MODE": "off",  # loopback and ipc only: plaintext is accepted
        }
        self.stderr = open(workdir / f"{role}.stderr", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True
        )
        self.info: dict[str, Any] | None = None
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        reader.join(READY_S)
        if self.info is None:
            self.stop()
            tail = (workdir / f"{role}.stderr").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {role} daemon did not get ready:\n{tail}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.info = json.loads(line)
                return

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr.close()


def run(
    device: str, layers: int, blocks: int, workdir: Path, *, corrupt: bool = False
) -> dict[str, Any]:
    """The check; ``corrupt`` spoils one received element first (the comparison must catch it)."""
    import torch

    from kvxferd.engine.client import Client, attach_pool
    from kvxferd.integrations.vllm.geometry import KvGeometry

    block_size, kv_heads, head_dim = 16, 2, 64
    dtype = torch.float16 if device == "cuda" else torch.float32
    dname = "float16" if device == "cuda" else "float32"
    engine_blocks = blocks - 8  # the pool's last 8 blocks are scratch, as the connector keeps
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    pool = (
        "[pool]\n"
        f"num_layers = {2 * layers}\nnum_blocks = {blocks}\n"
        f'block_elems = {block_size * kv_heads * head_dim}\ndtype = "{dname}"\n'
        + ('device = "cuda"\ncuda_device = 0\n' if device == "cuda" else "")
    )
    daemons = [Daemon("sender", workdir, pool), Daemon("receiver", workdir, pool)]
    try:
        sides = {}
        for d in daemons:
            client = Client(d.info["engine_socket"], timeout_s=30)  # type: ignore[index]
            info = client.describe()
            kv = {
                f"model.layers.{i}.self_attn": torch.zeros(
                    (2, engine_blocks, block_size, kv_heads, head_dim), dtype=dtype, device=where
                )
                for i in range(layers)
            }
            geo = KvGeometry(kv, engine_blocks)
            geo.check_resident(info, info.role)
            mapped = attach_pool(info)
            geo.seat(mapped, info.layout.num_blocks)
            sides[info.role] = (client, info, kv, mapped)
        tx, tx_info, tx_kv, _ = sides["sender"]
        rx, _, rx_kv, _ = sides["receiver"]
        gen = torch.Generator(device=where).manual_seed(7)
        for t in tx_kv.values():  # written through vLLM-shaped views, read by the daemon
            t.copy_(torch.randn(t.shape, generator=gen, device=where, dtype=dtype))
        src, dst = [3, 7, 8, 9], [10, 2, 30, 31]
        endpoint = str(tx_info.endpoint)
        h_tx = tx.publish("zero-copy-check-1", src)
        h_rx = rx.fetch("zero-copy-check-1", endpoint, dst, want_aux=False)
        out = rx.wait(h_rx, 30, close=True)
        if out is None or not out.ok:
            return {"ok": False, "why": f"fetch ended {out}"}
        tx.wait(h_tx, 30, close=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if corrupt:
            first = next(iter(rx_kv.values()))
            first[1, dst[0], 0, 0, 0] += 1
        exact = all(
            torch.equal(rx_kv[name][:, d], tx_kv[name][:, s])
            for name in tx_kv
            for s, d in zip(src, dst, strict=True)
        )
        untouched = all(not bool(rx_kv[name][:, 0].any()) for name in rx_kv)
        # Bulk: every engine block, one request.
        ids = list(range(engine_blocks))
        nbytes = sum(t.numel() * t.element_size() for t in tx_kv.values())
        t0 = time.perf_counter()
        h_tx = tx.publish("zero-copy-check-bulk", ids)
        h_rx = rx.fetch("zero-copy-check-bulk", endpoint, ids, want_aux=False)
        bulk = rx.wait(h_rx, 60, close=True)
        took = time.perf_counter() - t0
        tx.wait(h_tx, 30, close=True)
        bulk_exact = (
            bulk is not None and bulk.ok and all(torch.equal(rx_kv[n], tx_kv[n]) for n in tx_kv)
        )
        for client, *_ in sides.values():
            client.close_client()
        return {
            "ok": exact and untouched and bulk_exact,
            "device": device,
            "blocks_exact": exact,
            "untouched_block_zero": untouched,
            "bulk_exact": bulk_exact,
            "bulk_bytes": nbytes,
            "bulk_gbps": round(nbytes / took / 1e9, 3),
        }
    finally:
        for d in daemons:
            d.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--corrupt", action="store_true", help="self-test: must exit 1")
    args = p.parse_args(argv)
    why = _probe(args.device)
    if why is not None:
        print(f"zero-copy check skipped: {why}", file=sys.stderr)
        return SKIP
    with tempfile.TemporaryDirectory(prefix="kvzc") as d:
        try:
            result = run(args.device, args.layers, args.blocks, Path(d), corrupt=args.corrupt)
        except Exception as e:  # a daemon that would not start, a refused call: say which
            result = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
