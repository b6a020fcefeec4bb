"""The topology record: consistency, the wire, the compatibility hash and the layout read from strides."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvxferd.transfer.topology import (
    Topology,
    compat_hash,
    even_layer_bounds,
    instance_ranks,
    layout_of,
    make_topology,
)

pytestmark = pytest.mark.timeout(30)

COMPAT = compat_hash(2, "llama-3-8b", "float16", 8, 8, 128, 2)


def _t(**kw: object) -> Topology:
    args: dict[str, object] = dict(
        compat=COMPAT,
        tp_rank=0,
        tp_size=2,
        num_layers=8,
        kv_heads_total=8,
        head_size=128,
        tokens_per_block=16,
        elem_bytes=2,
    )
    args.update(kw)
    return make_topology(**args)  # type: ignore[arg-type]


class TestRecord:
    def test_derived_fields(self) -> None:
        """make_topology fills the rank's heads, layers and replication from TP/PP."""
        t = _t(tp_rank=1, tp_size=4, pp_stage=1, pp_size=2)
        assert (t.kv_heads, t.head_range, t.replicated) == (2, (2, 4), False)
        assert (t.layer_begin, t.layer_end, t.rank) == (4, 8, 5)
        assert t.block_bytes == 2 * 2 * 16 * 128 * 2

    def test_gqa_replication(self) -> None:
        """Above kv_heads_total, TP ranks hold one head each, tp_size // heads ranks per head."""
        ranks = [_t(kv_heads_total=2, tp_size=8, tp_rank=r) for r in range(8)]
        assert [t.head_range for t in ranks] == [(0, 1)] * 4 + [(1, 2)] * 4
        assert all(t.replicated and t.kv_heads == 1 and t.replicas == 4 for t in ranks)

    def test_mla_holds_every_head_everywhere(self) -> None:
        """MLA's latent (one plane) is replicated on every TP rank."""
        t = _t(kv_heads_total=1, kv_planes=1, tp_size=4, tp_rank=3, head_size=576)
        assert (t.head_range, t.kv_heads, t.replicated, t.replicas) == ((0, 1), 1, True, 4)

    def test_even_layer_bounds_like_vllm(self) -> None:
        """The remainder goes one each to the stages before the last, as vLLM's get_pp_indices."""
        assert even_layer_bounds(8, 2) == (0, 4, 8)
        assert even_layer_bounds(10, 4) == (0, 2, 5, 8, 10)
        with pytest.raises(ValueError):
            even_layer_bounds(2, 3)

    def test_instance_ranks(self) -> None:
        """One record describes its whole instance: every (stage, TP rank) with its layers."""
        ranks = instance_ranks(_t(tp_size=2, pp_size=2, pp_stage=1, tp_rank=0))
        assert [(t.rank, t.pp_stage, t.tp_rank, t.layer_begin) for t in ranks] == [
            (0, 0, 0, 0),
            (1, 0, 1, 0),
            (2, 1, 0, 4),
            (3, 1, 1, 4),
        ]

    @pytest.mark.parametrize(
        "change, text",
        [
            ({"kv_heads": 3}, "kv_heads 3"),
            ({"replicated": True}, "replicated must be False"),
            ({"tp_rank": 2}, "tp_rank 2 not below"),
            ({"pp_stage": 1}, "pp_stage 1 not below"),
            ({"layer_begin": 1}, "are not stage 0's"),
            ({"pp_layer_bounds": (0, 9)}, "must rise strictly"),
            ({"pp_layer_bounds": (0, 4, 8)}, "has 3 entries"),
            ({"kv_heads_total": 7, "kv_heads": 3}, "not divisible"),
        ],
    )
    def test_inconsistent_records_cannot_exist(self, change: dict[str, object], text: str) -> None:
        """A record whose heads or layers disagree with its TP/PP raises, naming the field."""
        good = _t()
        with pytest.raises(ValueError, match=text):
            msgspec.structs.replace(good, **change)

    def test_gqa_tp_not_multiple_refused(self) -> None:
        """tp_size above the head count must be a multiple of it (otherwise heads split unevenly)."""
        with pytest.raises(ValueError, match="multiple"):
            _t(kv_heads_total=2, tp_size=3)


class TestWire:
    def test_roundtrip(self) -> None:
        """A record survives msgpack unchanged."""
        t = _t(tp_size=4, tp_rank=2, pp_size=2, pp_stage=1, layout="tokens_major")
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Topology) == t

    def test_inconsistent_record_is_a_decode_error(self) -> None:
        """A peer's inconsistent record fails to decode (MALFORMED), it never reaches the mapping."""
        raw = msgspec.to_builtins(_t())
        raw["kv_heads"] = 8
        with pytest.raises(msgspec.ValidationError, match="kv_heads 8"):
            msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Topology)

    @pytest.mark.parametrize(
        "field, value",
        [
            ("tp_size", 0),
            ("tp_size", 5000),
            ("head_size", 0),
            ("elem_bytes", 9),
            ("kv_planes", 3),
            ("layout", "blocks_major"),
            ("compat", "xyz"),
            ("pp_layer_bounds", list(range(5000))),
        ],
    )
    def test_bounds(self, field: str, value: object) -> None:
        """Every field is bounded on decode."""
        raw = msgspec.to_builtins(_t())
        raw[field] = value
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Topology)

    def test_unknown_field_refused(self) -> None:
        """forbid_unknown_fields: an extra key is a decode error."""
        raw = msgspec.to_builtins(_t())
        raw["extra"] = 1
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Topology)


class TestCompat:
    BASE = dict(
        protocol_version=2,
        model="m",
        dtype="float16",
        num_layers=8,
        kv_heads_total=8,
        head_size=128,
        kv_planes=2,
    )

    @pytest.mark.parametrize(
        "change",
        [
            {"protocol_version": 3},
            {"model": "m2"},
            {"dtype": "bfloat16"},
            {"num_layers": 9},
            {"kv_heads_total": 4},
            {"head_size": 64},
            {"kv_planes": 1},
        ],
    )
    def test_every_exact_field_changes_the_hash(self, change: dict[str, object]) -> None:
        """Each field that must match exactly changes the hash."""
        a = compat_hash(**self.BASE)  # type: ignore[arg-type]
        b = compat_hash(**{**self.BASE, **change})  # type: ignore[arg-type]
        assert a != b and len(a) == len(b) == 32

    def test_geometry_is_not_in_the_hash(self) -> None:
        """TP, PP, tokens per block and layout are negotiated, so two ranks' records share compat."""
        a = _t(tp_size=1, tp_rank=0, layout="heads_major", tokens_per_block=16)
        b = _t(
            tp_size=4, tp_rank=3, pp_size=2, pp_stage=1, layout="tokens_major", tokens_per_block=32
        )
        assert a.compat == b.compat

    def test_unknown_dtype(self) -> None:
        """A dtype without a known element size is refused."""
        with pytest.raises(ValueError, match="dtype"):
            compat_hash(**{**self.BASE, "dtype": "float64"})  # type: ignore[arg-type]


class TestLayoutOf:
    P, H, T, D = 2, 4, 16, 8

    def test_heads_major(self) -> None:
        """A dense [blocks, planes, heads, tokens, head_size] tensor is heads-major."""
        t = torch.zeros(10, self.P, self.H, self.T, self.D)
        assert layout_of(t, self.P, self.H, self.T, self.D) == "heads_major"
        assert (
            layout_of(
                torch.zeros(3, 10, self.P, self.H, self.T, self.D), self.P, self.H, self.T, self.D
            )
            == "heads_major"
        )

    def test_tokens_major_seen_through_a_permuted_view(self) -> None:
        """Memory [.., planes, tokens, heads, d] viewed as [.., planes, heads, tokens, d] is tokens-major."""
        mem = torch.zeros(10, self.P, self.T, self.H, self.D)
        view = mem.permute(0, 1, 3, 2, 4)
        assert view.shape[-4:] == (self.P, self.H, self.T, self.D)
        assert layout_of(view, self.P, self.H, self.T, self.D) == "tokens_major"

    def test_single_head_is_either(self) -> None:
        """With one head both orders are the same bytes; the strides of size-1 dims do not matter."""
        mem = torch.zeros(10, self.P, self.T, 1, self.D).permute(0, 1, 3, 2, 4)
        assert layout_of(mem, self.P, 1, self.T, self.D) == "heads_major"

    @pytest.mark.parametrize(
        ("memory", "kind"),
        [
            ("HPT", "heads_planes_tokens"),
            ("HTP", "heads_tokens_planes"),
            ("THP", "tokens_heads_planes"),
            ("TPH", "tokens_planes_heads"),
        ],
    )
    def test_planes_inside_heads_or_tokens(self, memory: str, kind: str) -> None:
        """Memory with K and V inside each head or token (vLLM's [H, N, 2 * D] blocks) is named by its order."""
        sizes = {"P": self.P, "H": self.H, "T": self.T}
        mem = torch.zeros(10, *(sizes[d] for d in memory), self.D)
        view = mem.permute(0, *(1 + memory.index(d) for d in "PHT"), 4)
        assert view.shape[-4:] == (self.P, self.H, self.T, self.D)
        assert layout_of(view, self.P, self.H, self.T, self.D) == kind

    @pytest.mark.parametrize(
        "make",
        [
            # head_size not innermost
            lambda P, H, T, D: torch.zeros(10, P, H, D, T).transpose(-1, -2),
            # planes innermost of the block (K and V interleaved)
            lambda P, H, T, D: torch.zeros(10, H, T, D, P).permute(0, 4, 1, 2, 3),
            # padded tokens
            lambda P, H, T, D: torch.zeros(10, P, H, T + 1, D)[..., :T, :],
            # blocks outermost of the planes: K of all blocks, then V (not a dense block)
            lambda P, H, T, D: torch.zeros(P, 10, H, T, D).transpose(0, 1),
        ],
    )
    def test_neither_is_refused(self, make: object) -> None:
        """Strides that are neither dense order raise, naming what they are."""
        t = make(self.P, self.H, self.T, self.D)  # type: ignore[operator]
        with pytest.raises(ValueError, match="no dense layout|whole number"):
            layout_of(t, self.P, self.H, self.T, self.D)

    def test_wrong_shape(self) -> None:
        """A tensor whose trailing dims are not the declared geometry is refused."""
        with pytest.raises(ValueError, match="does not end in"):
            layout_of(
                torch.zeros(10, self.P, self.H, self.T, self.D), self.P, self.H * 2, self.T, self.D
            )
