"""``/debug/state``: a sender's or receiver's hang dump, read without the services' locks.

The dump is JSON, formatted from the service's unlocked view
(``view(locked=False)``, kvxferd/transfer/views.py: copies of its tables taken
without their locks, a copy that races a change retried), so it answers during a
deadlock: the probe port (health.py) serves it from a worker thread with a deadline, to
the clients ``health.debug_state`` allows. Its shape is in :func:`sender_state`
and :func:`receiver_state`; each list holds the ``limit`` oldest entries.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvxferd import __version__
from kvxferd.transfer.session import RxState, TxState

if TYPE_CHECKING:
    from kvxferd.config import ReceiverSettings, SenderSettings
    from kvxferd.transfer.journal import Journal
    from kvxferd.transfer.receiver import Receiver
    from kvxferd.transfer.sender import Sender
    from kvxferd.transfer.views import RxFetchView, TxSessionView

DEBUG_LIST_LIMIT = 100  # entries per list in /debug/state (the oldest first)


def sender_state(
    sender: Sender, settings: SenderSettings, limit: int = DEBUG_LIST_LIMIT
) -> dict[str, Any]:
    """The sender's hang dump (``/debug/state``), from its unlocked view (no lock waited on).

    Ages and times in seconds (ms precision); each list holds the ``limit`` oldest::

        role "sender", id (sender_id: this incarnation), endpoint, version, uptime_s,
        draining; ProbeServer adds ready, not_ready [reasons], live, liveness
        sessions   {total, by_state {state: n}, oldest_age_s {state: age},
                    open [{request_id, session_id, state, age_s, writes_in_flight,
                           expected_fetches, ttl_in_s, aux_slot, layers_ready, outcome,
                           slices [{receiver_id, endpoint, fetch_id, state, age_s,
                                    writes_in_flight, posted_age_s, deadline_in_s,
                                    nbytes, reason}]}]}
                   open: sessions not ended, or ended with writes still in flight
                   (in doubt); outcome {state, reason, detail, in_doubt} or null;
                   layers_ready: a streamed publish's layers marked so far, else null
        topology   this rank's record (docs/topology.md) or null
        peers      [{receiver_id, endpoint, nixl_name, idle_s, writes_in_flight, prepped,
                     identity, decode_rank, version}]
                   receiver_id names the receiver's incarnation (name-uuid); identity: the
                   CURVE key (Z85) that registered it, "" when security is off;
                   decode_rank: its record's rank when it reads through the mapping;
                   version: the wire protocol version negotiated at its Register
        identities [{identity, peers, fetches, parked, receiver_ids}]  the ownership table:
                   what each identity holds (docs/security.md, limits per identity)
        retiring_peers [{nixl_name, writes_in_flight}]  replaced or evicted peers whose
                   NIXL agent is kept until their last write ends
        links      [{peer, receiver_id, state, gbps, transport, bytes, writes, age_s,
                     measured_at, detail}]  each link's latest probe (link_probes.py):
                   gbps null while probing or when it failed; measured_at: Unix time
        parked     {count, oldest [{request_id, receiver_id, fetch_id, age_s,
                    expires_in_s}]}  fetches waiting for their request to be published
        workers    [{index, alive, queue_depth, lanes_busy, writes_in_flight,
                     last_progress_age_s}]
        inline     {queue_depth, lanes_busy, writes_in_flight}: the listener's own writes
                   (requests up to inline_write_max_bytes), or null when it makes none
        aux_slots  {free, total}
        journal    {endings, idle_s, last_done_age_s, window_s,
                    peer_rates [{peer, failed, total, ratio}]}
        stats      {counter: value}
    """
    snd, now = sender.view(locked=False), time.monotonic()
    by_state = dict.fromkeys((st.value for st in TxState), 0)
    oldest: dict[str, float] = {}
    per_worker = [0] * len(snd.workers)
    inline_writes = 0
    listed: list[dict[str, Any]] = []
    for session in snd.sessions:
        state = session.state.value
        by_state[state] += 1
        oldest.setdefault(state, _age(now, session.created))
        for sl in session.slices:
            if sl.lane is None:
                continue
            if sl.lane < 0:
                inline_writes += sl.writes_in_flight
            else:
                per_worker[sl.lane] += sl.writes_in_flight
        if (not session.ended or session.writes_in_flight) and len(listed) < limit:
            listed.append(_tx_session_view(session, now))
    peers = [
        {
            "receiver_id": p.receiver_id,
            "endpoint": p.result_endpoint,
            "nixl_name": p.nixl_name,
            "idle_s": None if p.last_heard is None else _age(now, p.last_heard),
            "writes_in_flight": p.writes_in_flight,
            "prepped": p.prepped,
            "identity": p.identity,
            "decode_rank": p.decode_rank,
            "version": p.version,
        }
        for p in snd.peers
    ]
    identities = [
        {
            "identity": u.identity,
            "peers": u.peers,
            "fetches": u.fetches,
            "parked": u.parked,
            "receiver_ids": u.receiver_ids,
        }
        for u in snd.identities[:limit]
    ]
    inline = snd.inline
    return {
        "role": "sender",
        "id": snd.sender_id,
        "endpoint": snd.endpoint,
        "version": __version__,
        "uptime_s": _age(now, sender.journal.started),
        "draining": snd.draining,
        "sessions": {
            "total": len(snd.sessions),
            "by_state": by_state,
            "oldest_age_s": oldest,
            "open": listed,
        },
        "topology": None if snd.topology is None else msgspec.to_builtins(snd.topology),
        "peers": peers,
        "identities": identities,
        "retiring_peers": [
            {"nixl_name": r.nixl_name, "writes_in_flight": r.writes_in_flight} for r in snd.retiring
        ],
        "links": [
            {
                "peer": k.peer,
                "receiver_id": k.receiver_id,
                "state": k.state,
                "gbps": k.gbps,
                "transport": k.transport,
                "bytes": k.nbytes,
                "writes": k.writes,
                "age_s": _age(now, k.measured_mono),
                "measured_at": round(k.measured_at, 3),
                "detail": k.detail,
            }
            for k in snd.links[:limit]
        ],
        "parked": {
            "count": snd.parked_count,
            "oldest": [
                {
                    "request_id": p.request_id,
                    "receiver_id": p.receiver_id,
                    "fetch_id": p.fetch_id,
                    "age_s": _age(now, p.parked_at),
                    "expires_in_s": _age(p.deadline, now),
                }
                for p in snd.parked[:limit]
            ],
        },
        "workers": [
            {
                "index": w.index,
                "alive": w.alive,
                "queue_depth": w.queue_depth,
                "lanes_busy": w.lanes_busy,
                "writes_in_flight": per_worker[i],
                "last_progress_age_s": _age(now, w.last_progress),
            }
            for i, w in enumerate(snd.workers)
        ],
        # The listener's own writes (requests up to inline_write_max_bytes), if it makes any.
        "inline": None
        if inline is None
        else {
            "queue_depth": inline.queue_depth,
            "lanes_busy": inline.lanes_busy,
            "writes_in_flight": inline_writes,
        },
        "aux_slots": {"free": snd.aux_free, "total": settings.pool.aux_slots},
        "journal": _journal_view(sender.journal, now),
        "stats": sender.stats.snapshot(),
    }


def receiver_state(
    receiver: Receiver, settings: ReceiverSettings, limit: int = DEBUG_LIST_LIMIT
) -> dict[str, Any]:
    """The receiver's hang dump (``/debug/state``), from its unlocked view (no lock waited on).

    Ages and times in seconds (ms precision); each list holds the ``limit`` oldest::

        role "receiver", id (receiver_id: this incarnation), endpoint (result endpoint),
        version, uptime_s, draining; ProbeServer adds ready, not_ready, live, liveness
        fetches   {total, by_state {state: n}, oldest_age_s {state: age},
                   oldest [{fetch_id, request_id, state, fence, age_s, sender_endpoint,
                            sent, sent_to, deadline_in_s, fence_deadline_in_s,
                            aux_slot, blocks, reason}]}
                  every fetch in the table: open ones, and ended ones whose fence is up
                  (sent_to: the sender incarnation it was last sent to)
        in_doubt  {count, tracked, oldest [same fields + next_retry_in_s]}  ended with
                  a write possibly still landing; blocks and aux slot kept
        aux_slots {free, quarantined, total}
        links     [{endpoint, ready, sender_id, waiting, ever_connected, disconnected,
                    down, register_deadline_in_s, version}]  sender_id: the incarnation that
                  answered; waiting: fetches queued until it registers; down: lost and
                  not answering (its fetches fail peer_lost at once); version: the wire
                  protocol version spoken on it (negotiated at Register)
        commands_queued, io_thread {alive, last_progress_age_s}
        journal   {endings, idle_s, last_done_age_s, window_s, peer_rates [...]}
        stats     {counter: value}
    """
    rx, now = receiver.view(locked=False), time.monotonic()
    by_state = dict.fromkeys((st.value for st in RxState), 0)
    oldest: dict[str, float] = {}
    for f in rx.fetches:
        by_state[f.state.value] += 1
        oldest.setdefault(f.state.value, _age(now, f.started))
    return {
        "role": "receiver",
        "id": rx.receiver_id,
        "endpoint": rx.result_endpoint,
        "version": __version__,
        "uptime_s": _age(now, receiver.journal.started),
        "draining": rx.draining,
        "fetches": {
            "total": len(rx.fetches),
            "by_state": by_state,
            "oldest_age_s": oldest,
            "oldest": [_rx_fetch_view(f, now) for f in rx.fetches[:limit]],
        },
        "in_doubt": {
            "count": rx.in_doubt.count,
            "tracked": len(rx.in_doubt.tracked),
            "oldest": [
                {**_rx_fetch_view(f, now), "next_retry_in_s": _age(f.retry_at, now)}
                for f in rx.in_doubt.tracked[:limit]
            ],
        },
        "aux_slots": {
            "free": rx.aux_free,
            "quarantined": rx.aux_quarantined,
            "total": settings.pool.aux_slots,
        },
        "links": [
            {
                "endpoint": link.endpoint,
                "ready": link.ready,
                "sender_id": link.sender_id,
                "waiting": link.waiting,
                "ever_connected": link.ever_connected,
                "disconnected": link.disconnected,
                "down": link.down,
                "register_deadline_in_s": None if link.ready else _age(link.register_deadline, now),
                "version": link.version,
            }
            for link in rx.links[:limit]
        ],
        "commands_queued": rx.commands_queued,
        "io_thread": {
            "alive": rx.io_alive,
            "last_progress_age_s": _age(now, rx.io_progress),
        },
        "journal": _journal_view(receiver.journal, now),
        "stats": receiver.stats.snapshot(),
    }


def _journal_view(journal: Journal, now: float) -> dict[str, Any]:
    return {
        "endings": journal.endings,
        "idle_s": round(journal.idle_s(now), 3),
        "last_done_age_s": _age(now, journal.last_done) if journal.last_done else None,
        "window_s": journal.window_s,
        "peer_rates": [
            {"peer": r.peer, "failed": r.failed, "total": r.total, "ratio": round(r.ratio, 3)}
            for r in journal.peer_rates(now)
        ],
    }


def _tx_session_view(session: TxSessionView, now: float) -> dict[str, Any]:
    outcome = session.outcome
    return {
        "request_id": session.request_id,
        "session_id": session.session_id,
        "state": session.state.value,
        "age_s": _age(now, session.created),
        "writes_in_flight": session.writes_in_flight,
        "expected_fetches": session.expected_fetches,
        "ttl_in_s": None if session.slices else _age(session.ttl_deadline, now),
        "aux_slot": session.aux_slot,
        "layers_ready": session.layers_ready,
        "outcome": None
        if outcome is None
        else {
            "state": outcome.state.value,
            "reason": outcome.reason,
            "detail": outcome.detail,
            "in_doubt": outcome.in_doubt,
        },
        "slices": [
            {
                "receiver_id": sl.receiver_id,
                "endpoint": sl.result_endpoint,
                "fetch_id": sl.fetch_id,
                "state": sl.state.value,
                "age_s": _age(now, sl.attached_at),
                "writes_in_flight": sl.writes_in_flight,
                "posted_age_s": _age(now, sl.posted_at) if sl.posted_at else None,
                "deadline_in_s": _age(sl.deadline, now),
                "nbytes": sl.nbytes,
                "reason": sl.reason,
            }
            for sl in session.slices
        ],
    }


def _rx_fetch_view(f: RxFetchView, now: float) -> dict[str, Any]:
    return {
        "fetch_id": f.fetch_id,
        "request_id": f.request_id,
        "state": f.state.value,
        "fence": f.fence.value,
        "age_s": _age(now, f.started),
        "sender_endpoint": f.sender_endpoint,
        "sent": f.sent,
        "sent_to": f.sent_to,
        "deadline_in_s": _age(f.deadline, now),
        "fence_deadline_in_s": _age(f.fence_deadline, now) if f.fence_deadline else None,
        "aux_slot": f.aux_slot,
        "blocks": f.blocks,
        "reason": f.reason,
    }


def _age(now: float, then: float) -> float:
    """``now - then`` in seconds, rounded to the millisecond (JSON stays short)."""
    return round(now - then, 3)
