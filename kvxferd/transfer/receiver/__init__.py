"""The receiver (generation side): fetch a published request's KV into our own blocks.

One facade (:class:`Receiver`) over the tables its io thread keeps, one module each::

    core.py       Receiver: the engine API, the io thread's loop, its typed commands run with match
    handle.py     RxHandle: the engine's handle on one fetch (wait, cancel, close)
    fetches.py    the fetch table: admission, RequestData out, cancel, fail, deadlines
    in_doubt.py   the in-doubt table: fences in doubt, Cancel re-sent with a backoff, released
    groups.py     fetches from a prefill instance: planned once rank 0's record is known
    links.py      one link per sender endpoint: LinkState, Register, monitor, down, closed
    messages.py   RegisterReplies, Results, CancelAcks, Rejects, NIXL notifications
    moved.py      the moved table: requests a draining sender handed over, and where they went
    digests.py    the digest check of a done Result: on the io thread, or the kvxferd-rx-digest one
    shutdown.py   drain, cut what is left, ask about the doubt, deregister only when safe
"""

from kvxferd.transfer.receiver.core import Receiver
from kvxferd.transfer.receiver.fetches import _fetch_ids
from kvxferd.transfer.receiver.handle import RxHandle
from kvxferd.transfer.receiver.links import Link, LinkState

__all__ = ["Link", "LinkState", "Receiver", "RxHandle", "_fetch_ids"]
