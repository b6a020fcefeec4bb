"""The per-request digest: two 64-bit lanes over the bytes a fetch's writes moved, in their order.

A fetch that asks for it (``RequestData.digest``) gets a 16-byte digest in its done
Result, computed by the sender over the source bytes it wrote; the receiver computes
the same function over what landed in its own blocks and fails the fetch
``digest_mismatch`` when they differ (docs/protocol.md section 4, Result). Both sides run
it with torch on the pool's own device (CPU tensors, or the CUDA pool), chunk by chunk.

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

What it catches, honestly:

* **Always**: any change confined to one 32-bit word (so any single byte): every
  weight is odd and such a change's 2-adic valuation is below 32. Any exchange of two
  words less than 8 GiB apart (a swap of two values): lane A changes by
  ``(w_a - w_b)(x_b - x_a)``, and ``w_a - w_b`` has a valuation of at most 12 (two
  columns) or 14 plus that of the row distance (one column), so the product's stays
  below 64. Lane A alone is linear in the position: a block moved as a whole can
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

import numpy as np
import torch

ROW_WORDS = 4096  # 16 KiB rows: lane B's column weights W(c) stay in cache
ROW_BYTES = ROW_WORDS * 4
DIGEST_BYTES = 16
_STEP_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}  # bytes gathered and reduced at a time
_M64 = (1 << 64) - 1
_K_A, _K_B = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
_W_SEED = 1 << 40  # W(c) = mix(c + _W_SEED): another sequence than U(r) = mix(r)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64, forced odd (numpy's uint64 arithmetic wraps mod 2^64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


def _as_i64(u: np.ndarray) -> np.ndarray:
    return u.view(np.int64)


_weights_lock = threading.Lock()
_weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _column_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(2c + 1, W(c)) for c < ROW_WORDS, as int64 on ``device`` (made once per device)."""
    with _weights_lock:
        got = _weights.get(device)
        if got is None:
            c = np.arange(ROW_WORDS, dtype=np.uint64)
            wa = torch.from_numpy(_as_i64(np.uint64(2) * c + np.uint64(1)).copy()).to(device)
            wb = torch.from_numpy(_as_i64(_mix(c + np.uint64(_W_SEED))).copy()).to(device)
            got = _weights[device] = (wa, wb)
        return got


class Digest:
    """The digest of one stream, fed in order with ``update`` (any split), read by ``finish``."""

    def __init__(self) -> None:
        self._a = 0
        self._b = 0
        self._rows = 0  # rows reduced so far
        self._n = 0  # stream bytes so far
        self._carry: torch.Tensor | None = None  # bytes short of a whole row

    def update(self, data: torch.Tensor) -> None:
        """Append ``data`` (any shape, uint8, any device) to the stream."""
        data = data.reshape(-1)
        self._n += data.numel()
        if self._carry is not None:
            data = torch.cat((self._carry.to(data.device), data))
            self._carry = None
        whole = data.numel() // ROW_BYTES * ROW_BYTES
        if whole < data.numel():
            self._carry = data[whole:].clone()
        if whole:
            self._reduce(data[:whole].contiguous())

    def finish(self) -> bytes:
        """The 16-byte digest (module docstring); the stream's tail padded with zeros."""
        if self._carry is not None:
            tail = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=self._carry.device)
            tail[: self._carry.numel()] = self._carry
            self._carry = None
            self._reduce(tail)
        a = (self._a + self._n * _K_A) & _M64
        b = (self._b + self._n * _K_B) & _M64
        return struct.pack("<QQ", a, b)

    def _reduce(self, data: torch.Tensor) -> None:
        """Fold whole rows (``data``: a multiple of ROW_BYTES bytes, offset 0) into the lanes."""
        wa, wb = _column_weights(data.device)
        x = data.view(torch.int32).view(-1, ROW_WORDS)
        r = np.arange(self._rows, self._rows + x.shape[0], dtype=np.uint64)
        self._rows += x.shape[0]
        ra = torch.from_numpy(_as_i64(r * np.uint64(4 * ROW_WORDS) + np.uint64(1)).copy())
        rb = torch.from_numpy(_as_i64(_mix(r)).copy())
        a = (ra.to(data.device) * (x * wa).sum(1)).sum()
        b = (rb.to(data.device) * (x * wb).sum(1)).sum()
        self._a = (self._a + int(a.item())) & _M64
        self._b = (self._b + int(b.item())) & _M64


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
    dev = kv.device
    flat = kv.reshape(num_layers * num_blocks, block_bytes)
    nb = int(blocks.size)
    ids = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64)).to(dev)
    inner = None
    per_unit = block_bytes
    if ranges is not None:
        offs, lens = ranges
        # every byte offset of the ranges, in order (np.repeat: no per-range loop)
        starts = np.repeat(offs - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
        inner = torch.from_numpy(starts + np.arange(int(lens.sum()), dtype=np.int64)).to(dev)
        per_unit = int(lens.sum())
    d = Digest()
    step = max(1, _STEP_BYTES.get(dev.type, _STEP_BYTES["cuda"]) // max(1, per_unit))
    lb, le = layers
    units = (le - lb) * nb  # (layer, block) pairs in stream order
    for u0 in range(0, units, step):
        u = torch.arange(u0, min(units, u0 + step), dtype=torch.int64, device=dev)
        rows = (lb + torch.div(u, nb, rounding_mode="floor")) * num_blocks + ids[u % nb]
        chunk = flat.index_select(0, rows)
        if inner is not None:
            chunk = chunk.index_select(1, inner)
        d.update(chunk)
    if aux is not None and aux.numel():
        d.update(aux)
    return d.finish()
