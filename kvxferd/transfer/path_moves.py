"""Path moves: a peer whose transport failed or stalled gets a fresh connection.

The data plane's docstring says why (UCX never reopens a failed endpoint; a connection whose
data sat in a cut link waits out TCP's backoff). Each peer's next write takes its current
*path* (:class:`Path`: a local NIXL agent with the pool registered; :class:`Routes` says
which). :meth:`PathMoves.route_locked` picks it for each post, and when the key is broken
(no write in flight) or stalled (a write in flight ``stall_s`` or more):

* ``max_paths`` above 1: once the peer has been heard from since the trouble began, a
  ``kvxferd-dp-connect`` thread (one per moving peer; this class owns it) loads the peer on
  a spare path reserved for it (or a path it opens), prepares its lists there, and moves the
  peer (``transport_fresh_paths``). Until then a post behind a stalled write is refused
  (:class:`PathStalled`) and one toward a failed transport goes to it (and fails fast).
* ``max_paths`` 1: the failed peer is reloaded in place, by the posting thread, with the
  lock released around NIXL and the peer claimed (``transport_reconnects``).

A spare path goes::

    free --a move reserves it (owner, connecting)--> connecting --loaded--> owned by the peer
    connecting --the load failed, or the peer removed / the plane closed--> free
    owned --its peer moved on--> free

**Locking rule.** No lock of its own: it is handed the data plane's lock and the tables that
lock guards (:class:`Routes`, :class:`~kvxferd.transfer.loaded_peers.LoadedPeers`,
:class:`~kvxferd.transfer.dlists.PreparedLists`, the list of paths, appended under it).
``route_locked`` runs with that lock held and releases it only inside a reload in place;
the connect thread takes it only to read and change the tables, never across a NIXL call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvxferd.transfer.dlists import Args, Lists, PieceArgs, PreparedLists, Whole, release
from kvxferd.transfer.loaded_peers import LoadedPeers
from kvxferd.transfer.peer_connects import PeerConnects
from kvxferd.transfer.routes import Key, Routes

if TYPE_CHECKING:
    from kvxferd.stats import Stats
    from kvxferd.transfer.dataplane import Prep

log = logging.getLogger("kvxferd.dataplane")


class PathStalled(RuntimeError):
    """Nothing was posted: a write toward this peer is stalled on its connection (a fresh one
    is opened once the peer is heard from again). Not a failure of the peer itself."""


class Path:
    """One local NIXL agent with the pool registered; UCX opens one endpoint per peer it loads.

    Path 0 is the agent whose metadata this process hands out. More paths are opened only
    when writes toward a peer stall (the module docstring), at most ``max_paths`` in all.
    """

    __slots__ = ("index", "agent", "regs", "local", "owner", "connecting")

    def __init__(self, index: int, agent: Any, regs: list[object]) -> None:
        self.index = index
        self.agent = agent
        self.regs = regs
        self.local: object | None = None  # its prepared list of the local pool (first prep)
        self.owner: str | None = None  # a spare path serves one peer at a time (path 0: all)
        self.connecting = False  # a connect thread is using the agent: nobody else touches it


class PathMoves:
    """Routes each post, moves peers to fresh paths (its connect threads), reloads in place."""

    def __init__(
        self,
        lock: threading.Lock,
        routes: Routes,
        peers: LoadedPeers,
        lists: PreparedLists,
        connects: PeerConnects,
        paths: list[Path],
        open_path: Callable[[int], Path],
        prep: Prep,
        *,
        stall_s: float | None,
        heard_from: Callable[[str], float] | None,
        stats: Stats | None,
    ) -> None:
        self._lock = lock
        self._routes = routes
        self._peers = peers
        self._lists = lists
        self._connects = connects
        self._paths = paths
        self._open_path = open_path
        self._prep = prep
        self._stall_s = stall_s
        self._heard_from = heard_from
        self._stats = stats
        self.reconnects = 0  # failed transports reconnected so far
        self.fresh_paths = 0  # peers moved to a fresh connection after a stall
        # Called with a peer's name once its transport is fresh (moved or reloaded in place),
        # under the lock: the sender probes that link again (link_probes.py). Must not block.
        self.on_moved: Callable[[str], object] | None = None

    def mark_broken(self, key: Key) -> None:
        with self._lock:
            if key[0] in self._peers and self._routes.mark_broken(key):
                log.warning(
                    "transport to %s (path %d) failed: reconnecting it once no write is in flight",
                    *key,
                )

    def route_locked(self, peer: str, free: list[tuple[Any, object]], max_paths: int) -> Path:
        """The path the next write toward ``peer`` takes (with the lock held).

        Its current path, unless that one's transport failed (no write in flight there) or a
        write on it stalled. Then, with ``max_paths`` above 1, a connect thread opens a fresh
        connection on a spare path once the peer has been heard from since (the module
        docstring); until it has moved, a post behind a stalled write is refused
        (:class:`PathStalled`, nothing posted) and one toward a failed transport goes to it
        (and fails fast). With ``max_paths`` 1 a failed transport is reloaded in place, here,
        with the lock released meanwhile (``_reload``). A post toward a peer whose remote
        agent another thread is loading or removing waits for it (milliseconds).
        """
        self._peers.wait_unclaimed(peer)
        if self._peers.closed:
            raise RuntimeError("the data plane is closed")
        path = self._paths[self._routes.path_of(peer)]
        key = (peer, path.index)
        broken, stalled = self._routes.trouble(key, self._stall_s)
        if not (broken or stalled):
            return path
        if max_paths < 2:
            if broken:
                self._reload(path, peer, free)
                if self._peers.closed:
                    raise RuntimeError("the data plane is closed")
                self._routes.heal(key)
                self._count_reconnect(peer, path, "reconnected in place", fresh=False)
            return path
        self._start_move_locked(peer, path, key, broken, max_paths)
        if stalled:
            # Posting behind a stalled write only stalls another one (and quarantines more
            # memory on both sides): refused, nothing posted, until the peer has moved.
            raise PathStalled(f"a write to {peer} is stalled on its connection (path {path.index})")
        return path

    def _start_move_locked(
        self, peer: str, path: Path, key: Key, broken: bool, max_paths: int
    ) -> None:
        """Start a connect thread moving ``peer`` off ``path``, if none runs, a path is free,
        and the peer has been heard from since the trouble began (``heard_from``)."""
        routes = self._routes
        if peer in routes.moving:
            return
        writes = routes.inflight.get(key)
        if self._heard_from is not None:
            # A connect into a cut link waits out SYN backoff inside NIXL and would still be
            # waiting seconds after the heal: connect once the peer has sent us a message
            # since the write was found stalled or the transport failed.
            since = (
                routes.broken_at.get(key, 0.0)
                if broken or not writes
                else min(writes.values()) + (self._stall_s or 0.0)
            )
            if self._heard_from(peer) <= since:
                return
        spare = next(
            (
                p
                for p in self._paths[1:]
                if p is not path
                and p.owner is None
                and not p.connecting
                and not routes.busy(p.index)
            ),
            None,
        )
        if spare is None and len(self._paths) + routes.opening >= max_paths:
            return  # every path is in use
        if spare is not None:
            spare.owner, spare.connecting = peer, True
        else:
            routes.opening += 1
        routes.moving.add(peer)
        why = "failed" if broken else f"stalled on path {path.index}"
        threading.Thread(
            target=self._connect,
            args=(peer, spare, why),
            name="kvxferd-dp-connect",
            daemon=True,
        ).start()

    def _connect(self, peer: str, spare: Path | None, why: str) -> None:
        """Connect thread: load ``peer`` on ``spare`` (or a new path) and move it there.

        Runs without the lock: NIXL may block in ``add_remote_agent`` until the peer is
        reachable again (a cut link: seconds to minutes), and only this thread waits. The
        path is reserved for it (``connecting``): no write, poll or progress touches it.
        """
        t0 = time.monotonic()
        free: list[tuple[Any, object]] = []
        path = spare
        ok = False
        routes = self._routes
        try:
            if path is None:
                opened = self._open_path(-1)  # its index once added, below
                with self._lock:
                    routes.opening -= 1
                    opened.index = len(self._paths)
                    opened.owner, opened.connecting = peer, True
                    self._paths.append(opened)
                    path = opened
            ok = self._load_on(path, peer, free)
        except Exception:
            log.warning("opening a fresh connection to %s failed", peer, exc_info=True)
            if path is None:
                with self._lock:
                    routes.opening -= 1
        finally:
            with self._lock:
                routes.moving.discard(peer)
                if path is not None:
                    path.connecting = False
                    if ok and self._peers.live(peer):
                        old = self._paths[routes.path_of(peer)]
                        if old.owner == peer:
                            old.owner = None
                        routes.move(peer, path.index)
                        self._count_reconnect(
                            peer,
                            path,
                            f"{why}: moved to a fresh connection in {(time.monotonic() - t0) * 1000:.0f} ms",
                            fresh=True,
                        )
                    else:
                        path.owner = None
            release(free)
        log.info("connect thread for %s ended in %.1f ms", peer, (time.monotonic() - t0) * 1000)

    def _load_on(self, path: Path, peer: str, free: list[tuple[Any, object]]) -> bool:
        """Load ``peer`` afresh on a path reserved for the caller; its prepared list too."""
        with self._lock:
            meta = self._peers.meta.get(peer)
            args = self._lists.args.get(peer)
            key = (peer, path.index)
            stale = key in self._routes.loaded
            self._lists.retire(key, path.agent, free)
            self._routes.loaded.discard(key)
        if meta is None:
            return False
        agent = path.agent
        if stale:
            try:
                agent.remove_remote_agent(peer)
            except Exception:
                log.warning("removing the stale remote agent %s raised", peer, exc_info=True)
        agent.add_remote_agent(meta)
        lists = None
        if args is not None and self._prep.want:
            if path.local is None and isinstance(args, Whole):
                path.local = self._prep.whole(agent)
            lists = self._prep.lists(path, peer, args)
        with self._lock:
            self._routes.load(key)
            if lists is not None and self._peers.live(peer):
                self._lists.install(key, lists)
            elif lists is not None:  # removed (or closed) meanwhile: nobody will post with them
                free.extend(lists.handles(agent))
        return args is None or lists is not None

    def _count_reconnect(self, peer: str, path: Path, what: str, fresh: bool) -> None:
        if fresh:
            self.fresh_paths += 1
        else:
            self.reconnects += 1
        if self._stats is not None:
            self._stats.add("transport_fresh_paths" if fresh else "transport_reconnects")
        if self.on_moved is not None:
            self.on_moved(peer)
        log.warning("transport to %s %s (path %d)", peer, what, path.index)

    def _reload(self, path: Path, peer: str, free: list[tuple[Any, object]]) -> None:
        """``max_paths`` 1: load a failed ``peer`` again on its one path.

        Called with the lock held; releases it around NIXL (a probe first, as for
        ``add_peer``: the peer may be unreachable) and holds it again on return. The peer is
        claimed meanwhile: other posts toward it wait, posts toward other peers do not.
        """
        meta = self._peers.meta.get(peer)
        if meta is None:
            return
        key = (peer, path.index)
        args = self._lists.args.get(peer)
        self._lists.retire(key, path.agent, free)
        self._peers.claim(peer)  # the caller checked that nobody had claimed it
        lists: Lists | None = None
        self._lock.release()
        try:
            lists = self._reload_unlocked(path, peer, meta, args)
        finally:
            self._lock.acquire()
            self._peers.unclaim(peer)
        if lists is None:
            return
        if (
            self._peers.live(peer)
            and self._lists.args.get(peer) is args
            and key not in self._lists.current
        ):
            self._lists.install(key, lists)
        else:  # removed, closed or prepared again meanwhile: nobody will post with these
            free.extend(lists.handles(path.agent))

    def _reload_unlocked(
        self, path: Path, peer: str, meta: bytes, args: Args | None
    ) -> Lists | None:
        """``_reload``'s NIXL calls (the lock not held, ``peer`` claimed): its lists, or None."""
        try:
            self._connects.probe(meta)
        except Exception:
            log.warning("reconnecting %s failed; next post tries again", peer, exc_info=True)
            return None
        try:
            path.agent.remove_remote_agent(peer)
        except Exception:
            log.warning("removing the failed remote agent %s raised", peer, exc_info=True)
        try:
            path.agent.add_remote_agent(meta)
        except Exception:
            log.warning("reconnecting %s failed; next post tries again", peer, exc_info=True)
            return None
        if args is None or not self._prep.want:
            return None
        if isinstance(args, PieceArgs) or self._prep.local(path):
            return self._prep.lists(path, peer, args)
        return None
