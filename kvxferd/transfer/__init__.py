"""The transfer core: sessions, the data plane, the control plane and the topology mapping.

Nothing here imports the service shell (:mod:`kvxferd.service`), the engine side
(:mod:`kvxferd.engine`), the tools (bench, faults, cli) or an integration
(tests/test_layering.py checks it)::

    protocol.py   messages, framing (b"KX" + version + msgpack), bounds, compatibility check
    layout.py     block ids -> NIXL descriptors (vectorised, coalesced), bounds checks
    pool.py       the KV pool (shared memory on the CPU, CUDA tensor on a GPU) and id allocators
    dataplane.py  the NIXL agent behind a narrow interface: register once, add peers, post WRITEs, poll
    peer_connects.py  connects toward new peers: probe agents, the kvxferd-tx-connect threads, deadlines
    dlists.py     prepared descriptor lists: made with NIXL, the table of those in use and retired
    loaded_peers.py the data plane's peers: their metadata, claims on a name being loaded or removed
    routes.py     each peer's path, writes in flight per (peer, path), broken transports
    path_moves.py  paths (local agents); moving a failed or stalled peer to a fresh one
                  (the kvxferd-dp-connect threads), reloads in place
    control.py    one zmq.Context per process, bounded sends, the guarded shared-dealer pool
    poller.py     an io thread's wait: ZMQ sockets and file descriptors, sub-millisecond timeouts
    iohooks.py    what another component (the engine gateway) hands to a service's io thread
    ownership.py  who owns which receiver id, NIXL agent and session; per-identity limits, orphan TTL
    topology.py   a rank's topology record (TP/PP, heads, layout from strides), the compatibility hash
    reshard.py    prefill ranks -> decode rank: which heads and layers of which blocks
    guard.py      what a long-lived thread does with an unexpected error: log, count, fail liveness
    session.py    TxSession / RxSession state machines (no I/O): admission, drain, fence
    digest.py     the per-request digest: two 64-bit lanes over the bytes a fetch moved, with torch
    sender/       the sender, a package by its state: the facade, the ROUTER listener thread,
                  peers (admitted, replaced, evicted), published requests, parked fetches, the drain
    peer_agents.py  the receivers' NIXL agents on a sender: writes in flight, deferred removals
    link_probes.py  a sender's link probes: timed WRITEs into a receiver's scratch region at each
                  new link (the kvxferd-tx-probe thread), each link's GB/s
    worker.py     a sender worker (a thread, or the listener's inline one): its turn, settling
                  each write that changed, one notification or Result per slice
    worker_tasks.py  what a worker is handed (write, cancel ack, reply, forget, STOP), the peer,
                  what it needs from its sender (WorkerHost)
    worker_lanes.py  a worker's FIFO lane per receiver and which task starts next (coalescing)
    worker_writes.py  a worker's writes in flight: posting, polling, stall deadline, doubt, release
    worker_outbox.py  a worker's DEALER and FIFO box per result endpoint, each message's deadline
    receiver/     the receiver: one io thread owning its sockets, deadlines, cancel fence, in-doubt table
                  (core, handle, fetches, in_doubt, groups, links, messages, digests, shutdown: its __init__
                  draws them)
    commands.py   what other threads hand the receiver's io thread: one typed command each
    link_agents.py  the receiver's NIXL agent per sender link: spares made ahead, torn down when a
                  link goes down (the proof that ends its doubts, with revocable transports)
    waiters.py    completion delivery to threads and to every asyncio loop
    journal.py    one record per request end: its log line, per-peer histograms, failure windows
    views.py      frozen views of the sender, receiver and what hangs off them: what the probes read
    drain.py      what a drain dropped: the drain_dropped_* counters, the shutdown reports
"""
