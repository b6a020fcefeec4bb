"""The per-request digest: two 64-bit lanes over the bytes a fetch's writes moved, in their order.

A fetch that asks for it (``RequestData.digest``) gets a 16-byte digest in its done
Result, computed by the sender over the source bytes it wrote; the receiver computes
the same function over what landed in its own blocks and fails the fetch
``digest_mismatch`` when they differ (docs/protocol.md section 4.1). Both sides run it
where the pool is, chunk by chunk: a CUDA pool with torch on its device, a CPU pool with
numpy on views of its tensors (below).

The stream. For each layer ``l`` the fetch writes (ascending), each of its blocks ``i``
(in the fetch's order: ``src_blocks[i]`` at the sender, ``dst_blocks[i]`` at the
receiver) and each byte range ``k`` inside a block (one whole block, or a piece's
ranges for a mapped pair: ``BlockRanges.src`` at the sender, ``.dst`` at the receiver,
kvxferd/transfer/reshard.py), those bytes; then the aux payload, when the fetch took
one. Both sides enumerate the same (layer, block, range) sequence, so the two streams
are byte for byte what one WRITE moved, however the descriptors were coalesced. The
stream is zero-padded to whole rows of ``ROW_WORDS`` 32-bit little-endian words
``x_j`` (signed), ``j = r * ROW_WORDS + c``; its length ``n`` in bytes is folded in::

    A = sum_j (1 + 4 ROW_WORDS r) * (2c + 1) * x_j     + n * K_A   (mod 2^64)
    B = sum_j U(r) * W(c) * x_j                        + n * K_B   (mod 2^64)
    digest = A | B  (16 bytes, little-endian)

``U`` and ``W`` are splitmix64 outputs forced odd (fixed: both sides derive them, no
key). Integer sums mod 2^64 do not depend on the order of a reduction, so a CPU sender
and a CUDA receiver agree bit for bit.

One code path, two array libraries: the same expressions run on torch tensors of a CUDA
pool and, for a CPU pool, on numpy views of its tensors (no copy), on the calling thread.
Measured in one process on this project's 2-core host (load average 7): 16 MiB took 7 ms
with numpy, 50 ms with torch on 2 intra-op threads, 80 ms on one; 64 MiB 28, 222 and
345 ms; with the host busier (load 12) torch's 2 threads were 10 times slower again than
its one. ``torch.set_num_threads`` is process-wide, and an engine embedding kvxferd has
its own use for it. CPU chunks are 1 MiB (they stay in cache).

What it catches, honestly:

* **Always**: any change confined to one 32-bit word (so any single byte): every
  weight is odd and such a change's 2-adic valuation is below 32. Any exchange of two
  words less than 8 GiB apart (a swap of two values): lane A changes by
  ``(w_a - w_b)(x_b - x_a)``, and ``w_a - w_b`` has a valuation of at most 12 (two
  columns) or 14 plus that of the row distance (one column), so the product's stays
  below 64. Lane A's weights are structured, not random: a block moved as a whole can
  cancel out in it, which is what lane B is for.
* **With high probability**: other corruptions (a block in the wrong slot, two blocks
  swapped, a layer shifted, a half-written block). Lane B's weights are pseudo-random
  and independent of KV content; a corruption independent of them goes unnoticed by
  both lanes with probability about 2^-64, and at worst (errors confined to the top
  bits of words, which shrink the lanes' effective width) about 2^-33 per lane.
* **Not**: a forger. The weights are public and the lanes linear: it is a check
  against accidents (a freed-while-read block, a layout bug, a torn write), not a MAC.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import torch

ROW_WORDS = 4096  # 16 KiB rows: lane B's column weights W(c) stay in cache
ROW_BYTES = ROW_WORDS * 4
DIGEST_BYTES = 16
_STEP_BYTES = {"cpu": 1 << 20, "cuda": 256 << 20}  # bytes gathered and reduced at a time
_M64 = (1 << 64) - 1
_K_A, _K_B = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
_W_SEED = 1 << 40  # W(c) = mix(c + _W_SEED): another sequence than U(r) = mix(r)

Array = Any  # a numpy array (a CPU pool) or a torch tensor (any other device)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64, forced odd (numpy's uint64 arithmetic wraps mod 2^64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


def _i64(u: np.ndarray, like: Array) -> Array:
    """The uint64 array ``u`` as int64 (same bits), in ``like``'s library and device."""
    v = u.view(np.int64)
    return v if isinstance(like, np.ndarray) else torch.from_numpy(v.copy()).to(like.device)


_weights_lock = threading.Lock()
_weights: dict[str, tuple[Array, Array]] = {}


def _column_weights(like: Array) -> tuple[Array, Array]:
    """(2c + 1, W(c)) for c < ROW_WORDS as int64, in ``like``'s library and device (cached)."""
    key = "numpy" if isinstance(like, np.ndarray) else str(like.device)
    with _weights_lock:
        got = _weights.get(key)
        if got is None:
            c = np.arange(ROW_WORDS, dtype=np.uint64)
            wa = _i64(np.uint64(2) * c + np.uint64(1), like)
            wb = _i64(_mix(c + np.uint64(_W_SEED)), like)
            got = _weights[key] = (wa, wb)
        return got


def _native(data: Array) -> Array:
    """A CPU tensor as a numpy view of it (no copy); anything else as it is."""
    if isinstance(data, torch.Tensor) and data.device.type == "cpu":
        return data.numpy()
    return data


def _join(carry: Array, data: Array) -> Array:
    """``carry`` then ``data``, in ``data``'s library and device (a CUDA pool's aux is on the CPU)."""
    if isinstance(data, np.ndarray):
        c = carry.cpu().numpy() if isinstance(carry, torch.Tensor) else carry
        return np.concatenate((c, data))
    c = torch.from_numpy(carry) if isinstance(carry, np.ndarray) else carry
    return torch.cat((c.to(data.device), data))


class Digest:
    """The digest of one stream, fed in order with ``update`` (any split), read by ``finish``."""

    def __init__(self) -> None:
        self._a = 0
        self._b = 0
        self._rows = 0  # rows reduced so far
        self._n = 0  # stream bytes so far
        self._carry: Array | None = None  # bytes short of a whole row

    def update(self, data: Array) -> None:
        """Append ``data`` (uint8, any shape: a numpy array or a tensor on any device)."""
        data = _native(data).reshape(-1)
        self._n += int(data.shape[0])
        if self._carry is not None:
            data, self._carry = _join(self._carry, data), None
        whole = int(data.shape[0]) // ROW_BYTES * ROW_BYTES
        if whole < data.shape[0]:
            self._carry = (
                data[whole:].copy() if isinstance(data, np.ndarray) else data[whole:].clone()
            )
        if whole:
            self._reduce(data[:whole])

    def finish(self) -> bytes:
        """The 16-byte digest (module docstring); the stream's tail padded with zeros."""
        if self._carry is not None:
            c, self._carry = self._carry, None
            tail: Array = (
                np.zeros(ROW_BYTES, dtype=np.uint8)
                if isinstance(c, np.ndarray)
                else torch.zeros(ROW_BYTES, dtype=torch.uint8, device=c.device)
            )
            tail[: c.shape[0]] = c
            self._reduce(tail)
        a = (self._a + self._n * _K_A) & _M64
        b = (self._b + self._n * _K_B) & _M64
        return struct.pack("<QQ", a, b)

    def _reduce(self, data: Array) -> None:
        """Fold whole rows (``data``: contiguous uint8, a multiple of ROW_BYTES) into the lanes."""
        if isinstance(data, np.ndarray):
            x = np.ascontiguousarray(data).view(np.int32).reshape(-1, ROW_WORDS)
        else:
            x = data.contiguous().view(torch.int32).view(-1, ROW_WORDS)
        wa, wb = _column_weights(x)
        r = np.arange(self._rows, self._rows + x.shape[0], dtype=np.uint64)
        self._rows += x.shape[0]
        ra = _i64(r * np.uint64(4 * ROW_WORDS) + np.uint64(1), x)
        rb = _i64(_mix(r), x)
        a = (ra * (x * wa).sum(1)).sum()
        b = (rb * (x * wb).sum(1)).sum()
        self._a = (self._a + int(a)) & _M64
        self._b = (self._b + int(b)) & _M64


def kv_digest(
    kv: torch.Tensor,
    layers: tuple[int, int],
    blocks: np.ndarray,
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
    aux: torch.Tensor | None = None,
) -> bytes:
    """The digest of one side of a fetch (module docstring's stream).

    ``kv``: the pool as ``[layer, block, byte]`` uint8 (``KvPool.kv_bytes_view``);
    ``layers``: the pool's own layer ids ``[begin, end)``; ``blocks``: this side's
    block ids in the fetch's order; ``ranges``: (offsets, lengths) of the byte ranges
    inside a block, this side's offsets (None: the whole block); ``aux``: the aux
    payload's bytes in this side's slot (None: the fetch took none).
    """
    num_layers, num_blocks, block_bytes = kv.shape
    pool = _native(kv)
    flat = pool.reshape(num_layers * num_blocks, block_bytes)
    cpu = isinstance(flat, np.ndarray)
    nb = int(blocks.size)
    ids = np.ascontiguousarray(blocks, dtype=np.int64)
    inner: np.ndarray | None = None
    per_unit = block_bytes
    if ranges is not None:
        offs, lens = ranges
        # every byte offset of the ranges, in order (np.repeat: no per-range loop)
        starts = np.repeat(offs - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
        inner = starts + np.arange(int(lens.sum()), dtype=np.int64)
        per_unit = int(lens.sum())
    inner_t = None if inner is None or cpu else torch.from_numpy(inner).to(kv.device)
    d = Digest()
    step = max(1, _STEP_BYTES["cpu" if cpu else "cuda"] // max(1, per_unit))
    lb, le = layers
    units = (le - lb) * nb  # (layer, block) pairs in stream order
    for u0 in range(0, units, step):
        u = np.arange(u0, min(units, u0 + step), dtype=np.int64)
        rows = (lb + u // nb) * num_blocks + ids[u % nb]
        if cpu:
            chunk = flat[rows] if inner is None else flat[rows[:, None], inner[None, :]]
        else:
            chunk = flat.index_select(0, torch.from_numpy(rows).to(kv.device))
            if inner_t is not None:
                chunk = chunk.index_select(1, inner_t)
        d.update(chunk)
    if aux is not None and aux.numel():
        d.update(aux)
    return d.finish()
