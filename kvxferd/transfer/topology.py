"""One rank's KV topology: how it shards the model's KV cache (TP, PP, replication) and lays out a block.

A :class:`Topology` is the record a rank declares (at attach, and in REGISTER):
its TP rank and size, its PP stage and that stage's layer range, the KV heads it
holds out of the model's total, the head size, tokens per block, element size,
the number of KV planes (2: K and V; 1: MLA's latent) and the layout of one
layer's block: the order of its planes (P), heads (H) and tokens (T) dimensions,
outermost first, ``head_size`` always innermost and the block dense:

* ``heads_major``         ``[planes, heads, tokens, head_size]``  (PHT)
* ``tokens_major``        ``[planes, tokens, heads, head_size]``  (PTH)
* ``heads_planes_tokens`` ``[heads, planes, tokens, head_size]``  (HPT: vLLM's CPU backend)
* ``heads_tokens_planes`` ``[heads, tokens, planes, head_size]``  (HTP: vLLM's ``[H, N, 2 * D]``
  block with K and V side by side in the last dimension, as FlashAttention reads it)
* ``tokens_heads_planes`` ``[tokens, heads, planes, head_size]``  (THP: the same, ``LBNHC``)
* ``tokens_planes_heads`` ``[tokens, planes, heads, head_size]``  (TPH)

Two layouts are the same bytes when they order their dimensions of size above 1
alike (:meth:`Topology.effective_order`): one head, one token or one plane make
some of them coincide.

The record is self-consistent or it does not exist: ``__post_init__`` checks it
both when built here and when msgspec decodes it from the wire (a peer's
inconsistent record is a decode error, hence MALFORMED, never a wrong mapping).

What must match exactly between two instances (protocol version, model
identity, dtype, total KV heads, head size, layer count, KV planes) is folded
into :func:`compat_hash`, carried as ``compat``; the rest is geometry, which
the mapping (:mod:`kvxferd.transfer.reshard`) reconciles at run time or refuses.

Which heads a rank holds (``head_range``)::

    MLA (kv_planes == 1)         all of them, on every TP rank (replicated latent)
    tp_size <= kv_heads_total    [tp_rank * kv_heads, (tp_rank + 1) * kv_heads)
    tp_size >  kv_heads_total    head tp_rank // (tp_size // kv_heads_total): copies
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol, cast

import msgspec
from msgspec import Meta

LayoutKind = Literal[
    "heads_major",
    "tokens_major",
    "heads_planes_tokens",
    "heads_tokens_planes",
    "tokens_heads_planes",
    "tokens_planes_heads",
]

# Each layout's (planes, heads, tokens) order inside a block, outermost first.
LAYOUT_ORDER: dict[str, str] = {
    "heads_major": "PHT",
    "tokens_major": "PTH",
    "heads_planes_tokens": "HPT",
    "heads_tokens_planes": "HTP",
    "tokens_heads_planes": "THP",
    "tokens_planes_heads": "TPH",
}

_Small = Annotated[int, Meta(ge=0, le=4095)]
_Count = Annotated[int, Meta(ge=1, le=4096)]
_Layer = Annotated[int, Meta(ge=0, le=4096)]

COMPAT_HEX = 32  # hex digits of the compatibility hash (128 bits of sha256)

# Element sizes of the dtypes an engine may declare (the hash takes the name: fp8 e4m3
# and e5m2 are both one byte and still incompatible).
DTYPE_BYTES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}


def compat_hash(
    protocol_version: int,
    model: str,
    dtype: str,
    num_layers: int,
    kv_heads_total: int,
    head_size: int,
    kv_planes: int,
) -> str:
    """The hex digest of what two instances must share exactly to exchange KV at all.

    The geometry that may differ (TP, PP, tokens per block, layout) is left out on
    purpose: the mapping reconciles it or refuses it with its own reason.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    text = "\x1f".join(
        (
            "kvxferd-topology",
            str(protocol_version),
            model,
            dtype,
            str(num_layers),
            str(kv_heads_total),
            str(head_size),
            str(kv_planes),
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:COMPAT_HEX]


class Topology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's shard of the KV cache and its block layout (see the module docstring)."""

    compat: Annotated[str, Meta(pattern=f"^[0-9a-f]{{{COMPAT_HEX}}}$")]
    tp_rank: _Small
    tp_size: _Count
    pp_stage: _Small
    pp_size: _Count
    # Layer boundaries of every PP stage of the instance: stage s holds
    # [pp_layer_bounds[s], pp_layer_bounds[s + 1]). Lets one rank's record describe
    # its whole instance (who else reads, who else holds what).
    pp_layer_bounds: Annotated[tuple[_Layer, ...], Meta(min_length=2, max_length=4097)]
    layer_begin: _Layer
    layer_end: _Layer
    num_layers: _Count
    kv_heads_total: _Count
    kv_heads: _Count
    head_size: Annotated[int, Meta(ge=1, le=65536)]
    tokens_per_block: Annotated[int, Meta(ge=1, le=65536)]
    elem_bytes: Annotated[int, Meta(ge=1, le=8)]
    kv_planes: Annotated[int, Meta(ge=1, le=2)]
    layout: LayoutKind
    replicated: bool

    def __post_init__(self) -> None:
        problem = _inconsistency(self)
        if problem:
            raise ValueError(f"inconsistent topology: {problem}")

    @property
    def rank(self) -> int:
        """The rank's index in its instance: ``pp_stage * tp_size + tp_rank``."""
        return self.pp_stage * self.tp_size + self.tp_rank

    @property
    def mla(self) -> bool:
        return self.kv_planes == 1

    @property
    def replicas(self) -> int:
        """How many TP ranks of a stage hold each head (1: no copies)."""
        if self.mla:
            return self.tp_size
        return max(1, self.tp_size // self.kv_heads_total)

    @property
    def head_range(self) -> tuple[int, int]:
        """The global KV heads this rank holds, ``[begin, end)``."""
        if self.mla:
            return 0, self.kv_heads_total
        if self.tp_size > self.kv_heads_total:
            h = self.tp_rank // self.replicas
            return h, h + 1
        return self.tp_rank * self.kv_heads, (self.tp_rank + 1) * self.kv_heads

    @property
    def block_elems(self) -> int:
        return self.kv_planes * self.kv_heads * self.tokens_per_block * self.head_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's block of this rank."""
        return self.block_elems * self.elem_bytes

    @property
    def num_stage_layers(self) -> int:
        return self.layer_end - self.layer_begin

    def row_strides(self) -> dict[str, int]:
        """Stride of the plane (P), head (H) and token (T) index, in rows of ``head_size``."""
        sizes = self.sizes()
        strides, step = {}, 1
        for dim in reversed(LAYOUT_ORDER[self.layout]):
            strides[dim] = step
            step *= sizes[dim]
        return strides

    def sizes(self) -> dict[str, int]:
        """The block's plane (P), head (H) and token (T) counts."""
        return {"P": self.kv_planes, "H": self.kv_heads, "T": self.tokens_per_block}

    def effective_order(self, other: Topology | None = None) -> str:
        """The layout's order of its dimensions of size above 1 (here and in ``other``):
        "PT" for a one-head heads-major block. Equal effective orders are the same bytes."""
        mine = self.sizes()
        theirs = other.sizes() if other is not None else mine
        return "".join(d for d in LAYOUT_ORDER[self.layout] if mine[d] > 1 and theirs[d] > 1)


def _inconsistency(t: Topology) -> str:
    """Why ``t`` cannot be a real rank's record, or ``""``."""
    if not t.tp_rank < t.tp_size:
        return f"tp_rank {t.tp_rank} not below tp_size {t.tp_size}"
    if not t.pp_stage < t.pp_size:
        return f"pp_stage {t.pp_stage} not below pp_size {t.pp_size}"
    b = t.pp_layer_bounds
    if len(b) != t.pp_size + 1:
        return f"pp_layer_bounds has {len(b)} entries, pp_size {t.pp_size} needs {t.pp_size + 1}"
    if b[0] != 0 or b[-1] != t.num_layers or any(x >= y for x, y in zip(b, b[1:], strict=False)):
        return f"pp_layer_bounds {list(b)} must rise strictly from 0 to num_layers {t.num_layers}"
    if (t.layer_begin, t.layer_end) != (b[t.pp_stage], b[t.pp_stage + 1]):
        return (
            f"layers [{t.layer_begin}, {t.layer_end}) are not stage {t.pp_stage}'s "
            f"[{b[t.pp_stage]}, {b[t.pp_stage + 1]})"
        )
    h, tp = t.kv_heads_total, t.tp_size
    if t.mla:
        want_heads, want_repl = h, True
    elif tp <= h:
        if h % tp:
            return f"kv_heads_total {h} is not divisible by tp_size {tp}"
        want_heads, want_repl = h // tp, False
    else:
        if tp % h:
            return f"tp_size {tp} above kv_heads_total {h} must be a multiple of it"
        want_heads, want_repl = 1, True
    if t.kv_heads != want_heads:
        return f"kv_heads {t.kv_heads} (tp_size {tp}, kv_heads_total {h}) should be {want_heads}"
    if t.replicated != want_repl:
        return f"replicated must be {want_repl} (kv_planes {t.kv_planes}, tp_size {tp}, kv_heads_total {h})"
    return ""


def even_layer_bounds(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Stage boundaries as vLLM partitions layers by default: equal shares, the remainder
    going one each to the stages before the last (``get_pp_indices``)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size {pp_size} must lie in [1, num_layers {num_layers}]")
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p)
    return tuple(bounds)


def make_topology(
    *,
    compat: str,
    tp_rank: int,
    tp_size: int,
    pp_stage: int = 0,
    pp_size: int = 1,
    num_layers: int,
    kv_heads_total: int,
    head_size: int,
    tokens_per_block: int,
    elem_bytes: int,
    kv_planes: int = 2,
    layout: LayoutKind = "heads_major",
    pp_layer_bounds: Sequence[int] | None = None,
) -> Topology:
    """A rank's record with the derived fields (layers, heads, replicated) filled in."""
    bounds = (
        tuple(pp_layer_bounds)
        if pp_layer_bounds is not None
        else even_layer_bounds(num_layers, pp_size)
    )
    if kv_planes == 1:
        heads, repl = kv_heads_total, True
    else:
        heads, repl = max(1, kv_heads_total // tp_size), tp_size > kv_heads_total
    return Topology(
        compat=compat,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_stage=pp_stage,
        pp_size=pp_size,
        pp_layer_bounds=bounds,
        layer_begin=bounds[pp_stage] if pp_stage < len(bounds) else 0,
        layer_end=bounds[pp_stage + 1] if pp_stage + 1 < len(bounds) else 0,
        num_layers=num_layers,
        kv_heads_total=kv_heads_total,
        kv_heads=heads,
        head_size=head_size,
        tokens_per_block=tokens_per_block,
        elem_bytes=elem_bytes,
        kv_planes=kv_planes,
        layout=layout,
        replicated=repl,
    )


def instance_ranks(t: Topology) -> list[Topology]:
    """Every rank's record of ``t``'s instance (ordered by ``rank``), derived from ``t`` alone."""
    b = t.pp_layer_bounds
    return [
        msgspec.structs.replace(t, tp_rank=r, pp_stage=s, layer_begin=b[s], layer_end=b[s + 1])
        for s in range(t.pp_size)
        for r in range(t.tp_size)
    ]


class _Strided(Protocol):
    """What :func:`layout_of` reads from a tensor (torch.Tensor has it)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def stride(self) -> Sequence[int]: ...


def layout_of(
    tensor: _Strided, kv_planes: int, kv_heads: int, tokens: int, head_size: int
) -> LayoutKind:
    """The block layout a KV tensor really has in memory, read from its strides.

    ``tensor``'s logical shape must end in ``[planes, heads, tokens, head_size]``
    (leading dimensions such as layers and blocks are allowed); its strides say
    which of the layouts memory runs in. One block must be dense, and
    blocks must not overlap. Anything else (a padded, transposed or otherwise
    strided view) raises ``ValueError``: the mapping would move the wrong bytes
    (vLLM #37703: a backend that ignored the requested layout broke head slicing).
    """
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    want = (kv_planes, kv_heads, tokens, head_size)
    if len(shape) < 4 or shape[-4:] != want:
        raise ValueError(
            f"KV tensor shape {list(shape)} does not end in [planes, heads, tokens, head_size] = {list(want)}"
        )
    p_s, h_s, t_s, d_s = strides[-4:]
    block = kv_planes * kv_heads * tokens * head_size

    sizes = dict(zip("PHTD", want, strict=True))
    got = dict(zip("PHTD", (p_s, h_s, t_s, d_s), strict=True))

    def expected(kind: str) -> dict[str, int]:
        out, step = {"D": 1}, head_size
        for dim in reversed(LAYOUT_ORDER[kind]):
            out[dim] = step
            step *= sizes[dim]
        return out

    # A dimension of size 1 may carry any stride; of the layouts that fit, the first
    # named wins (they are then the same bytes: see Topology.effective_order).
    fitting = [
        k for k in LAYOUT_ORDER if all(got[d] == e for d, e in expected(k).items() if sizes[d] > 1)
    ]
    if not fitting:
        shown = ", ".join(f"{k} {[expected(k)[d] for d in 'PHTD']}" for k in LAYOUT_ORDER)
        raise ValueError(
            f"KV tensor strides {list(strides[-4:])} for [planes, heads, tokens, head_size] "
            f"{list(want)} match no dense layout ({shown})"
        )
    kind = cast(LayoutKind, fitting[0])
    for size, stride in zip(shape[:-4], strides[:-4], strict=True):
        if size > 1 and (stride < block or stride % block):
            raise ValueError(
                f"KV tensor leading stride {stride} is not a whole number of {block}-element blocks"
            )
    return kind
