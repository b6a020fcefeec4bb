"""Hostile messages for the fuzz tests: junk bytes, broken and well-formed-but-malicious msgpack.

A message is a list of frames: what one ``send_multipart`` sends to a kvxferd socket
(ZMQ), or one frame on an engine socket (a unix stream of length-prefixed frames, which
has no multi-frame message). :func:`build` makes a reproducible mix for one target
socket from a seed:

=============  ===================================================================
kind           what
=============  ===================================================================
random         random bytes, bare or behind the right magic, the other magic, a
               wrong version byte or the previous version's
truncated      a well-formed message of the target's protocol cut short
multiframe     2-5 frames (junk, well-formed, truncated or malicious ones, mixed)
               in one message; to an engine, the same frames one after another,
               each a message of its own
batch edge     kvxferd targets only: exactly ``MAX_BATCH`` frames, or 1 to
               ``MAX_BATCH`` more than that, in one message (the sender's listener
               takes up to ``MAX_BATCH`` frames as a batch and refuses more whole)
malicious      msgpack maps of every message type of both directions of the
               target's protocol, one field broken per message: out-of-range and
               negative numbers, wrong types, dropped or unknown fields, a wrong,
               missing or foreign tag, the tag after the other fields, nesting deeper
               than the decoder's recursion limit, block lists of 10^5-10^6 ids
=============  ===================================================================

Every frame :func:`build` returns must be refused by a daemon that never saw the
sender of it register (a kvxferd peer) or open a handle (an engine): the engine
templates carry a passed deadline *and* a second fault (blocks out of range, a
``;`` endpoint, an unknown handle), so breaking one field leaves the other; a
well-formed Describe, the one call that needs neither, is dropped. An engine mix
also holds one frame of exactly ``MAX_FRAME_BYTES`` (the largest the gateway reads;
it does not decode). :func:`oversized` makes frames over a socket's ``MAXMSGSIZE``:
libzmq drops the connection that carries one, the daemon never reads it; an engine
socket's gateway closes a connection whose length prefix is over its bound.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from kvxferd.engine import engine_protocol as ep
from kvxferd.errors import ProtocolError
from kvxferd.transfer import protocol as wire

Message = list[bytes]
Target = Literal["listener", "results", "engine"]

_enc = msgspec.msgpack.Encoder()
DEEP = 3000  # nesting levels: above CPython's recursion limit (1000) that msgspec obeys
HUGE_IDS = 700_000  # block ids in the largest list: about 3.5 MB of msgpack, under 4 MiB
PASSED = 1  # a deadline_unix_ms long gone (1 ms after the epoch)
UNKNOWN_HANDLE = 7  # never issued: handle ids start at the daemon's start time << 20
SOURCE_SYNTAX = "tcp://127.0.0.1:9;127.0.0.1:10"  # libzmq's src;dst form, refused


def layout_map(num_layers: int, num_blocks: int, block_bytes: int) -> dict[str, Any]:
    return {
        "num_layers": num_layers,
        "num_blocks": num_blocks,
        "block_bytes": block_bytes,
        "dtype": "uint8",
        "aux_slots": 8,
        "aux_slot_bytes": 4096,
    }


def kx_templates(rng: random.Random, layout: dict[str, Any]) -> list[dict[str, Any]]:
    """One well-formed map of every kvxferd message type (both directions), ids prefixed ``fz``."""
    rid = f"fz-{rng.randrange(1 << 30)}"
    fid = rng.randrange(1 << 62)
    return [
        {
            "t": "register",
            "receiver_id": f"fz-rx-{rng.randrange(1 << 20)}",
            "result_endpoint": "tcp://127.0.0.1:9",
            "agent_metadata": rng.randbytes(rng.randrange(1, 300)),  # never loads in NIXL
            "layout": layout,
            "kv_base": rng.randrange(1 << 40),
            "aux_base": rng.randrange(1 << 40),
        },
        {
            "t": "request_data",
            "request_id": rid,
            "fetch_id": fid,
            "dst_blocks": [0, 1, 2],
            "notify": rng.randbytes(wire.NONCE_BYTES),  # v3: completed by a NIXL notification
        },
        {"t": "cancel", "request_id": rid, "fetch_id": fid},
        {"t": "register_reply", "ok": True, "sender_id": "fz-tx-1"},
        {"t": "result", "request_id": rid, "fetch_id": fid, "status": "done", "nbytes": 4096},
        {"t": "cancel_ack", "request_id": rid, "fetch_id": fid},
        {"t": "reject", "reason": "malformed", "detail": "fz"},
    ]


def ke_templates(rng: random.Random) -> list[dict[str, Any]]:
    """One map of every engine message type (both directions); each call is refused twice over."""
    cid = rng.randrange(1 << 62)
    rid = f"fz-{rng.randrange(1 << 30)}"
    bad_blocks = [(1 << 31) - 1 - i for i in range(3)]
    return [
        {"t": "describe", "call_id": cid},
        {
            "t": "publish",
            "call_id": cid,
            "request_id": rid,
            "block_ids": bad_blocks,
            "deadline_unix_ms": PASSED,
        },
        {
            "t": "fetch",
            "call_id": cid,
            "request_id": rid,
            "sender_endpoint": SOURCE_SYNTAX,
            "block_ids": bad_blocks,
            "deadline_unix_ms": PASSED,
        },
        {"t": "lookup", "call_id": cid, "request_id": rid, "deadline_unix_ms": PASSED},
        {
            "t": "wait",
            "call_id": cid,
            "handle_id": UNKNOWN_HANDLE,
            "timeout_ms": 0,
            "deadline_unix_ms": PASSED,
        },
        {"t": "poll", "call_id": cid, "handle_id": UNKNOWN_HANDLE},
        {"t": "cancel", "call_id": cid, "handle_id": UNKNOWN_HANDLE, "deadline_unix_ms": PASSED},
        {
            "t": "close",
            "call_id": cid,
            "handle_id": UNKNOWN_HANDLE,
            "timeout_ms": 0,
            "deadline_unix_ms": PASSED,
        },
        {"t": "handle", "call_id": cid, "handle_id": 9},
        {"t": "error", "call_id": cid, "reason": "busy"},
        {"t": "ok", "call_id": cid},
    ]


# -- raw msgpack: maps in any key order, values that no encoder would write ----------------
def _pack(value: Any) -> bytes:
    return value.raw if isinstance(value, Raw) else _enc.encode(value)


class Raw:
    """Already-encoded msgpack bytes, spliced in as a value."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def pack_map(items: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map of ``items`` in this order (duplicates and non-string keys allowed)."""
    n = len(items)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(_pack(k) + _pack(v) for k, v in items)


def deep_array(depth: int) -> Raw:
    return Raw(b"\x91" * depth + b"\xc0")


def deep_map(depth: int) -> Raw:
    return Raw(b"\x81\xa1k" * depth + b"\xc0")


BAD_VALUES: tuple[Any, ...] = (
    -1,
    -(2**63),
    2**63,
    2**64 - 1,
    1 << 31,
    "",
    "x" * 5000,
    "fz bad id",
    None,
    True,
    1.5,
    [],
    {},
    b"",
    b"\xff" * 64,
    [-1],
    [2**40] * 3,
    {"t": "register"},
    Raw(b"\xd4\x01\x00"),  # an ext type
    Raw(b"\xc1"),  # the one byte msgpack never uses
)


def _mutations(rng: random.Random, template: dict[str, Any]) -> list[tuple[Any, Any]]:
    """``template``'s items with one thing broken (chosen by ``rng``)."""
    items: list[tuple[Any, Any]] = list(template.items())
    fields = [i for i, (k, _) in enumerate(items) if k != "t"]
    how = rng.randrange(10)
    if how <= 2 and fields:  # a bad value in a field
        i = rng.choice(fields)
        items[i] = (items[i][0], rng.choice(BAD_VALUES))
    elif how == 3 and fields:  # a field dropped
        del items[rng.choice(fields)]
    elif how == 4:  # an unknown field (sometimes deep, before the tag: the decoder must skip it)
        value = rng.choice((*BAD_VALUES, deep_array(DEEP), deep_map(DEEP)))
        items.insert(rng.randrange(len(items) + 1), (f"fz_{rng.randrange(99)}", value))
    elif how == 5:  # a wrong, foreign, missing or mistyped tag
        tag = rng.choice(("nope", "", 7, None, "REGISTER", "pool_info", "describe", "register"))
        items = [(k, tag if k == "t" else v) for k, v in items]
        if rng.random() < 0.3:
            items = [(k, v) for k, v in items if k != "t"]
    elif how == 6 and fields:  # nesting past the recursion limit, in a known field
        i = rng.choice(fields)
        items[i] = (items[i][0], rng.choice((deep_array(DEEP), deep_map(DEEP))))
    elif how == 7:  # the tag last, after a deep unknown field
        items = [(k, v) for k, v in items if k != "t"]
        items.append(("fz_deep", deep_array(rng.randrange(DEEP // 2, DEEP))))
        items.append(("t", template["t"]))
    elif how == 8 and fields:  # negative and huge numbers everywhere numbers are
        items = [(k, -(2**63) if isinstance(v, int) and k != "t" else v) for k, v in items]
    else:  # a key that is not a string, or a duplicated key
        items.append(rng.choice(((1, 2), (None, 0), ("t", "cancel"), (b"t", b"x"))))
    return items


# -- the mix ------------------------------------------------------------------------------
def _refused(target: Target, frames: Message) -> bool:
    """False for the one kind of message a target serves to anyone: a well-formed Describe."""
    if target != "engine":
        return True
    try:
        msg = ep.decode_to_gateway(frames)
    except ProtocolError:
        return True
    except RecursionError:  # kvxferd before the fix: refused too (the test counts it)
        return True
    return not isinstance(msg, ep.Describe)


def at_bound(max_bytes: int, header: bytes) -> bytes:
    """A frame of exactly ``max_bytes`` that does not decode (0xc1, then zeros)."""
    return header + b"\xc1" + b"\x00" * (max_bytes - len(header) - 1)


def build(
    target: Target,
    count: int,
    seed: int,
    *,
    layout: dict[str, Any] | None = None,
    huge: int = 2,
) -> list[Message]:
    """``count`` hostile messages for ``target`` (``huge`` of them block lists of ~10^5-10^6 ids).

    An engine target gets one-frame messages only, one of them ``at_bound``.
    """
    rng = random.Random(seed)
    layout = layout or layout_map(2, 64, 4096)
    engine = target == "engine"
    header, other = (ep.HEADER, wire.HEADER) if engine else (wire.HEADER, ep.HEADER)

    def templates() -> list[dict[str, Any]]:
        return ke_templates(rng) if engine else kx_templates(rng, layout)

    def well_formed() -> bytes:
        return header + pack_map(list(rng.choice(templates()).items()))

    def random_frame() -> Message:
        body = rng.randbytes(rng.choice((0, 1, 2, 3, 8, 40, 300, 2000)))
        previous = header[:2] + bytes([header[2] - 1])  # the version before this one
        prefix = rng.choice(
            (b"", header, other, header[:2] + b"\x00", header[:2] + b"\xff", previous)
        )
        return [prefix + body]

    def truncated() -> Message:
        frame = well_formed()
        return [frame[: rng.randrange(len(frame))]]

    def malicious() -> Message:
        return [header + pack_map(_mutations(rng, rng.choice(templates())))]

    def frames(n: int) -> Message:
        """``n`` frames of one message: all well-formed, all junk, or any kind, mixed."""
        how = rng.random()
        if how < 0.3:
            return [well_formed() for _ in range(n)]
        if how < 0.6:
            return [rng.randbytes(rng.randrange(0, 64)) for _ in range(n)]
        one = (
            well_formed,
            lambda: random_frame()[0],
            lambda: truncated()[0],
            lambda: malicious()[0],
        )
        return [rng.choice(one)() for _ in range(n)]

    def multiframe() -> Message:
        return frames(rng.randrange(2, 6))

    def batch_edge() -> Message:
        extra = 0 if rng.random() < 0.5 else rng.randrange(1, wire.MAX_BATCH + 1)
        return frames(wire.MAX_BATCH + extra)

    kinds: list[tuple[float, Callable[[], Message]]] = [
        (0.30, random_frame),
        (0.15, truncated),
        (0.10, multiframe),
        (0.44, malicious),
        (0.01, batch_edge),
    ]
    out = [*huge_block_lists(target, rng, huge)]
    if engine:
        out.append([at_bound(ep.MAX_FRAME_BYTES, header)])
    while len(out) < count:
        r, make = rng.random(), malicious
        for weight, kind in kinds:
            if r < weight:
                make = kind
                break
            r -= weight
        if engine and make is batch_edge:
            continue  # a stream has no multi-frame message: the multiframe kind covers it
        msg = make()
        if engine:  # each frame alone, one after another
            out += [[f] for f in msg if _refused(target, [f])]
        elif _refused(target, msg):
            out.append(msg)
    del out[count:]  # what went past ``count`` came last: never a huge one, nor the bound
    rng.shuffle(out)
    return out


def huge_block_lists(target: Target, rng: random.Random, n: int) -> list[Message]:
    """``n`` messages whose block list has 10^5 up to ``HUGE_IDS`` ids (all under MAXMSGSIZE)."""
    out = []
    for i in range(n):
        ids = list(range(100_000 if i % 2 == 0 else HUGE_IDS))
        if target == "engine":
            tmpl = dict(ke_templates(rng)[1 + i % 2])  # publish, fetch
            tmpl["block_ids"] = ids
            out.append([ep.HEADER + pack_map(list(tmpl.items()))])
        else:
            item = {"t": "request_data", "request_id": "fz-huge", "fetch_id": i, "dst_blocks": ids}
            out.append([wire.HEADER + pack_map(list(item.items()))])
    return out


def oversized(max_bytes: int, header: bytes) -> Message:
    """One frame a byte over ``max_bytes``: libzmq (or the engine gateway) closes its connection."""
    return [header + b"\x00" * (max_bytes + 1 - len(header))]
