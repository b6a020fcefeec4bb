"""An engine of either release: publishes or fetches requests through a daemon's engine socket.

Run by any kvxferd release's interpreter (it uses only the engine API that 0.1.0 and later
share: ``Client``, ``attach_pool``, ``publish``, ``fetch_wait``), from a working directory
outside the repository, so that the release's own kvxferd is the one imported::

    python engine_driver.py publish SOCKET ID...           write each id's content, publish it
    python engine_driver.py fetch SOCKET SENDER_EP ID...    fetch each id, check every byte

One JSON line per request on stdout (``{"event": "published"|"fetched", "id", ...}``; a
fetched one says ``state`` and ``exact``; fetching stops at the first that is not exact), then ``{"event": "end", "version": <kvxferd's>}``.
Request ``i`` of the command line uses blocks ``[i * BLOCKS, (i + 1) * BLOCKS)``; its
content is :func:`content` of its id (so a fetch checks bytes it was never told).
"""

from __future__ import annotations

import hashlib
import json
import sys

LAYERS = 2
BLOCKS = 4  # per request
BLOCK_BYTES = 64 << 10
NUM_BLOCKS = 64  # the daemons' pools: 16 requests of 4 blocks
CALL_S = 10.0  # a healthy fetch here takes milliseconds


def content(request_id: str) -> bytes:
    """The bytes of request ``request_id``: ``LAYERS x BLOCKS x BLOCK_BYTES``, a pure function."""
    return hashlib.shake_256(request_id.encode()).digest(LAYERS * BLOCKS * BLOCK_BYTES)


def blocks(i: int) -> list[int]:
    return list(range(i * BLOCKS, (i + 1) * BLOCKS))


def main(argv: list[str]) -> int:
    import torch

    import kvxferd
    from kvxferd.engine.client import Client, attach_pool

    cmd, socket_, *rest = argv
    with Client(socket_, timeout_s=CALL_S) as c:
        pool = attach_pool(c.describe())
        shape = (LAYERS, BLOCKS, BLOCK_BYTES)
        if cmd == "publish":
            for i, rid in enumerate(rest):
                data = torch.frombuffer(bytearray(content(rid)), dtype=torch.uint8)
                pool[:, blocks(i)] = data.reshape(shape)
                c.publish(rid, blocks(i), aux=rid.encode())
                print(json.dumps({"event": "published", "id": rid}), flush=True)
        elif cmd == "fetch":
            sender, *ids = rest
            for i, rid in enumerate(ids):
                out = c.fetch_wait(rid, sender, blocks(i), CALL_S)
                got = pool[:, blocks(i)].contiguous().numpy().tobytes()
                exact = got == content(rid) and out.aux == rid.encode()
                line = {"event": "fetched", "id": rid, "state": out.state, "exact": exact}
                print(json.dumps(line), flush=True)
                if not exact:  # the first failure says it all: the rest would wait as long
                    break
        else:
            print(f"unknown command {cmd}", file=sys.stderr)
            return 2
    print(json.dumps({"event": "end", "version": kvxferd.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
