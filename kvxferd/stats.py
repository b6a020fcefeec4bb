"""Counters every part bumps, and the catalogue that exports each one on /metrics.

:class:`Stats` holds named counters (thread-safe). :data:`CATALOGUE` lists every
name any component bumps, with its help text and the Prometheus family it is
exported as; ``tests/test_metrics.py`` reads kvxferd/ with ``ast`` and fails on a
``stats.add(...)`` whose name is not here, so a counter cannot exist only inside
the process. Components: ``sender`` (sender/, worker*.py, path_moves.py), ``receiver``
(receiver/), ``gateway`` (gateway.py, calls.py, waits.py, handles.py); guard.py's counters
are everyone's.

Exported names: a plain counter ``<key>`` is ``kvxferd_<key>_total``
(``kvxferd_gateway_<key>_total`` for the gateway's own Stats). A family's key has
one ``{label}`` placeholder (``rejected_{reason}``) and is one labelled counter
whose label values are a fixed tuple (an enum's values, message tags), every
value exported, zero included; ``worker_{worker}_slices`` is labelled by worker
index (bounded by ``num_threads``). A few keep the names they had before the
catalogue: ``kvxferd_outcomes_total``, ``kvxferd_bytes_total``,
``kvxferd_rejections_total``, ``kvxferd_worker_slices_total``.

Label values are bounded (reason codes, states, tags, worker indices), never request ids.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, deque
from dataclasses import dataclass

from kvxferd.errors import Reason


class Stats:
    """Thread-safe named counters; ``snapshot()`` for tests, logs and the metrics endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, deque[float]] = {}

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def observe(self, name: str, value: float) -> None:
        """Record one sample (e.g. a transfer duration in seconds); the newest 65,536 are kept."""
        with self._lock:
            q = self._samples.get(name)
            if q is None:
                q = self._samples[name] = deque(maxlen=65_536)
            q.append(value)

    def take_samples(self, name: str) -> list[float]:
        """The samples recorded since the last call (a metrics exporter drains them)."""
        with self._lock:
            q = self._samples.get(name)
            if not q:
                return []
            out = list(q)
            q.clear()
            return out


# -- the catalogue ------------------------------------------------------------------------------

SENDER, RECEIVER, GATEWAY = "sender", "receiver", "gateway"
_SERVICE = frozenset({SENDER, RECEIVER})
_EVERYONE = frozenset({SENDER, RECEIVER, GATEWAY})

REASONS: tuple[str, ...] = tuple(r.value for r in Reason)
# kvxferd.engine.engine_protocol.EngineReason (every Reason plus the gateway's own); a test keeps
# the two equal, so this module needs no import of the engine side.
GATEWAY_REASONS: tuple[str, ...] = (*REASONS, "unknown_handle", "wrong_role", "internal")
# The engine calls (kvxferd.engine.engine_protocol.ToGateway tags) and the sender workers' messages.
GATEWAY_CALLS: tuple[str, ...] = (
    "describe",
    "publish",
    "fetch",
    "lookup",
    "wait",
    "poll",
    "cancel",
    "close",
    "progress",
    "links",
)
WORKER_MESSAGES: tuple[str, ...] = ("result", "cancel_ack")
# Why a streamed publish's progress mark is refused (streams.py; the gateway: wrong_role).
STREAM_MARK_REFUSALS: tuple[str, ...] = (
    "unknown",
    "not_streamed",
    "decreasing",
    "past_end",
    "wrong_role",
)
# kvxferd.auth.REFUSALS and HANDSHAKE_KINDS (a test keeps them equal).
AUTH_REFUSALS: tuple[str, ...] = ("unknown_key", "mechanism", "unknown_domain", "malformed")
HANDSHAKE_KINDS: tuple[str, ...] = ("protocol", "auth", "no_detail")

# How a link probe ended (kvxferd/transfer/link_probes.py).
LINK_PROBE_RESULTS: tuple[str, ...] = ("ok", "failed", "timeout", "dropped")
# sender/handover.py and sender/adopt.py: what became of each request of a handover.
HANDOVER_RESULTS: tuple[str, ...] = (
    "moved",
    "kept",
    "no_target",
    "adopted",
    "adopt_refused",
    "adopt_failed",
)

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class CounterSpec:
    """One Stats name (or family of names) and how /metrics exports it."""

    key: str  # the Stats name; a family has one "{label}" placeholder: "rejected_{reason}"
    help: str
    components: frozenset[str]  # whose Stats bump it: sender, receiver, gateway
    metric: str = ""  # the exported family (without _total); "" = kvxferd_[gateway_]<key>
    values: tuple[str, ...] = ()  # a family's label values; () = worker indices

    @property
    def label(self) -> str:
        m = _PLACEHOLDER.search(self.key)
        return m.group(1) if m else ""

    @property
    def prefix(self) -> str:
        return self.key.split("{", 1)[0]

    @property
    def suffix(self) -> str:
        return self.key.rsplit("}", 1)[1] if self.label else ""

    def metric_for(self, component: str) -> str:
        if self.metric:
            return self.metric
        base = self.key.split("_{", 1)[0] if self.label else self.key
        return f"kvxferd_gateway_{base}" if component == GATEWAY else f"kvxferd_{base}"

    def stats_key(self, value: str) -> str:
        """The Stats name of one label value of a family."""
        return f"{self.prefix}{value}{self.suffix}"


def _c(key: str, components: frozenset[str], help: str, **kw: object) -> CounterSpec:
    return CounterSpec(key, help, components, **kw)  # type: ignore[arg-type]


_S, _R, _G = frozenset({SENDER}), frozenset({RECEIVER}), frozenset({GATEWAY})

CATALOGUE: tuple[CounterSpec, ...] = (
    # -- kept under their first names ----------------------------------------------------
    _c(
        "rejected_{reason}",
        _SERVICE,
        "Messages or requests refused, by reason (sender: a peer's message, a publish, a "
        "fetch; receiver: an undecodable frame from a sender, or a message no sender sends to "
        "the result socket)",
        metric="kvxferd_rejections",
        values=REASONS,
    ),
    _c(
        "slices_{outcome}",
        _S,
        "Final results: slices (one receiver's fetch of a published request) by outcome",
        metric="kvxferd_outcomes",
        values=("done", "failed", "in_doubt"),
    ),
    _c(
        "fetches_{outcome}",
        _R,
        "Final results: fetches by outcome",
        metric="kvxferd_outcomes",
        values=("done", "failed", "cancelled", "timed_out"),
    ),
    _c("bytes_written", _S, "KV bytes written to receivers", metric="kvxferd_bytes"),
    _c("bytes_received", _R, "KV bytes received from senders", metric="kvxferd_bytes"),
    _c(
        "worker_{worker}_slices",
        _S,
        "Slices a worker thread finished (any outcome)",
        metric="kvxferd_worker_slices",
    ),
    _c(
        "inline_slices",
        _S,
        "Slices the listener wrote itself (requests up to inline_write_max_bytes; any outcome)",
    ),
    _c(
        "slices_done_notified",
        _S,
        "Done slices told to their receiver by a NIXL notification instead of a Result",
    ),
    _c("digests_computed", _S, "Done Results carrying a digest of the bytes written (asked for)"),
    _c(
        "digest_errors",
        _S,
        "Digests the sender could not compute: the done Result carries none (the receiver fails it)",
    ),
    _c(
        "writes_coalesced",
        _S,
        "Slices written in a WRITE shared with an earlier slice of the same receiver",
    ),
    # -- sender: engine side -------------------------------------------------------------
    _c("published", _S, "Requests the engine published"),
    _c("streams_published", _S, "Streamed publishes (published before their KV was computed)"),
    _c("stream_marks", _S, "Progress marks of streamed publishes accepted"),
    _c(
        "stream_marks_refused_{why}",
        _S | _G,
        "Progress marks refused, by why (unknown: no open publish or handle; not_streamed;"
        " decreasing; past_end: over num_layers; wrong_role: sent to a receiver); the publish"
        " fails bad_progress",
        values=STREAM_MARK_REFUSALS,
    ),
    _c(
        "stream_writes",
        _S,
        "WRITEs of a ready layer range of a streamed publish (one per range and fetch)",
    ),
    _c(
        "streams_aborted",
        _S,
        "Streamed publishes that ended before their last layer was marked (cancel, engine"
        " connection closed, failure, drain, stall): their fetches ended failed at once",
    ),
    _c(
        "streams_stalled",
        _S,
        "Streamed publishes failed stream_stalled: no progress mark for stream_stall_timeout_ms",
    ),
    _c(
        "sessions_expired",
        _S,
        "Published requests nobody fetched within publish_ttl_ms (reclaimed)",
    ),
    _c(
        "shutdown_refusals_skipped",
        _S,
        "Parked fetches not told about the shutdown because its deadline was near",
    ),
    _c(
        "released_unread",
        _S,
        "Requests published with expected_fetches 0 (no decode rank reads this prefill rank's"
        " copy): released at publish",
    ),
    _c(
        "reader_lease_expired",
        _S,
        "Published requests some but not all of whose expected readers came before"
        " publish_ttl_ms (the readers' lease): reclaimed, logged with the counts",
    ),
    _c(
        "topology_refused",
        _SERVICE,
        "Topology pairs the reshard mapping cannot serve (sender: at REGISTER, refused"
        " incompatible; receiver: planning a fetch from a prefill instance)",
    ),
    _c("instance_fetches", _R, "Fetches from a prefill instance (several sender ranks)"),
    _c(
        "discovery_keys_learned",
        _R,
        "Sender keys learned from discovery records (in the allow-list: expected at that endpoint)",
    ),
    _c(
        "discovery_keys_refused",
        _R,
        "Sender keys in discovery records not in the allow-list, or with security off (ignored)",
    ),
    _c("instance_pieces", _R, "Pieces (one RequestData each) those fetches were planned into"),
    _c(
        "instance_fetches_busy",
        _R,
        "Instance fetches failed busy at planning: their pieces would pass max_fetches_in_flight",
    ),
    _c(
        "instance_fetches_failed",
        _R,
        "Fetches from a prefill instance ended before planning (no record, refused, unreachable)",
    ),
    # -- sender: peers and handshakes ----------------------------------------------------
    _c("registers_accepted", _S, "REGISTERs answered ok (new peers and repeats)"),
    _c("registers_refused", _S, "REGISTERs refused (reason in kvxferd_rejections_total)"),
    _c(
        "registers_refused_owner",
        _S,
        "REGISTERs refused not_authorized: another identity's receiver id, NIXL agent, route"
        " or result endpoint",
    ),
    _c(
        "messages_refused_identity",
        _S,
        "RequestData/Cancel refused not_authorized: sent on a route registered by another identity",
    ),
    _c(
        "peers_told_revoked",
        _S,
        "Reject{not_authorized} sent to a registered peer whose key left the allow-list",
    ),
    _c(
        "fetches_refused_token",
        _S,
        "Fetches refused not_authorized: the request's fetch token missing or wrong",
    ),
    _c(
        "fetches_refused_receiver",
        _S,
        "Fetches refused not_authorized: the receiver is not in the request's allowed_receivers",
    ),
    _c(
        "peers_reclaimed",
        _S,
        "Registered peers idle past orphan_ttl_ms with nothing open, removed from the table",
    ),
    _c(
        "bindings_reclaimed",
        _S,
        "Receiver ids / NIXL names released orphan_ttl_ms after their peer left (ownership.py)",
    ),
    _c("peers_registered", _S, "New peers registered (a NIXL remote agent added)"),
    _c(
        "peers_registered_previous_version",
        _S,
        "Peers registered at the previous release's wire protocol version (negotiated down)",
    ),
    _c("peers_replaced", _S, "Peers replaced by a new receiver process at their result endpoint"),
    _c(
        "fetches_ended_peer_restarted",
        _S,
        "Open fetches of a receiver ended peer_restarted when a new incarnation replaced it",
    ),
    _c(
        "writes_refused_peer_gone",
        _S,
        "Writes not started because their receiver incarnation was replaced",
    ),
    _c(
        "messages_dropped_peer_gone",
        _S,
        "Results/CancelAcks not sent because their receiver incarnation was replaced",
    ),
    _c(
        "peers_invalidated",
        _S,
        "Peers forgotten after a NIXL write error (their next fetch registers them again)",
    ),
    _c(
        "peer_removals_cancelled",
        _S,
        "Deferred NIXL peer removals cancelled because the same receiver registered again",
    ),
    _c("peers_evicted", _S, "Idle peers evicted because the peer table (max_peers) was full"),
    _c("peers_removed", _S, "NIXL remote agents removed (after a replacement or eviction)"),
    _c(
        "peer_removals_deferred",
        _S,
        "Peer removals deferred until the writes toward that peer ended",
    ),
    # -- sender: fetches -----------------------------------------------------------------
    _c("fetches_parked", _S, "Fetches that arrived before their request was published (parked)"),
    _c(
        "parked_fetches_expired",
        _S,
        "Parked fetches whose request was not published within pending_fetch_ttl_ms (reclaimed)",
    ),
    _c("cancels", _S, "CANCELs received from registered receivers"),
    # -- sender: writes ------------------------------------------------------------------
    _c("writes_refused", _S, "Writes not started: the session had ended (refused at admission)"),
    _c("writes_build_failed", _S, "Writes that could not be built or posted"),
    _c("writes_failed", _S, "Writes NIXL reported failed"),
    _c("writes_stalled", _S, "Writes still in progress past xfer_stall_timeout_ms (in doubt)"),
    _c(
        "writes_refused_stalled_path",
        _S,
        "Writes not posted: another write to the same receiver is stalled on its connection",
    ),
    _c(
        "transport_reconnects",
        _S,
        "Receivers whose failed NIXL transport was loaded again (a fresh UCX endpoint)",
    ),
    _c(
        "transport_fresh_paths",
        _S,
        "Receivers whose writes stalled, moved to a fresh connection (another local NIXL agent)",
    ),
    _c(
        "link_probes_{result}",
        _S,
        "Link probes (timed WRITEs into a receiver's scratch region at each new link) by how"
        " they ended: ok (kvxferd_link_gbps set), failed, timeout (link_probe_timeout_ms),"
        " dropped (queue full, or the peer left first)",
        values=LINK_PROBE_RESULTS,
    ),
    _c(
        "writes_in_doubt",
        _S,
        "Writes whose NIXL handle could not be released (status check raised, release refused)",
    ),
    _c(
        "in_doubt_resolved",
        _SERVICE,
        "Outcomes in doubt that resolved (sender: a stalled write ended and was released; "
        "receiver: the sender said no write is in flight): blocks reusable again",
    ),
    # -- the drain (kvxferd/service/daemon.py; the last log line counts the same) ------------------
    _c(
        "drain_dropped_never_fetched",
        _S,
        "Published requests the drain ended with no fetch attached (never fetched)",
    ),
    _c(
        "drain_dropped_cut",
        _SERVICE,
        "Transfers the drain ended unfinished (sender: a fetch attached; receiver: a fetch open)",
    ),
    _c(
        "drain_dropped_in_doubt",
        _SERVICE,
        "Requests or fetches with a write possibly in flight when the shutdown ended",
    ),
    # -- the handover (sender/handover.py, sender/adopt.py, receiver/moved.py) ------------
    _c(
        "handover_{result}",
        _S,
        "Requests of a drain's handover, by result (draining sender: moved, kept: refused or "
        "not taken by the target, no_target: none reachable; adopting sender: adopted, "
        "adopt_refused, adopt_failed)",
        metric="kvxferd_handover_requests",
        values=HANDOVER_RESULTS,
    ),
    _c("adopt_blocks_taken", _S, "Reserved blocks taken for adopted requests (adopt_blocks)"),
    _c(
        "adopt_blocks_returned",
        _S,
        "Reserved blocks free again (the adopted publish ended, or its fetch failed)",
    ),
    _c("moved_redirects", _S, "Fetches of a moved request answered with its new sender (moved)"),
    _c(
        "fetches_held_moving",
        _S,
        "Fetches held while their request moved to another sender (then answered moved or served)",
    ),
    _c("moved_told", _S, "Moved messages a draining sender sent to its receivers"),
    _c("fetches_redirected", _R, "Fetches re-sent to the sender a moved request went to"),
    _c("moved_learned", _R, "Moved requests learnt from a draining sender (Moved, moved Results)"),
    _c("moved_followed", _R, "Fetches sent straight to the sender a request moved to"),
    # -- messages ------------------------------------------------------------------------
    _c(
        "sent_{message}",
        _S,
        "Results and CancelAcks the workers sent to receivers",
        metric="kvxferd_messages_sent",
        values=WORKER_MESSAGES,
    ),
    _c(
        "send_timeouts",
        _SERVICE,
        "Messages dropped because the peer did not read them within their send deadline",
    ),
    _c("send_errors", _S, "Messages dropped on a ZMQ error"),
    _c(
        "reply_dropped",
        _S | _G,
        "Replies on the ROUTER that could not be sent (the peer or engine is gone or not reading)",
    ),
    # -- receiver ------------------------------------------------------------------------
    _c(
        "fetch_refused_{reason}",
        _R,
        "Fetches the engine asked for and this receiver refused at once, by reason",
        metric="kvxferd_fetch_refusals",
        values=REASONS,
    ),
    _c(
        "failed_{reason}",
        _R,
        "Fetches failed here before a write could start (not sent, link dropped, sender "
        "restarted), by reason",
        metric="kvxferd_fetch_failures",
        values=REASONS,
    ),
    _c(
        "peer_rejected_{reason}",
        _R,
        "Reject messages received from senders (a message of ours they could not take), by reason",
        metric="kvxferd_peer_rejections",
        values=REASONS,
    ),
    _c("requests_sent", _R, "REQUEST_DATA messages sent"),
    _c("notifications", _R, "Fetches completed by their sender's NIXL notification"),
    _c(
        "notifications_refused",
        _R,
        "Notification records dropped: wrong nonce, or not from the sender the fetch was sent to",
    ),
    _c("notifications_unknown", _R, "NIXL notifications that were not kvxferd's (dropped)"),
    _c("digests_checked", _R, "Done fetches whose digest was checked against what landed"),
    _c(
        "digests_checked_off_io",
        _R,
        "Of those, checked on the kvxferd-rx-digest thread (over integrity.digest_inline_bytes)",
    ),
    _c(
        "digest_mismatches",
        _R,
        "Fetches failed digest_mismatch: what landed is not what the sender wrote",
    ),
    _c(
        "cancels_sent", _R, "CANCELs sent (a cancel, a timeout, or asking again about one in doubt)"
    ),
    _c(
        "late_messages",
        _R,
        "Results or CancelAcks for a fetch this receiver no longer tracks (arrived too late)",
    ),
    _c("registers_sent", _R, "REGISTERs sent to senders"),
    _c(
        "register_version_fallbacks",
        _R,
        "REGISTERs sent again at the previous wire protocol version after a sender refused"
        " the newest one (unsupported_version: a sender of the previous release)",
    ),
    _c(
        "endpoints_refused",
        _R,
        "Fetches refused not_authorized: the sender endpoint is not in access.dial_allow",
    ),
    _c(
        "results_unsolicited",
        _R,
        "Results or CancelAcks for an open fetch dropped: not from the sender (key, link) it was"
        " sent to",
    ),
    _c(
        "register_replies_{result}",
        _R,
        "RegisterReplies received, ok or refused",
        metric="kvxferd_register_replies",
        values=("ok", "refused"),
    ),
    _c(
        "links_dropped",
        _R,
        "Links to a sender dropped (register refused or unanswered, connect refused, send failed)",
    ),
    _c("reregistrations", _R, "Fetches answered unknown_peer that registered again"),
    _c(
        "links_down",
        _R,
        "Links declared down: connection lost and not back within peer_down_ms, or discovery"
        " removed a sender whose link was not connected",
    ),
    _c("links_back", _R, "Links down that connected again"),
    _c(
        "connect_retries",
        _R,
        "Redials libzmq scheduled on links (after a refused or lost connection; they back off"
        " to reconnect_max_ms)",
    ),
    _c(
        "fetches_ended_peer_down",
        _R,
        "Sent fetches ended peer_lost, in doubt, because their link went down",
    ),
    _c(
        "fetches_refused_link_down",
        _R,
        "Fetches failed peer_lost at once, nothing sent: their link was down",
    ),
    _c("connect_errors", _R, "Sender endpoints libzmq would not connect to"),
    _c("discovery_events", _R, "Senders discovery reported added, changed or removed"),
    _c("reconnects", _R, "Links that reconnected (and registered again)"),
    _c("disconnects", _R, "Links whose TCP connection dropped"),
    _c("sender_restarts", _R, "Senders found to be a new process at a known endpoint"),
    _c("fetches_resent", _R, "Open fetches sent again to a restarted sender"),
    _c(
        "fetches_ended_key_refused",
        _R,
        "Open fetches ended not_authorized: their sender refused this receiver's key",
    ),
    _c(
        "fences_released_restart",
        _R,
        "Fences released because the sender restarted (nothing of the old process can land)",
    ),
    _c(
        "fences_released_teardown",
        _R,
        "Fences released because the link's NIXL agent was torn down (link down or shutdown;"
        " revocable transports only: nothing sent through it can land)",
    ),
    _c("link_agents_made", _R, "NIXL agents made for sender links (dataplane.agent_per_link)"),
    _c("link_agents_taken", _R, "NIXL agents a link took for its Register"),
    _c("link_agents_torn_down", _R, "NIXL agents of links destroyed (link down, closed, shutdown)"),
    _c("link_agents_failed", _R, "NIXL agents for links that could not be made (retried)"),
    _c("registers_waiting_agent", _R, "Registers that waited for a link's NIXL agent"),
    _c(
        "registers_stale_agent",
        _R,
        "RegisterReplies to a Register whose NIXL agent was torn down since (registered again)",
    ),
    _c(
        "fences_in_doubt",
        _R,
        "Fences that passed cancel_fence_ms without a CancelAck (outcome in doubt)",
    ),
    _c("fetches_in_doubt", _R, "Fetches that ended in doubt (blocks and aux slot held)"),
    _c("aux_slots_quarantined", _R, "Aux slots held by a fetch in doubt"),
    _c("aux_slots_released", _R, "Aux slots given back when a fetch in doubt resolved"),
    _c(
        "in_doubt_untracked",
        _R,
        "Fetches in doubt no longer asked about (the in-doubt table was full)",
    ),
    _c("in_doubt_retries", _R, "Times a fetch in doubt was asked about again"),
    # -- gateway -------------------------------------------------------------------------
    _c(
        "rejected_{reason}",
        _G,
        "Engine calls refused, by reason",
        metric="kvxferd_gateway_rejections",
        values=GATEWAY_REASONS,
    ),
    _c(
        "calls_{call}",
        _G,
        "Engine calls received, by call",
        metric="kvxferd_gateway_calls",
        values=GATEWAY_CALLS,
    ),
    _c("calls_found_by_key", _G, "Publish/Fetch retries answered with the open handle"),
    _c("engine_connections", _G, "Engine connections accepted on the unix engine socket"),
    _c(
        "engine_connections_refused",
        _G,
        "Engine connections closed at once: the gateway holds its maximum of connections",
    ),
    _c(
        "engine_connections_dropped",
        _G,
        "Engine connections the gateway closed: broken, a frame over the bound, or not reading",
    ),
    _c(
        "recv_errors",
        _R | _G,
        "Receive errors (receiver: on a sender link or the result socket; gateway: on the "
        "engine socket)",
    ),
    _c("internal_errors", _G, "Engine calls that failed on a bug (Error internal)"),
    # -- everyone: transport security (auth.py) ---------------------------------------------
    _c(
        "auth_refused_{reason}",
        _EVERYONE,
        "CURVE clients the ZAP handler refused, by reason (unknown_key: not in "
        "security.allowed_keys_dir; mechanism: not CURVE); gateway: its TCP engine socket",
        values=AUTH_REFUSALS,
    ),
    _c(
        "handshakes_failed_{kind}",
        _EVERYONE,
        "Failed ZMTP handshakes on a CURVE socket (protocol: a plaintext peer or a client "
        "expecting another server key; auth: refused by ZAP; no_detail: the other side "
        "closed, e.g. this daemon presented a key the server did not expect)",
        values=HANDSHAKE_KINDS,
    ),
    # -- everyone (guard.py) -------------------------------------------------------------
    _c(
        "thread_errors",
        _EVERYONE,
        "Unexpected exceptions caught in a long-lived thread (liveness fails)",
    ),
    _c("threads_dead", _EVERYONE, "Long-lived threads that ended outside shutdown"),
)

# ``Stats.observe`` names, per component (exported as kvxferd_transfer_duration_seconds).
SAMPLES: dict[str, tuple[str, ...]] = {SENDER: ("slice_seconds",), RECEIVER: ("fetch_seconds",)}


def specs_for(component: str) -> list[CounterSpec]:
    """The catalogued counters of one component, in catalogue order."""
    return [s for s in CATALOGUE if component in s.components]


def find_counter(component: str, key: str) -> CounterSpec | None:
    """The spec exporting Stats name ``key`` of ``component``: a plain name, or a family value."""
    for spec in specs_for(component):
        if not spec.label and spec.key == key:
            return spec
    for spec in specs_for(component):
        if spec.label and key.startswith(spec.prefix) and key.endswith(spec.suffix):
            value = key[len(spec.prefix) : len(key) - len(spec.suffix)]
            if value in spec.values or (not spec.values and value.isdigit()):
                return spec
    return None


def find_family(component: str, prefix: str, suffix: str = "") -> CounterSpec | None:
    """The family of ``component`` whose names are ``prefix{...}suffix`` (an f-string's shape)."""
    for spec in specs_for(component):
        if spec.label and spec.prefix == prefix and spec.suffix == suffix:
            return spec
    return None
