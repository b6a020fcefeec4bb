"""The per-request digest: the function itself, and a fetch that checks it over real NIXL.

The function (kvxferd/transfer/digest.py) is checked against a plain numpy reference
of its definition and for what it must always notice (a byte, two words exchanged, a
block in another slot, a layer shifted). The fetches run a real Sender and Receiver in
this process (real ZMQ on loopback, NIXL moving the bytes); a fault is injected where
the receiver's ``digests.landed`` hook runs: after the bytes landed, before the check.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason
from kvxferd.transfer import digest as dg
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.reshard import piece_for, readers_for
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxSession, RxState, TxState
from tests.test_hetero import DEADLINES as HETERO_DEADLINES
from tests.test_hetero import _pool as hetero_pool
from tests.test_topology_reshard import SWEEP, _World

WAIT_S = 15.0
M64 = (1 << 64) - 1


def reference(stream: bytes) -> bytes:
    """The digest as digest.py's docstring defines it, in numpy uint64 (wraps mod 2^64)."""
    n = len(stream)
    padded = stream + b"\0" * (-n % dg.ROW_BYTES)
    x = np.frombuffer(padded, dtype=np.int32).astype(np.int64).view(np.uint64)
    j = np.arange(x.size, dtype=np.uint64)
    r, c = j // np.uint64(dg.ROW_WORDS), j % np.uint64(dg.ROW_WORDS)
    wa = (np.uint64(2) * c + np.uint64(1)) * (np.uint64(4 * dg.ROW_WORDS) * r + np.uint64(1))
    wb = dg._mix(r) * dg._mix(c + np.uint64(dg._W_SEED))
    a, b = int((wa * x).sum()), int((wb * x).sum())
    return struct.pack("<QQ", (a + n * dg._K_A) & M64, (b + n * dg._K_B) & M64)


def mix(x: int) -> int:
    """docs/protocol.md §4.1's mix, in Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) | 1


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _digest(data: torch.Tensor) -> bytes:
    d = dg.Digest()
    d.update(data)
    return d.finish()


# -- the function ---------------------------------------------------------------------------------


def test_the_weights_are_the_documented_mix() -> None:
    """The code's splitmix64 is the one docs/protocol.md spells out (another implementation
    following the document computes the same digest)."""
    xs = [0, 1, 4095, 1 << 40, (1 << 64) - 1]
    got = dg._mix(np.array(xs, dtype=np.uint64)).tolist()
    assert got == [mix(x) for x in xs]


@pytest.mark.parametrize("n", [1, 5, dg.ROW_BYTES, dg.ROW_BYTES + 3, 3 * dg.ROW_BYTES + 17])
def test_digest_is_its_definition_however_the_stream_is_split(n: int) -> None:
    """The torch digest equals the numpy reference of the definition, fed whole or in pieces."""
    data = _bytes(n, seed=n)
    d = dg.Digest()
    for part in torch.tensor_split(data, 3):
        d.update(part)
    assert d.finish() == _digest(data) == reference(data.numpy().tobytes())


def test_a_fetch_digest_is_the_digest_of_its_layers_blocks_ranges_then_aux() -> None:
    """kv_digest is the stream of (layer, block in the fetch's order, range) bytes, then the aux."""
    kv = _bytes(4 * 16 * 1000, seed=1).view(4, 16, 1000)
    blocks = np.array([3, 1, 7, 2])
    whole = b"".join(kv[ly, b].numpy().tobytes() for ly in (1, 2) for b in blocks)
    assert dg.kv_digest(kv, (1, 3), blocks) == reference(whole)
    offs, lens = np.array([100, 0, 500]), np.array([50, 10, 300])
    aux = torch.arange(37, dtype=torch.uint8)
    parts = b"".join(
        kv[ly, b, o : o + n].numpy().tobytes()
        for ly in (1, 2)
        for b in blocks
        for o, n in zip(offs, lens, strict=True)
    )
    got = dg.kv_digest(kv, (1, 3), blocks, (offs, lens), aux)
    assert got == reference(parts + aux.numpy().tobytes())


def test_the_torch_path_computes_the_same_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expressions a CUDA pool runs with torch (here on CPU tensors, numpy views off) give
    the numpy path's digest: a CPU sender and a CUDA receiver agree."""
    kv = _bytes(3 * 8 * 5000, seed=6).view(3, 8, 5000)
    blocks, ranges = np.array([5, 0, 3]), (np.array([4000, 0]), np.array([1000, 2222]))
    aux = torch.arange(99, dtype=torch.uint8)
    want = dg.kv_digest(kv, (0, 3), blocks, ranges, aux), dg.kv_digest(kv, (1, 2), blocks)
    monkeypatch.setattr(dg, "_native", lambda data: data)
    got = dg.kv_digest(kv, (0, 3), blocks, ranges, aux), dg.kv_digest(kv, (1, 2), blocks)
    assert got == want


def test_any_single_byte_change_changes_the_digest() -> None:
    """Each byte of a stream of two rows and a tail, changed alone, changes the digest."""
    data = _bytes(2 * dg.ROW_BYTES + 9, seed=2)
    base = _digest(data)
    for i in range(0, data.numel(), 331):  # every residue of a word, every row
        changed = data.clone()
        changed[i] ^= 0x80 if i % 2 else 0x01
        assert _digest(changed) != base, f"byte {i}"


def test_moved_content_changes_the_digest() -> None:
    """Two words exchanged, two blocks exchanged, a block in another slot, a layer shifted:
    each changes the digest (the stream is position-sensitive, not a sum of its content)."""
    kv = _bytes(3 * 8 * 4096, seed=3).view(3, 8, 4096)
    blocks = np.array([0, 2, 4, 6])
    base = dg.kv_digest(kv, (0, 3), blocks)

    words = kv.clone()
    w = words.view(-1).view(torch.int32)
    w[10], w[5000] = w[5000].clone(), w[10].clone()
    assert dg.kv_digest(words, (0, 3), blocks) != base, "two words exchanged"

    swapped = kv.clone()
    swapped[1, 2], swapped[1, 4] = kv[1, 4].clone(), kv[1, 2].clone()
    assert dg.kv_digest(swapped, (0, 3), blocks) != base, "two blocks exchanged"

    assert dg.kv_digest(kv, (0, 3), np.array([0, 2, 4, 7])) != base, "a block in another slot"

    shifted = kv.clone()
    shifted[1:] = kv[:2].clone()
    assert dg.kv_digest(shifted, (0, 3), blocks) != base, "a layer shifted"


def test_a_permutation_of_equal_sum_blocks_changes_the_digest() -> None:
    """Blocks that are permutations of each other's rows (equal sums, equal weighted sums by
    rows) exchanged: caught by the position-dependent lanes."""
    row = _bytes(dg.ROW_BYTES, seed=4)
    other = _bytes(dg.ROW_BYTES, seed=5)
    kv = torch.stack((torch.cat((row, other)), torch.cat((other, row)))).view(1, 2, -1)
    assert dg.kv_digest(kv, (0, 1), np.array([0, 1])) != dg.kv_digest(kv, (0, 1), np.array([1, 0]))


# -- fetches over real NIXL ----------------------------------------------------------------------

POOL = dict(num_layers=2, num_blocks=16, block_elems=16 << 10, dtype="uint8")
DEADLINES = dict(
    kv_transfer_timeout_ms=10_000,
    cancel_fence_ms=1000,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=3000,
)


class Pair:
    """A Sender and a Receiver of one test, the sender's pool filled with noise."""

    def __init__(self, **integrity: Any) -> None:
        self.sender = Sender(
            load_sender_settings(
                listen="tcp://127.0.0.1:0", pool=POOL, num_threads=1, deadlines=DEADLINES
            )
        ).start()
        self.receiver: Receiver | None = None
        try:
            self.receiver = Receiver(
                load_receiver_settings(pool=POOL, deadlines=DEADLINES, integrity=integrity)
            ).start()
        finally:
            if self.receiver is None:
                self.sender.shutdown()
        kv = self.sender.pool.kv_bytes_view()
        kv[:] = _bytes(kv.numel(), seed=7).view(kv.shape)

    @property
    def rx(self) -> Receiver:
        assert self.receiver is not None
        return self.receiver

    def fetch(self, request_id: str, **kw: Any) -> tuple[Any, bool]:
        """Publish ``request_id`` (blocks 1, 2, 3 with aux), fetch it into 5, 6, 7: the
        outcome and whether the blocks were reusable at close."""
        tx = self.sender.publish(request_id, [1, 2, 3], aux=b"first token")
        h = self.rx.fetch(request_id, self.sender.endpoint, [5, 6, 7], **kw)
        out = h.wait(WAIT_S)
        reusable = h.close(WAIT_S)
        assert tx.wait(WAIT_S) is not None, "the sender's request never ended"
        return out, reusable

    def landed_in_place(self) -> bool:
        src, dst = self.sender.pool.kv_bytes_view(), self.rx.pool.kv_bytes_view()
        return torch.equal(src[:, [1, 2, 3]], dst[:, [5, 6, 7]])

    def close(self) -> None:
        self.rx.shutdown()
        self.sender.shutdown()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(**getattr(request, "param", {"digest": True}))
    try:
        yield p
    finally:
        p.close()


def flip_one_byte(rx: Receiver) -> Any:
    """A landed hook: one byte of the fetch's second block, layer 1, flipped in place."""

    def flip(f: RxSession) -> None:
        rx.pool.kv_bytes_view()[1, int(f.dst_blocks[1]), 4097] ^= 0x10

    return flip


def swap_two_blocks(rx: Receiver) -> Any:
    """A landed hook: the fetch's first two destination blocks exchanged (every layer)."""

    def swap(f: RxSession) -> None:
        kv = rx.pool.kv_bytes_view()
        a, b = int(f.dst_blocks[0]), int(f.dst_blocks[1])
        kv[:, [a, b]] = kv[:, [b, a]].clone()

    return swap


@pytest.mark.integration
@pytest.mark.timeout(60)
class TestFetchDigest:
    def test_a_checked_fetch_is_done_when_what_landed_matches(self, pair: Pair) -> None:
        """With integrity.digest on, the sender computes the digest, the receiver checks it, and
        the fetch is done with every byte (and the aux) in place."""
        out, reusable = pair.fetch("req-ok")
        assert out is not None and out.state is RxState.DONE, out
        assert out.aux == b"first token" and reusable and pair.landed_in_place()
        assert pair.sender.stats.get("digests_computed") == 1
        assert pair.rx.stats.get("digests_checked") == 1
        assert pair.rx.stats.get("digest_mismatches") == 0
        assert pair.rx.stats.get("notifications") == 0, "a checked fetch learns done by a Result"

    def test_one_byte_flipped_after_the_write_fails_the_fetch(self, pair: Pair) -> None:
        """One byte changed in a destination block between the write and the check: the fetch
        fails digest_mismatch, never done, and its blocks are released (the write ended)."""
        pair.rx.digests.landed = flip_one_byte(pair.rx)
        out, reusable = pair.fetch("req-flip")
        assert out is not None and out.state is RxState.FAILED, out
        assert out.reason is Reason.DIGEST_MISMATCH, out
        assert reusable, "the write ended: the blocks are reusable"
        assert pair.rx.stats.get("digest_mismatches") == 1
        pair.rx.digests.landed = None
        again, _ = pair.fetch("req-after")
        assert again is not None and again.state is RxState.DONE, "the next fetch is unaffected"

    def test_two_destination_blocks_exchanged_fail_the_fetch(self, pair: Pair) -> None:
        """The right bytes in the wrong slots (two destination blocks exchanged) fail it too."""
        pair.rx.digests.landed = swap_two_blocks(pair.rx)
        out, _ = pair.fetch("req-swap")
        assert out is not None and out.reason is Reason.DIGEST_MISMATCH, out

    def test_source_blocks_reused_at_completion_do_not_fail_the_check(self, pair: Pair) -> None:
        """The sender's digest is taken before its request completes: an engine that reuses
        (overwrites) its source blocks the moment the outcome is committed does not turn a
        good transfer into a digest_mismatch."""
        tx = pair.sender.publish("req-reuse", [1, 2, 3], aux=b"first token")
        told = tx.session.on_end
        assert told is not None

        def reuse(session: Any) -> None:  # runs where the outcome is committed
            pair.sender.pool.kv_bytes_view()[:, [1, 2, 3]] = 0
            told(session)

        tx.session.on_end = reuse
        h = pair.rx.fetch("req-reuse", pair.sender.endpoint, [5, 6, 7])
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
        assert h.close(WAIT_S)
        end = tx.wait(WAIT_S)
        assert end is not None and end.state is TxState.COMPLETE, end

    @pytest.mark.parametrize("pair", [{"digest": True, "digest_inline_bytes": 0}], indirect=True)
    def test_a_large_fetch_is_checked_off_the_io_thread(self, pair: Pair) -> None:
        """Over digest_inline_bytes the check runs on the kvxferd-rx-digest thread; its verdict
        decides the outcome the same way (done, then digest_mismatch for a flipped byte)."""
        out, _ = pair.fetch("req-big")
        assert out is not None and out.state is RxState.DONE, out
        pair.rx.digests.landed = flip_one_byte(pair.rx)
        out, reusable = pair.fetch("req-big-flip")
        assert out is not None and out.reason is Reason.DIGEST_MISMATCH, out
        assert reusable
        assert pair.rx.stats.get("digests_checked_off_io") == 2

    @pytest.mark.parametrize("pair", [{}], indirect=True)
    def test_digest_off_computes_nothing_and_a_fetch_may_ask_for_one(self, pair: Pair) -> None:
        """integrity.digest off (the default): no digest is asked for or computed, the fetch is
        done by its notification as before, a flipped byte goes unnoticed; a fetch that asks
        (digest=True) is checked."""
        pair.rx.digests.landed = flip_one_byte(pair.rx)
        out, _ = pair.fetch("req-off")
        assert out is not None and out.state is RxState.DONE, out
        assert pair.sender.stats.get("digests_computed") == 0
        assert pair.rx.stats.get("digests_checked") == 0
        assert pair.rx.stats.get("notifications") == 1
        out, _ = pair.fetch("req-asks", digest=True)
        assert out is not None and out.reason is Reason.DIGEST_MISMATCH, out

    @pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "one byte flipped"])
    def test_a_streamed_publish_is_digested_over_every_layer(
        self, pair: Pair, corrupt: bool
    ) -> None:
        """A fetch parked before a streamed publish, written one layer per mark: the digest
        covers every layer (not the last range only), so the fetch is done when all landed
        intact, and a byte flipped in the first layer (written long before the last) fails it."""
        if corrupt:  # layer 0: written by the first mark, long before the last

            def flip(f: RxSession) -> None:
                pair.rx.pool.kv_bytes_view()[0, int(f.dst_blocks[1]), 4097] ^= 0x10

            pair.rx.digests.landed = flip
        kv = pair.sender.pool.kv_bytes_view()
        kv[:, [1, 2, 3]] = 0  # prefill has computed nothing yet
        h = pair.rx.fetch("req-stream", pair.sender.endpoint, [5, 6, 7])
        tx = pair.sender.publish("req-stream", [1, 2, 3], aux=b"first token", streamed=True)
        for layer in range(int(POOL["num_layers"])):
            kv[layer, [1, 2, 3]] = _bytes(3 * kv.shape[2], seed=11 + layer).view(3, -1)
            tx.progress(layer + 1)
        out = h.wait(WAIT_S)
        assert out is not None, "the streamed fetch never ended"
        if corrupt:
            assert out.state is RxState.FAILED and out.reason is Reason.DIGEST_MISMATCH, out
        else:
            assert out.state is RxState.DONE and pair.landed_in_place(), out
        assert h.close(WAIT_S) and tx.wait(WAIT_S) is not None
        assert pair.sender.stats.get("digests_computed") == 1  # once, at the last layer
        assert pair.rx.stats.get("digest_mismatches") == int(corrupt)

    def test_a_fetch_may_turn_the_check_off(self, pair: Pair) -> None:
        """digest=False on one fetch overrides integrity.digest = true: nothing computed."""
        out, _ = pair.fetch("req-no", digest=False)
        assert out is not None and out.state is RxState.DONE, out
        assert pair.sender.stats.get("digests_computed") == 0
        assert pair.rx.stats.get("digests_checked") == 0


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "one piece corrupted"])
@pytest.mark.parametrize(
    "case", ["2P1D (TP2->TP1)", "PP2->PP1", "GQA: prefill TP4 over 2 heads -> TP1"]
)
def test_each_piece_of_an_instance_fetch_is_checked(case: str, corrupt: bool) -> None:
    """One decode rank reading two pieces (two TP ranks' heads, two PP stages' layers, or
    two of four GQA replicas): each piece carries its own digest over its sub-ranges and
    layers; intact, the instance fetch is done and byte-exact; one byte of the second
    piece's range flipped, it fails digest_mismatch."""
    w = _World(SWEEP[case], seed=5)
    senders: list[Sender] = []
    receiver: Receiver | None = None
    try:
        for t in w.prefill:
            s = Sender(
                load_sender_settings(
                    listen="tcp://127.0.0.1:0",
                    deadlines=HETERO_DEADLINES,
                    pool=hetero_pool(t, w.num_blocks[("p", t.rank)]),
                    num_threads=1,
                ),
                topology=t,
            ).start()
            senders.append(s)
            w.fill("p", t, s.pool.kv_bytes_view())
        d = w.decode[0]
        receiver = Receiver(
            load_receiver_settings(
                deadlines=HETERO_DEADLINES,
                pool=hetero_pool(d, w.num_blocks[("d", d.rank)]),
                integrity={"digest": True},
            ),
            topology=d,
        ).start()
        w.fill("d", d, receiver.pool.kv_bytes_view())
        rx = receiver
        if corrupt:

            def flip(f: RxSession) -> None:
                if f.prefill_rank > 0:  # the first byte the second piece wrote
                    piece = piece_for(d, rx.groups.records[f.sender_endpoint])
                    assert piece is not None
                    block, off = int(f.dst_blocks[0]), int(piece.ranges.dst[0])
                    rx.pool.kv_bytes_view()[f.layer_begin, block, off] ^= 0x01

            rx.digests.landed = flip
        endpoints = [s.endpoint for s in senders]
        txs = [
            s.publish("req-h", w.ids[("p", t.rank)].tolist(), expected_fetches=readers_for(d, t))
            for s, t in zip(senders, w.prefill, strict=True)
        ]
        h = rx.fetch(
            "req-h",
            endpoints[0],
            w.ids[("d", d.rank)].tolist(),
            sender_endpoints=endpoints,
            want_aux=False,
        )
        out = h.wait(WAIT_S)
        assert out is not None
        assert h.close(WAIT_S), "every piece's write ended: the blocks are reusable"
        for tx in txs:
            end = tx.wait(WAIT_S)
            assert end is not None and end.state is TxState.COMPLETE, end
        assert sum(s.stats.get("digests_computed") for s in senders) == 2
        assert rx.stats.get("digests_checked") == 2
        if corrupt:
            assert out.state is RxState.FAILED and out.reason is Reason.DIGEST_MISMATCH, out
            assert "piece 1" in out.detail, out.detail
        else:
            assert out.state is RxState.DONE, out
            assert torch.equal(rx.pool.kv_bytes_view(), w.want[d.rank])
    finally:
        if receiver is not None:
            receiver.shutdown()
        for s in senders:
            s.shutdown()
