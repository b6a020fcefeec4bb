"""Geometry: blocks found by strides, whole-block copies through the pool, the [pool] a model needs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kvxferd.engine.engine_protocol import PoolInfo, PoolLayout
from kvxferd.errors import ConfigError
from kvxferd.integrations.vllm.geometry import KvGeometry, model_pool_shape
from tests_vllm.rig import ROOT

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 10


def cpu_layout(layers: int = 3) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size] per layer."""
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, 2, 4, 16, generator=g)
        for i in range(layers)
    }


def kv_first_layout(layers: int = 3) -> dict[str, torch.Tensor]:
    """A CUDA-style layout: [2 (K, V), num_blocks, block_size, kv_heads, head_size]."""
    g = torch.Generator().manual_seed(1)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g)
        for i in range(layers)
    }


def pool_info(
    num_layers: int, block_bytes: int, dtype: str = "float32", blocks: int = 8
) -> PoolInfo:
    layout = PoolLayout(
        num_layers=num_layers,
        num_blocks=blocks,
        block_bytes=block_bytes,
        dtype=dtype,  # type: ignore[arg-type]
        aux_slots=1,
        aux_slot_bytes=64,
        kv_offset=0,
        aux_offset=num_layers * blocks * block_bytes,
    )
    return PoolInfo(
        call_id=1, role="sender", shm_name="x", shm_bytes=1, layout=layout, device="cpu"
    )


@pytest.mark.parametrize("make", [cpu_layout, kv_first_layout])
def test_blocks_round_trip_through_the_pool(make: object) -> None:
    """Blocks saved from one instance's tensors and loaded into another's are equal, every layer, K and V."""
    src = make()  # type: ignore[operator]
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    g_src, g_dst = KvGeometry(src, NUM_BLOCKS), KvGeometry(dst, NUM_BLOCKS)
    pool = torch.zeros(len(src), 8, g_src.block_bytes, dtype=torch.uint8)
    g_src.save(pool, [7, 2, 5], [0, 3, 1])
    g_dst.load(pool, [0, 3, 1], [1, 8, 4])
    for name in src:
        s, d = src[name], dst[name]
        dim = g_src.layers[0].block_dim
        for a, b in [(7, 1), (2, 8), (5, 4)]:
            assert torch.equal(s.select(dim, a), d.select(dim, b))
        untouched = [i for i in range(NUM_BLOCKS) if i not in (1, 8, 4)]
        assert not d.index_select(dim, torch.tensor(untouched)).any()


@pytest.mark.parametrize("make", [cpu_layout, kv_first_layout])
def test_a_layer_saved_alone_is_the_layer_a_whole_save_writes(make: object) -> None:
    """save_layer (a streamed save, layer by layer; 8-byte words for the CPU layout, the
    generic gather for others) writes each layer's pool blocks exactly as save does."""
    kv = make()  # type: ignore[operator]
    geo = KvGeometry(kv, NUM_BLOCKS)
    whole = torch.zeros(len(kv), 8, geo.block_bytes, dtype=torch.uint8)
    by_layer = torch.zeros_like(whole)
    geo.save(whole, [7, 2, 5], [0, 3, 1])
    src, dst = torch.tensor([7, 2, 5]), torch.tensor([0, 3, 1])
    for layer in range(len(kv)):
        geo.save_layer(by_layer, layer, src, dst)
        assert torch.equal(by_layer[: layer + 1], whole[: layer + 1])
        assert not by_layer[layer + 1 :].any()
    assert geo.index == {name: i for i, name in enumerate(kv)}


def test_block_dimension_comes_from_the_strides() -> None:
    """With two dimensions of num_blocks, the one with the larger stride indexes the blocks."""
    t = torch.zeros(NUM_BLOCKS, 2, NUM_BLOCKS, 4)
    assert KvGeometry({"l0": t}, NUM_BLOCKS).layers[0].block_dim == 0
    assert KvGeometry({"l0": t.permute(2, 1, 0, 3)}, NUM_BLOCKS).layers[0].block_dim == 2


def test_pool_that_fits_is_accepted() -> None:
    """A pool of the model's layers, block bytes and dtype, with room for one request, passes."""
    g = KvGeometry(cpu_layout(), NUM_BLOCKS)
    g.check_pool(pool_info(3, g.block_bytes), blocks_per_request=8, role="sender")


def test_pool_that_does_not_fit_names_the_values_needed() -> None:
    """A pool with other layers, block size or dtype is refused with the [pool] section to set."""
    g = KvGeometry(cpu_layout(), NUM_BLOCKS)
    with pytest.raises(ConfigError) as e:
        g.check_pool(pool_info(8, 2048, "float16"), blocks_per_request=16, role="receiver")
    msg = str(e.value)
    assert "num_layers = 8, needs 3" in msg
    assert "needs 128" in msg  # 2 heads x 4 tokens x 16
    assert "num_blocks = 8, needs at least 16" in msg
    section = tomllib.loads(msg[msg.index("\n[pool]") : msg.index("(python -m")])["pool"]
    assert section == {"num_layers": 3, "num_blocks": 16, "block_elems": 128, "dtype": "float32"}


def test_model_pool_shape_from_config(tmp_path: Path) -> None:
    """pool-config reads layers, kv heads and head_dim from config.json: 2 x kv_heads x block x head_dim elements."""
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,'
        ' "hidden_size": 512, "dtype": "bfloat16"}'
    )
    shape = model_pool_shape(tmp_path, 32)
    assert (shape.num_layers, shape.block_elems, shape.dtype) == (4, 2 * 2 * 32 * 64, "bfloat16")
    assert model_pool_shape(tmp_path, 16, "float32").dtype == "float32"


def test_pool_config_command(tmp_path: Path) -> None:
    """``python -m kvxferd.integrations.vllm pool-config`` prints a [pool] section a daemon loads."""
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,'
        ' "head_dim": 32, "hidden_size": 128, "dtype": "float32"}'
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxferd.integrations.vllm",
            "pool-config",
            "--model",
            str(tmp_path),
            "--block-size",
            "32",
            "--num-blocks",
            "64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert tomllib.loads(out)["pool"] == {
        "num_layers": 2,
        "num_blocks": 64,
        "block_elems": 4096,
        "dtype": "float32",
    }
    from kvxferd.config import PoolSettings

    PoolSettings(**tomllib.loads(out)["pool"])  # the daemon's own settings model accepts it
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxferd.integrations.vllm",
            "pool-config",
            "--model",
            str(tmp_path / "missing"),
            "--block-size",
            "32",
            "--num-blocks",
            "64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "config.json" in bad.stderr
