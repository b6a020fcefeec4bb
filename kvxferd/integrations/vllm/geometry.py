"""vLLM's KV blocks <-> the daemon's pool, and the ``[pool]`` a model needs.

vLLM allocates one tensor per attention layer; one of its dimensions indexes
the blocks (found by its size and stride, never assumed: the CPU backend
allocates ``[num_blocks, kv_heads, block_size, 2 * head_size]``, CUDA backends
put K/V first, and so on). A vLLM block of one layer is everything at one index
of that dimension: K and V, every head. It is copied whole, in the tensor's own
element order, into one pool block of that layer, so the pool must be::

    num_layers  = the model's attention layers
    block_elems = the elements of one block of one layer (2 * kv_heads * block_size * head_size)
    dtype       = vLLM's KV cache dtype

Both sides of a transfer run the same model on the same vLLM, so the bytes a
prefill instance copies out are the bytes its decode instance copies back in.

**Zero copy** (``zero_copy = true``, required on CUDA): vLLM's KV tensors are
re-seated onto the daemon's pool (``Tensor.set_`` on the very tensor objects
vLLM's attention layers hold, contents copied once), so vLLM computes into and
reads from memory the daemon registered with NIXL, and a transfer moves vLLM's
own blocks. Each layer's tensor, in its physical (stride) order, must be
``[planes..., blocks, inner...]`` and dense: the dimensions with a larger stride
than the block dimension are *planes* (K and V on CUDA backends), those with a
smaller one make up a block. Plane ``p`` of layer ``l`` becomes pool layer
``l * planes + p``, and vLLM block ``b`` is pool block ``b``::

    num_layers  = layers x planes        (CPU backend: planes = 1, the same pool as above)
    block_elems = the elements of one block of one plane
    num_blocks  >= vLLM's blocks; the pool's blocks past vLLM's are the connector's
                   scratch (prefix-cache hits of a load, releases of unused remote KV)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvxferd.engine.engine_protocol import PoolInfo
from kvxferd.errors import ConfigError
from kvxferd.transfer.topology import (
    DTYPE_BYTES,
    LayoutKind,
    Topology,
    compat_hash,
    even_layer_bounds,
    make_topology,
)

_POOL_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
# fp8 KV caches move as bytes.
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _POOL_DTYPES[getattr(torch, _name)] = "uint8"
_CONFIG_DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
}

RECORD_WIRE_VERSION = 3  # the protocol version the topology record was defined in


@dataclass(frozen=True, slots=True)
class ModelShard:
    """What vLLM says of the model and of this worker's shard of it (the record's inputs)."""

    model_id: str  # the model's identity both instances must share (in the compat hash)
    backend: str  # the attention backend's name (its reading of a block is in the hash)
    num_layers: int  # attention layers of the whole model
    kv_heads_total: int
    kv_heads: int  # this worker's KV heads
    head_size: int
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1
    pp_layer_bounds: tuple[int, ...] = ()  # every stage's first layer, then num_layers
    zero_copy: bool = False

    @property
    def rank(self) -> int:
        """The worker's rank in its instance: ``pp_stage * tp_size + tp_rank``."""
        return self.pp_stage * self.tp_size + self.tp_rank


@dataclass(frozen=True, slots=True)
class PoolShape:
    """The ``[pool]`` values a daemon needs for one model and block size."""

    num_layers: int
    block_elems: int
    dtype: str

    def toml(self, num_blocks: int, comment: str = "") -> str:
        """The ``[pool]`` section (what ``pool-config`` prints)."""
        head = f"# {comment}\n" if comment else ""
        return (
            f"{head}[pool]\n"
            f"num_layers = {self.num_layers}\n"
            f"num_blocks = {num_blocks}\n"
            f"block_elems = {self.block_elems}\n"
            f'dtype = "{self.dtype}"\n'
        )


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True, slots=True)
class _Layer:
    name: str
    kv: torch.Tensor  # vLLM's tensor, as allocated
    block_dim: int


class KvGeometry:
    """vLLM's per-layer KV tensors, the dimension that indexes blocks, and copies to/from the pool."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors")
        self.num_blocks = num_blocks
        layers = []
        for name in sorted(kv_caches, key=_natural):  # the same order on every instance
            t = kv_caches[name]
            layers.append(_Layer(name, t, _block_dim(name, t, num_blocks)))
        first = layers[0]
        self.block_shape = _without(first.kv.shape, first.block_dim)
        self.torch_dtype = first.kv.dtype
        for lay in layers[1:]:
            if (
                _without(lay.kv.shape, lay.block_dim) != self.block_shape
                or lay.kv.dtype != self.torch_dtype
            ):
                raise ConfigError(
                    f"KV layers differ ({first.name}: {tuple(first.kv.shape)} {first.kv.dtype}, "
                    f"{lay.name}: {tuple(lay.kv.shape)} {lay.kv.dtype}); kvxferd moves uniform layers only"
                )
        if self.torch_dtype not in _POOL_DTYPES:
            raise ConfigError(f"KV cache dtype {self.torch_dtype} has no kvxferd pool dtype")
        self.layers = layers
        self.index = {lay.name: i for i, lay in enumerate(layers)}  # layer name -> pool layer
        self.block_elems = math.prod(self.block_shape)
        self.block_bytes = self.block_elems * self.torch_dtype.itemsize
        self.shape = PoolShape(len(layers), self.block_elems, _POOL_DTYPES[self.torch_dtype])

    # -- zero copy ----------------------------------------------------------------------
    def resident_shape(self) -> PoolShape:
        """The ``[pool]`` shape that holds vLLM's tensors as they are (zero copy)."""
        planes, inner = _planes(self.layers[0])
        for lay in self.layers[1:]:
            if _planes(lay) != (planes, inner):
                raise ConfigError(
                    f"KV layers {self.layers[0].name} and {lay.name} differ in layout"
                )
        return PoolShape(len(self.layers) * planes, inner, _POOL_DTYPES[self.torch_dtype])

    def check_resident(self, info: PoolInfo, role: str) -> None:
        """ConfigError naming the ``[pool]`` values needed unless vLLM's tensors can live in the pool."""
        lay = info.layout
        need = self.resident_shape()
        dev = self.layers[0].kv.device.type
        problems = []
        if info.device != dev:
            problems.append(f'device = "{info.device}", needs "{dev}" (where vLLM\'s KV cache is)')
        if lay.num_layers != need.num_layers:
            problems.append(f"num_layers = {lay.num_layers}, needs {need.num_layers}")
        if (
            lay.block_bytes != need.block_elems * self.torch_dtype.itemsize
            or lay.dtype != need.dtype
        ):
            have = lay.block_bytes // max(1, _itemsize(lay.dtype))
            problems.append(
                f'block_elems = {have} dtype = "{lay.dtype}", needs {need.block_elems} "{need.dtype}"'
            )
        if lay.num_blocks < self.num_blocks:
            problems.append(
                f"num_blocks = {lay.num_blocks}, needs at least vLLM's {self.num_blocks} "
                "(plus scratch blocks: one longest request)"
            )
        if problems:
            raise ConfigError(
                f"zero_copy: the {role} daemon's [pool] cannot hold vLLM's KV cache "
                f"({'; '.join(problems)}). Set in its configuration:\n"
                f"{need.toml(max(lay.num_blocks, self.num_blocks))}"
                "(and pin vLLM's block count with num_gpu_blocks_override)"
            )

    def seat(self, pool: torch.Tensor, pool_blocks: int) -> None:
        """Move every vLLM KV tensor onto the pool (``[layers, blocks, bytes]``), contents included.

        ``set_`` keeps each tensor object (vLLM's attention layers hold them), so
        from now on vLLM reads and writes the pool. Call between forwards only.
        """
        storage = pool.untyped_storage()
        base = pool.storage_offset() * pool.element_size()
        item = self.torch_dtype.itemsize
        planes, inner = _planes(self.layers[0])
        layer_bytes = pool_blocks * inner * item  # one pool layer
        for i, lay in enumerate(self.layers):
            t = lay.kv
            unit = self.num_blocks * inner  # elements of one vLLM plane
            stride = [
                s if s <= t.stride(lay.block_dim) else s // unit * pool_blocks * inner
                for s in t.stride()
            ]
            offset = base + i * planes * layer_bytes
            seated = torch.empty((0,), dtype=t.dtype, device=t.device)
            seated.set_(storage, offset // item, tuple(t.shape), tuple(stride))
            seated.copy_(t)
            t.set_(storage, offset // item, tuple(t.shape), tuple(stride))

    def describe(self) -> str:
        lay = self.layers[0]
        return (
            f"{len(self.layers)} layers like {lay.name}: shape {tuple(lay.kv.shape)} strides "
            f"{lay.kv.stride()} {lay.kv.dtype}, blocks on dim {lay.block_dim}, "
            f"{self.block_bytes} bytes per block per layer"
        )

    def check_pool(self, info: PoolInfo, blocks_per_request: int, role: str) -> None:
        """ConfigError naming the ``[pool]`` values needed unless the daemon's pool fits."""
        lay = info.layout
        need = self.shape
        if info.device != "cpu":
            raise ConfigError(
                f"the {role} daemon's pool is on {info.device}; the vLLM connector copies through "
                'a CPU pool: set [pool] device = "cpu", or zero_copy = true in '
                "kv_connector_extra_config to seat vLLM's KV cache on it"
            )
        problems = []
        if lay.num_layers != need.num_layers:
            problems.append(f"num_layers = {lay.num_layers}, needs {need.num_layers}")
        if lay.block_bytes != self.block_bytes or lay.dtype != need.dtype:
            have = lay.block_bytes // max(1, _itemsize(lay.dtype))
            problems.append(
                f'block_elems = {have} dtype = "{lay.dtype}", needs {need.block_elems} "{need.dtype}"'
            )
        if lay.num_blocks < blocks_per_request:
            problems.append(
                f"num_blocks = {lay.num_blocks}, needs at least {blocks_per_request} (one longest request)"
            )
        if problems:
            raise ConfigError(
                f"the {role} daemon's [pool] does not fit this model ({'; '.join(problems)}). "
                f"Set in its configuration:\n{need.toml(max(lay.num_blocks, blocks_per_request))}"
                f"(python -m kvxferd.integrations.vllm pool-config prints this section)"
            )

    # -- the topology record ------------------------------------------------------------
    def topology(self, model: ModelShard) -> Topology:
        """This worker's record (kvxferd/transfer/topology.py): how its pool holds its shard of the KV.

        vLLM's KV tensor of a layer is ``[blocks, kv_heads, block_size, 2 * head_size]``
        (vLLM's logical ``[B, H, N, C]``), whatever its memory order. In copy mode a pool
        block is that block in logical order ``[H, N, C]``; in zero copy it is the block
        in memory order (``[H, N, C]`` or ``[N, H, C]``, read from the strides). What
        ``C`` holds is the attention backend's choice: the CPU backend reads each head's
        ``[N, 2 * D]`` as ``[2, N, D]`` (K rows, then V rows), the others split ``C`` into
        K and V side by side. ConfigError when the tensors are not of that shape.
        """
        lay = self.layers[0]
        want = (model.kv_heads, model.block_size, 2 * model.head_size)
        if lay.block_dim != 0 or tuple(lay.kv.shape[1:]) != want:
            raise ConfigError(
                f"vLLM's KV tensor {lay.name} {tuple(lay.kv.shape)} (blocks on dim "
                f"{lay.block_dim}) is not [blocks, kv_heads, block_size, 2 * head_size] = "
                f"[{self.num_blocks}, {want[0]}, {want[1]}, {want[2]}]: no topology record"
            )
        heads_outer = True
        if model.zero_copy:
            _, inner = _planes(lay)
            if inner != self.block_elems:
                raise ConfigError(
                    f"zero_copy: vLLM's KV tensor {lay.name} strides {lay.kv.stride()} split a "
                    "block over pool layers: no topology record"
                )
            heads_outer = lay.kv.stride(1) > lay.kv.stride(2)
        layout: LayoutKind
        if model.backend == "CPU_ATTN":
            if not heads_outer:
                raise ConfigError("the CPU attention backend needs heads outermost in a block")
            layout = "heads_planes_tokens"
        else:
            layout = "heads_tokens_planes" if heads_outer else "tokens_heads_planes"
        bounds = model.pp_layer_bounds or even_layer_bounds(model.num_layers, model.pp_size)
        first, end = bounds[model.pp_stage], bounds[model.pp_stage + 1]
        if end - first != len(self.layers):
            raise ConfigError(
                f"pipeline stage {model.pp_stage} holds layers [{first}, {end}) by vLLM's "
                f"partition, but {len(self.layers)} KV tensors were registered"
            )
        name = str(self.torch_dtype).removeprefix("torch.")
        dtype = name if name in DTYPE_BYTES else self.shape.dtype
        compat = compat_hash(
            # The record's wire format, unchanged since protocol version 3: not the newest
            # version, or a prefill and a decode of consecutive releases never pair.
            RECORD_WIRE_VERSION,
            f"vllm:{model.model_id}:{model.backend}",
            dtype,
            model.num_layers,
            model.kv_heads_total,
            model.head_size,
            2,
        )
        try:
            return make_topology(
                compat=compat,
                tp_rank=model.tp_rank,
                tp_size=model.tp_size,
                pp_stage=model.pp_stage,
                pp_size=model.pp_size,
                num_layers=model.num_layers,
                kv_heads_total=model.kv_heads_total,
                head_size=model.head_size,
                tokens_per_block=model.block_size,
                elem_bytes=self.torch_dtype.itemsize,
                kv_planes=2,
                layout=layout,
                pp_layer_bounds=bounds,
            )
        except ValueError as e:
            raise ConfigError(f"vLLM's parallel layout has no topology record: {e}") from None

    # -- copies (the engine thread; the pool blocks are the connector's own) ----------------
    def save(self, pool: torch.Tensor, block_ids: list[int], pool_ids: list[int]) -> None:
        """Copy vLLM blocks ``block_ids`` of every layer into pool blocks ``pool_ids``."""
        src = torch.tensor(block_ids, dtype=torch.long)
        dst = torch.tensor(pool_ids, dtype=torch.long)
        n = len(block_ids)
        for i, lay in enumerate(self.layers):
            rows = lay.kv.index_select(lay.block_dim, src).movedim(lay.block_dim, 0)
            pool[i].index_copy_(
                0, dst, rows.contiguous().view(torch.uint8).reshape(n, self.block_bytes)
            )

    def save_layer(
        self, pool: torch.Tensor, layer: int, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy vLLM blocks ``src`` of one layer into pool blocks ``dst`` of that pool layer
        (index tensors made once per step: a streamed save copies layer by layer, inside the
        forward). A block that is one dense row of vLLM's tensor (the CPU backend's layout)
        is gathered as 8-byte words: five times faster than bytes (880 KiB: 140 us, 750 us)."""
        lay = self.layers[layer]
        t = lay.kv
        if (
            lay.block_dim == 0
            and t.is_contiguous()
            and self.block_bytes % 8 == 0
            and t.storage_offset() * t.element_size() % 8 == 0
        ):
            words = t.view(t.shape[0], -1).view(torch.int64).index_select(0, src)
            pool[layer].view(torch.int64).index_copy_(0, dst, words)
            return
        rows = t.index_select(lay.block_dim, src).movedim(lay.block_dim, 0)
        pool[layer].index_copy_(
            0, dst, rows.contiguous().view(torch.uint8).reshape(len(src), self.block_bytes)
        )

    def load(self, pool: torch.Tensor, pool_ids: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks ``pool_ids`` of every layer into vLLM blocks ``block_ids``."""
        src = torch.tensor(pool_ids, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long)
        n = len(block_ids)
        for i, lay in enumerate(self.layers):
            rows = pool[i].index_select(0, src).view(self.torch_dtype).reshape(n, *self.block_shape)
            lay.kv.index_copy_(lay.block_dim, dst, rows.movedim(0, lay.block_dim))


def _without(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return tuple(s for i, s in enumerate(shape) if i != dim)


def _itemsize(dtype: str) -> int:
    return {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4}.get(dtype, 1)


def _planes(lay: _Layer) -> tuple[int, int]:
    """(planes, elements per block of a plane) of a layer laid out ``[planes..., blocks, inner...]``."""
    t = lay.kv
    bs = t.stride(lay.block_dim)
    dims = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expect = 1
    for d in dims:  # dense: each stride is the product of the sizes below it
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expect:
            raise ConfigError(
                f"zero_copy: KV tensor {lay.name} {tuple(t.shape)} strides {t.stride()} is not dense"
            )
        expect *= t.shape[d]
    inner = bs
    planes = math.prod(t.shape[d] for d in range(t.dim()) if t.stride(d) > bs)
    return planes, inner


def _block_dim(name: str, t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of ``t`` that indexes blocks: size ``num_blocks``, the largest stride if several."""
    dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
    if not dims:
        raise ConfigError(
            f"KV tensor {name} {tuple(t.shape)} has no dimension of {num_blocks} blocks"
        )
    return max(dims, key=lambda d: t.stride(d))


# -- the [pool] a model needs, from its config.json (no vLLM needed) -----------------------
def model_pool_shape(
    model_dir: str | Path,
    block_size: int,
    dtype: str | None = None,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    pp_stage: int = 0,
) -> PoolShape:
    """The pool shape for a Hugging Face model directory (its config.json) and a vLLM block
    size, for one worker of an instance of ``tp_size`` x ``pp_size`` (its KV heads, its
    stage's layers as vLLM partitions them by default)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model: cannot read {path}: {e}") from None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("kv_lora_rank"):
        raise ConfigError("MLA models (kv_lora_rank) are not supported by this connector yet")
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: missing or bad field {e}") from None
    name = (
        dtype
        if dtype not in (None, "auto")
        else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    )
    if name not in _CONFIG_DTYPES and name not in ("uint8", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise ConfigError(f"--dtype {name!r}: not a KV cache dtype kvxferd moves")
    pool_dtype = _CONFIG_DTYPES.get(name, "uint8")
    if tp_size < 1 or (tp_size <= kv_heads and kv_heads % tp_size):
        raise ConfigError(f"--tensor-parallel-size {tp_size} does not split {kv_heads} KV heads")
    if tp_size > kv_heads and tp_size % kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {tp_size} above {kv_heads} KV heads must be a multiple of it"
        )
    try:
        bounds = even_layer_bounds(layers, pp_size)
    except ValueError as e:
        raise ConfigError(f"--pipeline-parallel-size: {e}") from None
    stage_layers = bounds[pp_stage + 1] - bounds[pp_stage]
    heads = max(1, kv_heads // tp_size)
    return PoolShape(stage_layers, 2 * heads * block_size * head_dim, pool_dtype)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
