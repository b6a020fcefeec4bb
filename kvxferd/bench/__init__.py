"""``kvxferd bench``: kvxferd against raw NIXL and a plain ZMQ copy, on the same KV-shaped workloads.

Three paths move the same requests (same pools, same block ids, same window)::

    path      how the bytes move                                  who times a request
    --------  --------------------------------------------------  --------------------------------
    kvxferd   Receiver.fetch -> REQUEST_DATA -> Sender listener,   the receiver: fetch() to the
              admission, worker, NIXL WRITE -> Result              Result (completion.set_at)
    nixl      NixlDataPlane.post_write with the descriptors        the initiator: post to the
              kvxferd builds (layout.write_descriptors); no        first poll that says DONE
              control plane at all: the data-plane limit
    zmq       zero-copy ZMQ frames over tcp://127.0.0.1, copied    the sender: send to its ack
              into the destination blocks, one ack per request

Processes. One ``tx`` child and one ``rx`` child per receiver, started once with
``python -m kvxferd _bench-tx|_bench-rx SPEC_JSON`` and reused for every
workload; each child hosts its side of all three paths (a path that is not
being measured sits idle). The parent writes one JSON command per line to a
child's stdin and reads one JSON reply per line from its stdout; NIXL metadata
travels as base64 inside JSON; nothing richer than JSON is decoded. Everything a library prints
on a child's stdout is moved to stderr, so the reply stream stays clean.

A workload runs as: set up (new pools and NIXL agents, a new Sender and
Receivers), one warm-up repetition per path (connections, registration), then
repetitions alternating kvxferd, nixl, zmq, kvxferd, ... so that drift of the
machine falls on all three alike. One repetition of one path is::

    prepare   tx: kvxferd publishes its first requests (an engine thread keeps
                  publishing and closing, a window ahead of the receivers)
              rx: poison the head and tail stamps of every destination block
    run       the driver (kvxferd: each receiver; nixl, zmq: the tx child)
              keeps ``inflight`` requests per receiver in flight, oldest first,
              and times each one
    finish    tx: kvxferd joins its engine thread and counts failed requests
              rx: verify the blocks the last request of each slot wrote

Every source block of layer ``l``, block ``b`` holds a random tile with an 8-byte
stamp ``f(l, b)`` at its head and ``~f(l, b)`` at its tail, so a block written
to the wrong place, half written or not written at all fails the check.

``kvxferd bench --curves`` (:mod:`kvxferd.bench.curves`) runs the same machinery
over four axes instead of a preset (in flight, sender workers, blocks per request,
receivers per sender), each point against prepared raw NIXL, and times the
preparation of a 1000-block request.
"""

from kvxferd.bench.child import run_child
from kvxferd.bench.command import add_arguments, main_bench
from kvxferd.bench.content import fill_source, poison, verify
from kvxferd.bench.plan import Plan
from kvxferd.bench.plot import plot_available, write_curves_plot, write_plot
from kvxferd.bench.report import format_report
from kvxferd.bench.runner import run_bench
from kvxferd.bench.workload import FULL, QUICK, BenchError, Options, Workload

__all__ = [
    "FULL",
    "QUICK",
    "BenchError",
    "Options",
    "Plan",
    "Workload",
    "add_arguments",
    "fill_source",
    "format_report",
    "main_bench",
    "plot_available",
    "poison",
    "run_bench",
    "run_child",
    "verify",
    "write_curves_plot",
    "write_plot",
]
