"""The sender (context side): a ROUTER listener, N workers, and the requests the engine published.

Organised by its state; each table has no lock of its own (the caller holds the
sender's registry lock, ``Sender._lock``) and keeps its own counts in step::

    api.py        Sender, the facade: the engine API (publish, close, cancel), the wiring, view()
    listener.py   the listener thread: the ROUTER socket, message dispatch, housekeeping
    admission.py  peers coming and going: a Register admitted in steps, incarnations, reclaim
    peers.py      the peer table: registered receivers by route, when each was last heard from
    published.py  published requests by id, session and fetch key; grants; the TTL heap
    parked.py     fetches parked before their publish: park, take, cancel, drop, expire
    streams.py    streamed publishes: their readers, progress marks, the stall bound
    drain.py      the bounded drain: shutdown in steps, what it dropped
    handover.py   the drain's handover: unfetched requests offered to another sender, redirects
    adopt.py      adoption: requests handed over here, fetched into reserved blocks, re-published

The workers live in kvxferd/transfer/worker.py and see the sender only through
``worker.WorkerHost``.
"""

from kvxferd.transfer.sender.api import Sender, TxHandle
from kvxferd.transfer.sender.listener import piece_layers
from kvxferd.transfer.sender.parked import Parked, ParkedFetches

__all__ = ["Parked", "ParkedFetches", "Sender", "TxHandle", "piece_layers"]
