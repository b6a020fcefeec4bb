"""The receiver's NIXL agents, one per sender link: a link that is down is torn down, and that ends its doubts.

A fetch in doubt keeps its blocks fenced until proof that no write of it can land
(docs/protocol.md §15). While the link to its sender is down, the sender cannot
answer; the receiver's own proof is to close its side of the data plane toward
that sender. With one NIXL agent per process there is nothing per sender to close
(the sender connects to the agent). So each link gets an agent of its own, with
the pool registered, and the metadata of that agent is what its Register carries:
a sender knows only its link's agent, under a name unique to that agent
(``<receiver_id>.l<gen>``), and a sender captures the agent name of a fetch when
the fetch arrives, so a write of an old fetch can never be addressed to a newer
agent of the same receiver.

Tearing an agent down deregisters the pool and destroys the agent: its UCX worker,
endpoints and connections are gone. After that, with **revocable** transports, no
byte of a write addressed to it can land: over TCP the sockets are closed (what
arrives is reset, a new connection needs a worker that no longer exists); over
InfiniBand the memory keys are invalidated; over shared memory the FIFO is no
longer read. With same-host zero-copy transports (``cma``, ``knem``, ``xpmem``,
``cuda_ipc``) the writer reaches our memory directly and no teardown of ours stops
it: there a teardown is no proof. :func:`teardown_proves` decides from ``UCX_TLS``;
UCX's default (every transport) is not revocable.

One agent's states::

    spare   --taken by a link (io thread)--> linked
    linked  --link down, closed, or shutdown (io thread: tear_down)--> tearing
    tearing --deregistered and destroyed (agents thread)--> gone: ``on_torn(gen)``

Threads: ``kvxferd-rx-agents`` (owner) creates spares and destroys torn agents:
both take a NIXL/UCX context set-up or teardown (about 0.1-0.2 s each, measured),
never on the io thread. The io thread takes spares, polls the linked agents for
notifications and hands agents to tear down; after ``tear_down`` returns the io
thread never touches that agent again, so the agents thread may destroy it.
``_lock`` guards ``_spares``, ``_torn`` and ``_stopping``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvxferd.config import DataPlaneSettings
from kvxferd.stats import Stats
from kvxferd.transfer.dataplane import DataPlane, scratch_region
from kvxferd.transfer.pool import KvPool

log = logging.getLogger("kvxferd.receiver")

# Transports through which a peer writes into our memory without our worker or our
# registration: same-host zero-copy (a process or device mapping the peer holds).
_DIRECT = frozenset({"cma", "knem", "xpmem", "cuda_ipc", "rocm_ipc", "ze_ipc"})
# UCX_TLS aliases that include one of them.
_DIRECT_ALIASES = frozenset({"all", "sm", "shm", "cuda", "rocm", "ze"})
# Transports whose writes need our worker (TCP, shared-memory FIFOs) or our memory keys
# (InfiniBand/RoCE verbs), and local-only copy transports.
_REVOCABLE = frozenset(
    {
        "tcp", "self", "posix", "sysv", "mm",
        "rc", "rc_v", "rc_x", "rc_mlx5", "rc_verbs",
        "dc", "dc_x", "dc_mlx5",
        "ud", "ud_v", "ud_x", "ud_mlx5", "ud_verbs",
        "ib", "sockcm", "rdmacm", "cuda_copy", "gdr_copy", "rocm_copy", "rocm_gdr",
    }
)  # fmt: skip
_SPARE_RETRY_S = 1.0  # a spare that could not be made is tried again this much later
_JOIN_S = 10.0


def teardown_proves(ucx_tls: str | None) -> bool:
    """True when, with ``UCX_TLS`` = ``ucx_tls``, a torn-down agent can receive no write.

    An inclusion list must name only revocable transports; an exclusion list (``^...``)
    must exclude every same-host zero-copy one (``cma``, ``knem``, ``xpmem`` or ``sm``,
    and ``cuda_ipc`` or ``cuda``, ``rocm_ipc`` or ``rocm``, ``ze_ipc`` or ``ze``). Unset
    (UCX's default: all transports), or a name not known here: False.
    """
    if not ucx_tls or not ucx_tls.strip():
        return False
    text = ucx_tls.strip()
    if text.startswith("^"):
        gone = {t.strip().lower() for t in text[1:].split(",") if t.strip()}
        if gone & {"sm", "shm"}:
            gone |= {"cma", "knem", "xpmem"}
        for alias, member in (("cuda", "cuda_ipc"), ("rocm", "rocm_ipc"), ("ze", "ze_ipc")):
            if alias in gone:
                gone.add(member)
        return _DIRECT <= gone
    names = {t.strip().lower() for t in text.split(",") if t.strip()}
    names = {n[1:] if n.startswith("\\") else n for n in names}  # UCX's "\name": not an alias
    return bool(names) and names <= _REVOCABLE and not names & (_DIRECT | _DIRECT_ALIASES)


@dataclass(eq=False, slots=True)
class LinkAgent:
    """One NIXL agent with the pool registered; ``gen`` numbers it within this receiver."""

    gen: int
    name: str
    metadata: bytes
    agent: Any = None  # nixl_agent; None for the shared agent of an injected data plane
    regs: list[object] = field(default_factory=list)


class LinkAgents:
    """Spare and linked NIXL agents of one receiver; ``on_torn(gen)`` once one is destroyed."""

    def __init__(
        self,
        name: str,
        settings: DataPlaneSettings,
        pool: KvPool,
        stats: Stats,
        on_spare: Callable[[], None],
        on_torn: Callable[[int], None],
    ) -> None:
        if settings.ucx_tls:
            os.environ["UCX_TLS"] = settings.ucx_tls
        self.name = name
        self.settings = settings
        self.pool = pool
        self.stats = stats
        self.proves = teardown_proves(os.environ.get("UCX_TLS"))
        # The link probe's scratch region (a sender WRITEs it to measure the link; never KV):
        # registered with every agent, advertised in each Register. Empty: no probe.
        self.scratch = scratch_region(settings.link_probe_bytes)
        self._on_spare = on_spare
        self._on_torn = on_torn
        self._gens = itertools.count(1)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._spares: deque[LinkAgent] = deque()
        self._torn: deque[LinkAgent] = deque()
        self._linked: dict[int, LinkAgent] = {}  # io thread only
        self._stopping = False
        self._spares.append(self._make())  # the first at start-up: a bad pool fails here
        self._thread = threading.Thread(target=self._run, name="kvxferd-rx-agents", daemon=True)
        self._thread.start()

    # -- io thread ---------------------------------------------------------------------
    def take(self) -> LinkAgent | None:
        """A spare agent for a link (linked from now on), or None: ``on_spare`` tells when."""
        with self._lock:
            agent = self._spares.popleft() if self._spares else None
            self._work.notify()  # make the next spare
        if agent is not None:
            self._linked[agent.gen] = agent
            self.stats.add("link_agents_taken")
        return agent

    def tear_down(self, agent: LinkAgent) -> None:
        """Stop polling ``agent`` and have it destroyed; ``on_torn(agent.gen)`` follows."""
        if self._linked.pop(agent.gen, None) is None:
            return
        with self._lock:
            self._torn.append(agent)
            self._work.notify()

    def notifications(self, agent: LinkAgent | None = None) -> list[tuple[int, str, bytes]]:
        """``(gen, sender agent, message)`` of every linked agent (or of ``agent`` only)."""
        got: list[tuple[int, str, bytes]] = []
        for a in self._linked.values() if agent is None else (agent,):
            if a.agent is None or a.gen not in self._linked:
                continue
            for sender, msgs in a.agent.get_new_notifs().items():
                got.extend((a.gen, sender, m) for m in msgs)
        return got

    def linked(self) -> int:
        return len(self._linked)

    @property
    def scratch_base(self) -> int:
        return int(self.scratch.data_ptr()) if self.scratch.numel() else 0

    @property
    def scratch_bytes(self) -> int:
        return int(self.scratch.numel())

    def metadata(self) -> bytes:
        """One agent's metadata (a linked or spare one), as a Register carries it."""
        for agent in self._linked.values():
            return agent.metadata
        with self._lock:
            if self._spares:
                return self._spares[0].metadata
        raise RuntimeError("no NIXL agent yet")

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._stopping

    def close(self) -> None:
        """Destroy every agent (the caller guarantees no write can still come: shutdown)."""
        for agent in list(self._linked.values()):
            self.tear_down(agent)
        with self._lock:
            self._stopping = True
            self._work.notify()
        self._thread.join(_JOIN_S)
        with self._lock:
            left = list(self._spares) + list(self._torn)
            self._spares.clear()
            self._torn.clear()
        for agent in left:
            self._destroy(agent)

    # -- agents thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._torn and self._spares:
                    self._work.wait()
                if self._stopping:
                    return
                torn = self._torn.popleft() if self._torn else None
            if torn is not None:
                self._destroy(torn)
                self.stats.add("link_agents_torn_down")
                self._on_torn(torn.gen)
                continue
            try:
                spare = self._make()
            except Exception:
                log.exception("a NIXL agent for the next sender link could not be made")
                self.stats.add("link_agents_failed")
                with self._lock:
                    self._work.wait(_SPARE_RETRY_S)
                continue
            with self._lock:
                if self._stopping:
                    left: LinkAgent | None = spare
                else:
                    self._spares.append(spare)
                    left = None
            if left is not None:
                self._destroy(left)
                return
            self._on_spare()

    def _make(self) -> LinkAgent:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        settings, pool = self.settings, self.pool
        gen = next(self._gens)
        name = f"{self.name}.l{gen}"
        agent = nixl_agent(
            name,
            nixl_agent_config(
                enable_prog_thread=settings.progress_thread,
                backends=[],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        agent.create_backend(
            settings.backend,
            {
                "ucx_error_handling_mode": settings.ucx_error_handling_mode,
                "num_workers": str(settings.ucx_num_workers),
            },
        )
        regs = [
            agent.register_memory([pool.kv], mem_type=pool.mem_type),
            agent.register_memory([pool.aux], mem_type="DRAM"),
        ]
        if self.scratch.numel():
            regs.append(agent.register_memory([self.scratch], mem_type="DRAM"))
        self.stats.add("link_agents_made")
        return LinkAgent(gen, name, agent.get_agent_metadata(), agent, regs)

    @staticmethod
    def _destroy(agent: LinkAgent) -> None:
        """Deregister the pool and drop the agent: NIXL's destructor closes its UCX worker."""
        nixl, agent.agent = agent.agent, None
        if nixl is None:
            return
        for reg in agent.regs:
            try:
                nixl.deregister_memory(reg)
            except Exception:
                log.warning("deregistering the pool from %s failed", agent.name, exc_info=True)
        agent.regs = []
        # The binding's destructor runs when its last reference goes: here.
        inner = nixl.__dict__.pop("agent", None)
        del inner, nixl


class SharedAgent:
    """An injected data plane's one agent for every link: nothing per link to tear down."""

    proves = False

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self._one = LinkAgent(0, "", b"")
        # The data plane's scratch region, registered on its agent (none: no link probe).
        self.scratch_base = int(getattr(dataplane, "scratch_base", 0))
        self.scratch_bytes = int(getattr(dataplane, "scratch_bytes", 0))

    def metadata(self) -> bytes:
        return self.dataplane.metadata()

    def take(self) -> LinkAgent:
        self._one.metadata = self.dataplane.metadata()
        return self._one

    @property
    def closed(self) -> bool:
        return bool(getattr(self.dataplane, "closed", False))

    def tear_down(self, agent: LinkAgent) -> None:
        pass

    def notifications(self, agent: LinkAgent | None = None) -> list[tuple[int, str, bytes]]:
        return [(0, sender, m) for sender, m in self.dataplane.notifications()]

    def linked(self) -> int:
        return 0

    def close(self) -> None:
        self.dataplane.close()
