"""Address arithmetic and descriptor coalescing (layout.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.layout import Layout, check_blocks, check_layers, write_descriptors

L = Layout(
    num_layers=3, num_blocks=32, block_bytes=128, dtype="uint8", aux_slots=4, aux_slot_bytes=64
)


def _expand(descs: np.ndarray) -> list[tuple[int, int]]:
    """Byte ranges covered by descriptors, split into single blocks."""
    out = []
    for addr, length, _ in descs.tolist():
        out.extend(
            (addr + k * L.block_bytes, L.block_bytes) for k in range(length // L.block_bytes)
        )
    return out


def test_block_address_formula() -> None:
    """Block b of layer l lives at base + (l * num_blocks + b) * block_bytes."""
    src, dst = write_descriptors(L, 1000, np.array([5]), 9000, np.array([7]), 2, 3)
    assert src.tolist() == [[1000 + (2 * 32 + 5) * 128, 128, 0]]
    assert dst.tolist() == [[9000 + (2 * 32 + 7) * 128, 128, 0]]


def test_contiguous_runs_coalesce_into_one_descriptor_per_layer() -> None:
    """Runs that are contiguous on both sides become one descriptor per layer."""
    src, dst = write_descriptors(L, 0, np.arange(4, 12), 0, np.arange(20, 28), 0, 3)
    assert src.shape == (3, 3)
    assert (src[:, 1] == 8 * 128).all()


def test_a_break_on_either_side_splits_the_run() -> None:
    """A gap in the destination ids splits a contiguous source run."""
    src, dst = write_descriptors(L, 0, np.array([1, 2, 3]), 0, np.array([5, 6, 9]), 0, 1)
    assert src[:, 1].tolist() == [256, 128]
    assert dst[:, 0].tolist() == [5 * 128, 9 * 128]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 16),
    data=st.data(),
    layers=st.tuples(st.integers(0, 2), st.integers(1, 3)).filter(lambda t: t[0] < t[1]),
)
def test_coalesced_and_plain_descriptors_cover_the_same_bytes(n: int, data, layers) -> None:  # type: ignore[no-untyped-def]
    """Coalescing never changes which bytes move where."""
    src_ids = np.array(data.draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True)))
    dst_ids = np.array(data.draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True)))
    a = write_descriptors(L, 0, src_ids, 1 << 20, dst_ids, *layers, coalesce=True)
    b = write_descriptors(L, 0, src_ids, 1 << 20, dst_ids, *layers, coalesce=False)
    assert sorted(zip(_expand(a[0]), _expand(a[1]), strict=False)) == sorted(
        zip(_expand(b[0]), _expand(b[1]), strict=False)
    )


@pytest.mark.parametrize(
    "ids", [np.array([], dtype=np.int64), np.array([-1]), np.array([32]), np.array([3, 3])]
)
def test_bad_block_ids_are_refused_with_bad_blocks(ids: np.ndarray) -> None:
    """Empty, negative, out-of-pool and repeated ids are refused with BAD_BLOCKS."""
    with pytest.raises(RejectedError) as e:
        check_blocks(L, ids, "x")
    assert e.value.reason is Reason.BAD_BLOCKS


@pytest.mark.parametrize("rng", [(0, 0), (2, 1), (0, 4), (-1, 2)])
def test_bad_layer_ranges_are_refused(rng: tuple[int, int]) -> None:
    """Empty, reversed or out-of-pool layer ranges are refused."""
    with pytest.raises(RejectedError):
        check_layers(L, *rng)


def test_destination_layers_use_the_destination_pool_stride() -> None:
    """A receiver pool with more blocks per layer gets each layer at its own layer offset."""
    big = 64 * L.block_bytes  # the destination pool holds 64 blocks per layer, ours 32
    src, dst = write_descriptors(L, 0, np.array([1]), 0, np.array([2]), 0, 3, dst_layer_stride=big)
    assert dst[:, 0].tolist() == [2 * 128, big + 2 * 128, 2 * big + 2 * 128]
    assert src[:, 0].tolist() == [128, 32 * 128 + 128, 64 * 128 + 128]
