"""The engine side: the engine API a local engine speaks to its daemon, its gateway and its client.

Engines import :mod:`kvxferd.engine.client` only; nothing here imports the service
shell or an integration (tests/test_layering.py checks it)::

    engine_protocol.py  the engine API's messages (b"KE" + version + msgpack)
    channel.py          how frames travel: a unix stream (ipc://) or ZMQ with CURVE (tcp://)
    gateway.py          the engine gateway inside a daemon: its socket and connections, served by
                        the service's io thread
    calls.py            one engine call from its frame to its reply (deadlines, max_inflight)
    waits.py            the engine calls that wait, with their timers
    handles.py          the gateway's handle table: handles by id, the open Publish/Fetch of each key
    roles.py            what the gateway does differently for a sender and a receiver (an adapter each)
    client.py           what engines import: Client (AsyncClient, attach_pool re-exported)
    async_client.py     AsyncClient: one connection per event loop, read on that loop
    requests.py         what a client sends: each call's message for a call id and deadline
    dialect.py          the engine protocol version one Client connection speaks (the newest,
                        or the previous release's toward a daemon of that release)
    links.py            the ``links`` call on the engine side (Client.links, AsyncClient.links)
    errors.py           what an engine call raises: EngineError, EngineRejected, EngineUnavailable
    mapping.py          the daemon's pool mapped here: shared memory, or CUDA IPC on a GPU
"""
