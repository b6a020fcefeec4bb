"""Typed, validated settings for each role, from five sources in one order.

Precedence, highest first (the one place it is written down)::

    1. command-line flags          --num-threads 8
    2. KVXFERD_* environment       KVXFERD_NUM_THREADS=8, KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS=5000
    3. TRTLLM_KV_TRANSFER_NUM_THREADS   (sender's num_threads only; the name engine operators know)
    4. the TOML file (--config)    num_threads = 8
    5. the defaults below

``kvxferd print-config --role R --config F --sources`` prints each setting's
value and where it came from (``default``, ``file PATH``, ``env NAME``,
``flag``). A value that fails validation names its setting, the source it came
from and the limit it broke; the process exits 2.

Every timeout and limit is a named field with its unit in the name (``_ms``,
``_bytes``) and its default here, in one place. Environment variables use the
``KVXFERD_`` prefix and ``__`` for nesting (``KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS``).

Deadlines (milliseconds)::

    send_timeout_ms          100   a send on a shared socket (listener/API callers)
    worker_send_timeout_ms  1000   a worker's result send to a receiver
    xfer_stall_timeout_ms  10000   one NIXL WRITE still in progress -> STALLED, in doubt
    kv_transfer_timeout_ms 60000   a receiver waiting for a request's result
    register_timeout_ms     5000   a receiver waiting for a sender's REGISTER reply
    publish_ttl_ms        120000   a published request nobody fetched -> EXPIRED
    pending_fetch_ttl_ms   60000   upper bound on a fetch waiting for its publish
    stream_stall_timeout_ms 30000  a streamed publish with no progress mark -> failed, stream_stalled
    cancel_fence_ms         5000   waiting for a cancel acknowledgement -> in doubt
    drain_timeout_ms       10000   in-flight work at shutdown
    shutdown_timeout_ms    15000   the whole shutdown, joins included
    clock_skew_ms            500   allowance between hosts' clocks for RequestData.deadline_unix_ms
    connect_refused_ms      1000   a new receiver link whose every connect is refused -> peer_lost
    in_doubt_retry_ms       1000   first re-send of Cancel for a fetch in doubt (doubles)
    in_doubt_retry_max_ms  30000   cap of that backoff
    heartbeat_ivl_ms        1000   ZMTP PING on every DEALER (0: off)
    heartbeat_timeout_ms    3000   no traffic this long -> the connection is dropped, reopened
    connect_timeout_ms      1000   one TCP connect attempt of a DEALER (then retried afresh)
    peer_down_ms            1000   a receiver link lost and not back this long -> down: its fetches end
    reconnect_max_ms        2000   cap of a DEALER's redial backoff (from 100 ms, doubling)
    link_probe_timeout_ms   2000   one link probe (all its WRITEs); past it the figure stays unknown
"""

from __future__ import annotations

import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvxferd.endpoints import is_local_endpoint, is_wildcard
from kvxferd.errors import ConfigError

THREADS_ENV = "TRTLLM_KV_TRANSFER_NUM_THREADS"
DEFAULT_NUM_THREADS = 4

Dtype = Literal["uint8", "int8", "float16", "bfloat16", "float32"]
DTYPE_BYTES: dict[str, int] = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PoolSettings(_Frozen):
    """The paged KV pool: ``num_layers x num_blocks`` blocks of ``block_elems`` elements."""

    num_layers: int = Field(8, ge=1, le=4096)
    num_blocks: int = Field(2048, ge=1, le=1 << 22)
    block_elems: int = Field(8192, ge=1, le=1 << 26)
    dtype: Dtype = "float16"
    device: Literal["cpu", "cuda"] = "cpu"
    cuda_device: int = Field(0, ge=0)
    shm_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,200}$",
        description=(
            "POSIX shm name of the pool; None = a name of this daemon instance (engines learn"
            " it from pool_info); one a live daemon holds is refused at start"
        ),
    )
    aux_slots: int = Field(256, ge=1, le=1 << 20)
    aux_slot_bytes: int = Field(4096, ge=64, le=1 << 20)

    @property
    def block_bytes(self) -> int:
        return self.block_elems * DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes


class DataPlaneSettings(_Frozen):
    """NIXL agent settings. The defaults keep UCX's dead-peer detection on."""

    backend: Literal["UCX"] = "UCX"
    ucx_error_handling_mode: Literal["peer", "none"] = "peer"
    ucx_num_workers: int = Field(1, ge=1, le=64)
    ucx_tls: str | None = Field(None, description="sets UCX_TLS for the agent, e.g. 'shm'")
    progress_thread: bool = Field(False, description="NIXL's own progress thread spins a core")
    sync_mode: Literal["strict", "rw", "none", "default"] = "strict"
    max_paths: int = Field(
        3,
        ge=1,
        le=16,
        description="sender: local NIXL agents (connections per receiver) at most; a receiver "
        "whose writes stall past xfer_stall_timeout_ms is moved to a fresh one (1: never)",
    )
    notifications: bool = Field(
        True,
        description="receiver: ask senders to tell a fetch done by a NIXL notification once its"
        " WRITEs completed (no control message on the success path); false: a done Result",
    )
    agent_per_link: Literal["auto", "on", "off"] = Field(
        "auto",
        description="receiver: one NIXL agent per sender link, torn down when the link goes"
        " down, which ends that link's fetches in doubt (docs/protocol.md section 15). auto: on"
        " when ucx_tls (or UCX_TLS) names only transports a teardown revokes (tcp, rc, ud, dc,"
        " posix, sysv...; not cma, knem, xpmem, cuda_ipc); on: always (a teardown then ends no"
        " doubt unless the transports are revocable); off: one agent for every link",
    )
    link_probe_bytes: int = Field(
        4 << 20,
        ge=0,
        le=256 << 20,
        description="a scratch region of this size registered with NIXL, never a KV block: a"
        " receiver advertises its own in Register, a sender times WRITEs of it into the"
        " receiver's at each new link (docs/operations.md, Link speed); 0: no probe",
    )
    link_probe_writes: int = Field(
        8, ge=1, le=64, description="sender: timed WRITEs per link probe (after one untimed)"
    )
    min_link_gbps: float | None = Field(
        None,
        gt=0.0,
        description="sender: a link measured below this many GB/s makes /readyz not ready"
        " (link_slow, naming the peer and its figure); None: off",
    )


class Deadlines(_Frozen):
    """Every deadline, in milliseconds (see the module docstring for what each bounds)."""

    send_timeout_ms: int = Field(100, ge=1)
    worker_send_timeout_ms: int = Field(1000, ge=1)
    xfer_stall_timeout_ms: int = Field(10_000, ge=1)
    kv_transfer_timeout_ms: int = Field(60_000, ge=1)
    register_timeout_ms: int = Field(5_000, ge=1)
    publish_ttl_ms: int = Field(120_000, ge=1)
    pending_fetch_ttl_ms: int = Field(60_000, ge=1)
    stream_stall_timeout_ms: int = Field(
        30_000,
        ge=1,
        description="sender: a streamed publish with no progress mark this long (from its"
        " publish or its last mark) fails stream_stalled; its fetches end at once",
    )
    cancel_fence_ms: int = Field(5_000, ge=1)
    drain_timeout_ms: int = Field(10_000, ge=0)
    shutdown_timeout_ms: int = Field(15_000, ge=1)
    clock_skew_ms: int = Field(500, ge=0, le=60_000)
    connect_refused_ms: int = Field(
        1_000,
        ge=1,
        description="receiver: a new link whose every connect is refused this long fails its fetches",
    )
    in_doubt_retry_ms: int = Field(
        1_000, ge=1, description="receiver: first re-send of Cancel for a fetch in doubt"
    )
    in_doubt_retry_max_ms: int = Field(
        30_000, ge=1, description="receiver: the re-send interval doubles up to this"
    )
    heartbeat_ivl_ms: int = Field(
        1_000, ge=0, description="ZMTP heartbeat interval on every DEALER; 0 turns heartbeats off"
    )
    heartbeat_timeout_ms: int = Field(
        3_000,
        ge=1,
        description="a DEALER connection silent this long is dropped and reopened (also TCP_MAXRT)",
    )
    connect_timeout_ms: int = Field(
        1_000, ge=1, description="one TCP connect attempt of a DEALER before a fresh one"
    )
    peer_down_ms: int = Field(
        1_000,
        ge=1,
        description="receiver: a link whose connection dropped and is not back this long is down:"
        " its fetches end at once (peer_lost, or in doubt if sent) and new ones fail peer_lost",
    )
    reconnect_max_ms: int = Field(
        2_000,
        ge=100,
        le=600_000,
        description="cap of a DEALER's redial backoff (libzmq's, from 100 ms, doubling)",
    )
    link_probe_timeout_ms: int = Field(
        2_000,
        ge=1,
        le=600_000,
        description="sender: one link probe's WRITEs; a probe still running then counts timeout",
    )

    @model_validator(mode="after")
    def _drain_fits_shutdown(self) -> Deadlines:
        if self.drain_timeout_ms >= self.shutdown_timeout_ms:
            raise ValueError("drain_timeout_ms must be below shutdown_timeout_ms")
        if self.heartbeat_ivl_ms and self.heartbeat_timeout_ms <= self.heartbeat_ivl_ms:
            raise ValueError("heartbeat_timeout_ms must be above heartbeat_ivl_ms")
        return self


class Limits(_Frozen):
    """Bounds on tables and frames, so no peer can grow this process without limit."""

    max_frame_bytes: int = Field(4 << 20, ge=4096)
    max_blocks_per_request: int = Field(65_536, ge=1)
    max_peers: int = Field(256, ge=1)
    max_live_sessions: int = Field(16_384, ge=1)
    max_pending_fetches: int = Field(4_096, ge=0)
    max_fetches_in_flight: int = Field(4_096, ge=1)
    sndhwm: int = Field(10_000, ge=1)
    max_writes_in_flight_per_worker: int = Field(
        64,
        ge=1,
        description="WRITEs in progress at once on one sender worker (in-doubt ones aside)",
    )
    # Per identity (an authenticated CURVE key; not applied to the anonymous identity of
    # security off, which has only the global limits above). See kvxferd/transfer/ownership.py.
    max_peers_per_identity: int = Field(64, ge=1, description="receivers one key may register")
    max_fetches_per_identity: int = Field(
        4_096, ge=1, description="fetches one key may have attached and not yet removed"
    )
    max_parked_per_identity: int = Field(
        1_024, ge=0, description="fetches one key may have parked until their request is published"
    )
    orphan_ttl_ms: int = Field(
        300_000,
        ge=1,
        description="a receiver id / NIXL name no peer uses is released this long after it left,"
        " and a registered peer idle this long with nothing open is reclaimed",
    )


class ServiceSettings(_Frozen):
    """The daemon around a sender or receiver: engine socket, probe port, logs."""

    engine_socket: str = Field(
        "ipc:///run/kvxferd/engine.sock",
        pattern=r"^(ipc|tcp)://.{1,240}$",
        description="where local engines connect (ipc:// path, mode 0600); tcp:// for tests only",
    )
    advertise_host: str | None = Field(
        None,
        pattern=r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|[A-Za-z0-9_.-]+)$",
        description="the host peers and engines are told (listen / result_endpoint);"
        " None = the bound address, which then may not be a wildcard",
    )
    advertise_interface: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:@-]{1,15}$",
        description="a network interface whose IPv4 address is advertised, resolved at start",
    )
    probe_host: str = Field("127.0.0.1", description="host of /healthz /readyz /metrics")
    probe_port: int = Field(9400, ge=0, le=65535, description="0 picks a free port")
    log_json: bool = Field(False, description="one JSON object per log line")
    max_client_inflight: int = Field(1024, ge=1, description="engine calls served at once")
    liveness_stall_ms: int = Field(
        10_000, ge=100, description="/healthz fails when a worker or the loop made no progress"
    )

    @model_validator(mode="after")
    def _one_advertise(self) -> ServiceSettings:
        if self.advertise_host is not None and self.advertise_interface is not None:
            raise ValueError("set advertise_host or advertise_interface, not both")
        if self.advertise_host is not None and is_wildcard(self.advertise_host):
            raise ValueError(
                f"advertise_host {self.advertise_host!r} is a wildcard; give an address peers reach"
            )
        return self


class HealthSettings(_Frozen):
    """What /readyz, /debug/state and the per-peer metrics judge by (docs/operations.md)."""

    stuck_after_ms: int = Field(
        30_000,
        ge=1_000,
        description="/readyz fails when work is pending and nothing ended for this long",
    )
    peer_failure_window_ms: int = Field(
        60_000, ge=1_000, description="the window a peer's failure rate is measured over"
    )
    peer_failure_ratio: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="/readyz fails when a peer's failed share in the window reaches this",
    )
    peer_failure_min: int = Field(
        20, ge=1, description="endings in the window before a peer's failure rate counts"
    )
    metrics_peer_labels: int = Field(
        16,
        ge=0,
        le=256,
        description="peers with their own label in per-peer metrics; later ones share 'other'",
    )
    debug_state: Literal["off", "loopback", "any"] = Field(
        "loopback", description="who may read /debug/state on the probe port"
    )


class DiscoverySettings(_Frozen):
    """How a daemon finds its peers and advertises itself (docs/discovery.md); "none": as before."""

    backend: Literal["none", "static", "dns", "etcd"] = Field(
        "none", description="none: peers come only from each fetch's sender_endpoint"
    )
    static_file: str | None = Field(
        None, description="static: a TOML or JSON file listing peers ([[peers]] tables)"
    )
    static_poll_ms: int = Field(
        1_000, ge=50, le=60_000, description="static: how often the file's mtime is checked"
    )
    dns_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,253}$",
        description="dns: a headless Service name; each A/AAAA address is one peer",
    )
    dns_port: int = Field(0, ge=0, le=65535, description="dns: the peers' port (required for dns)")
    dns_interval_ms: int = Field(
        5_000, ge=100, le=600_000, description="dns: how often the name is resolved again"
    )
    etcd_endpoints: tuple[str, ...] = Field(
        ("http://127.0.0.1:2379",),
        min_length=1,
        max_length=16,
        description="etcd: the v3 JSON gateway URLs, tried in turn",
    )
    etcd_prefix: str = Field(
        "/kvxferd", pattern=r"^/[A-Za-z0-9_./-]{0,200}$", description="etcd: keys live under it"
    )
    etcd_ttl_s: int = Field(
        10, ge=2, le=3_600, description="etcd: the lease's TTL; keep-alive every TTL/3"
    )
    etcd_timeout_ms: int = Field(2_000, ge=50, description="etcd: every HTTP call's deadline")
    etcd_backoff_max_ms: int = Field(
        5_000, ge=100, le=300_000, description="etcd: cap of the reconnect backoff (doubles)"
    )

    @model_validator(mode="after")
    def _backend_fields(self) -> DiscoverySettings:
        if self.backend == "static" and not self.static_file:
            raise ValueError("backend 'static' needs static_file")
        if self.backend == "dns" and (not self.dns_name or not self.dns_port):
            raise ValueError("backend 'dns' needs dns_name and dns_port")
        if self.backend == "etcd":
            for url in self.etcd_endpoints:
                if not re.match(r"^https?://[A-Za-z0-9_.\[\]:-]+(:\d+)?/?$", url):
                    raise ValueError(f"etcd endpoint {url!r} is not http(s)://host:port")
            if self.etcd_timeout_ms * 3 > self.etcd_ttl_s * 1000:
                raise ValueError("etcd_timeout_ms must be at most a third of etcd_ttl_s")
        return self


class SecuritySettings(_Frozen):
    """Transport security (docs/operations.md, "Keys"): CURVE on every socket that crosses hosts.

    ``mode = "curve"`` (the default) needs ``key_file`` (this daemon's secret certificate,
    from ``kvxferd keygen``) and ``allowed_keys_dir`` (the public certificates of the peers
    and engines allowed in). ``mode = "off"`` is accepted only when every endpoint this
    daemon binds, advertises or is configured to dial is loopback or ipc; a TCP engine
    socket needs CURVE.
    """

    mode: Literal["curve", "off"] = Field(
        "curve", description="curve: authenticated, encrypted control plane; off: loopback/ipc only"
    )
    key_file: str | None = Field(
        None, description="this daemon's secret certificate (NAME.key_secret, mode 0600)"
    )
    allowed_keys_dir: str | None = Field(
        None,
        description="directory of public certificates (*.key) allowed to connect;"
        " re-read on SIGHUP and when its files change",
    )
    engine_keys_dir: str | None = Field(
        None,
        description="directory of the public certificates (*.key) of the engines allowed on a"
        " tcp:// engine socket (required for one); kept apart from allowed_keys_dir: a peer's"
        " key does not make it an engine",
    )
    allowed_keys_poll_ms: int = Field(
        1_000,
        ge=0,
        le=600_000,
        description="how often allowed_keys_dir is checked for changed files; 0: SIGHUP only",
    )
    sender_keys: dict[str, str] = Field(
        default_factory=dict,
        max_length=4096,
        description="receiver: sender endpoint -> the public key it must present (Z85, or the"
        ' path of its .key certificate); else the key published with the request; "*": the'
        " key of every other sender",
    )

    @model_validator(mode="after")
    def _keys_are_keys(self) -> SecuritySettings:
        from kvxferd.auth import is_z85_key

        for endpoint, key in self.sender_keys.items():
            if not is_z85_key(key) and not key.startswith("/"):
                raise ValueError(
                    f"sender_keys[{endpoint!r}] is neither a 40-character Z85 public key nor"
                    " the absolute path of a .key certificate"
                )
        return self


def _toml_source_for(settings_cls: type[BaseSettings]) -> PydanticBaseSettingsSource | None:
    path = _TOML_PATH.get()
    if path is None:
        return None
    return TomlConfigSettingsSource(settings_cls, toml_file=path)


_TOML_PATH: ContextVar[Path | None] = ContextVar("kvxferd_toml_path", default=None)


class _RoleSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVXFERD_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        populate_by_name=True,
    )

    pool: PoolSettings = PoolSettings()
    dataplane: DataPlaneSettings = DataPlaneSettings()
    deadlines: Deadlines = Deadlines()
    limits: Limits = Limits()
    service: ServiceSettings = ServiceSettings()
    health: HealthSettings = HealthSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    security: SecuritySettings = SecuritySettings()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _fail_closed(self) -> _RoleSettings:
        """Plaintext only where nothing leaves the host; a TCP engine socket only with CURVE."""
        sec, svc = self.security, self.service
        if svc.engine_socket.startswith("tcp://") and sec.mode != "curve":
            raise ValueError(
                f"service.engine_socket = {svc.engine_socket!r} is TCP and security.mode is"
                ' "off": a TCP engine socket needs security.mode = "curve" (engines then'
                " need keys), or use an ipc:// socket"
            )
        if svc.engine_socket.startswith("tcp://") and not sec.engine_keys_dir:
            raise ValueError(
                f"service.engine_socket = {svc.engine_socket!r} is TCP: set"
                " security.engine_keys_dir to the directory of the engines' public certificates"
                " (apart from allowed_keys_dir, whose peers must not drive this daemon)"
            )
        if sec.mode != "off":
            return self
        own = "listen" if hasattr(self, "listen") else "result_endpoint"
        endpoints = {own: str(getattr(self, own)), "service.engine_socket": svc.engine_socket}
        endpoints.update({f"security.sender_keys[{e!r}]": e for e in sec.sender_keys if e != "*"})
        if svc.advertise_host is not None:
            endpoints["service.advertise_host"] = f"tcp://{svc.advertise_host}:1"
        for setting, endpoint in endpoints.items():
            if not is_local_endpoint(endpoint):
                raise ValueError(
                    f'security.mode is "off" but {setting} = {endpoint!r} is not loopback or'
                    ' ipc: plaintext is accepted only on this host; set security.mode = "curve"'
                    " with key_file and allowed_keys_dir (kvxferd keygen)"
                )
        if svc.advertise_interface is not None:
            raise ValueError(
                'security.mode is "off" but service.advertise_interface is set: plaintext'
                " is accepted only on loopback or ipc"
            )
        if self.discovery.backend == "dns":
            raise ValueError(
                'security.mode is "off" but discovery.backend is "dns" (peers on other hosts)'
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = _toml_source_for(settings_cls)
        threads = (_ThreadsEnvSource(settings_cls),) if settings_cls is SenderSettings else ()
        return (init_settings, env_settings, *threads) + ((toml,) if toml else ())


class HandoverSettings(_Frozen):
    """Scale-down without loss: a draining sender hands its unfetched requests to another."""

    targets: tuple[str, ...] = Field(
        (),
        max_length=16,
        description="listen endpoints of senders of this group to hand unfetched requests to"
        " when this sender drains, tried in order; empty: none (the drain drops them as before)",
    )
    discover: bool = Field(
        False,
        description="also offer to the other senders discovery lists ([discovery], after"
        " targets); off: only targets",
    )
    adopt_blocks: int = Field(
        0,
        ge=0,
        le=1 << 22,
        description="the top N blocks of this sender's pool, reserved for requests another"
        " sender hands over (an engine publish naming them is refused bad_blocks); 0: never adopt",
    )
    redirect_window_ms: int = Field(
        5_000,
        ge=0,
        description="after a handover, how long the drain still answers fetches of moved"
        " requests with their new sender (ends early once each was redirected)",
    )
    reply_timeout_ms: int = Field(
        2_000, ge=1, description="how long a draining sender waits for a target's HandoverReply"
    )


class SenderSettings(_RoleSettings):
    """The context-side process: a ROUTER listener, N workers, the published requests."""

    handover: HandoverSettings = HandoverSettings()

    name: str = Field("kvxferd-sender", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    listen: str = Field("tcp://127.0.0.1:5555", pattern=r"^(tcp|ipc)://.{1,240}$")
    num_threads: int = Field(
        DEFAULT_NUM_THREADS,
        ge=1,
        le=256,
        validation_alias=AliasChoices("num_threads", "KVXFERD_NUM_THREADS"),
        description=f"sender worker threads; {THREADS_ENV} is read below KVXFERD_NUM_THREADS",
    )
    inline_write_max_bytes: int = Field(
        256 << 10,
        ge=0,
        le=1 << 30,
        description="a request of at most this many bytes (all layers, aux included) is"
        " written by the listener thread that read its fetch, with no hand-off to a worker;"
        " larger ones go to the num_threads workers; 0: always a worker",
    )


class AccessSettings(_Frozen):
    """Which sender endpoints a receiver may dial for a fetch (kvxferd/endpoints.py, DialAllow).

    ``dial_allow`` entries: ``HOST[:PORTS]``, ``CIDR[:PORTS]``, ``[IPV6-OR-CIDR][:PORTS]``,
    ``ipc://PREFIX`` (PORTS ``N`` or ``N-M``). Empty: loopback and ipc only.
    """

    dial_allow: tuple[str, ...] = Field((), max_length=256)

    @model_validator(mode="after")
    def _check(self) -> AccessSettings:
        from kvxferd.endpoints import DialAllow

        try:
            DialAllow(self.dial_allow)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self


class IntegritySettings(_Frozen):
    """The per-request digest (kvxferd/transfer/digest.py, docs/protocol.md section 4).

    With ``digest`` on, each fetch asks its sender for a digest of the bytes it wrote
    (a done Result carries it instead of a NIXL notification) and the receiver checks
    what landed before the fetch is done: a mismatch fails it ``digest_mismatch``. An
    engine's Fetch may override it per fetch. Off by default: on this project's CPU
    pools it costs more than the transfer's own CPU time (docs/performance.md, Issue 25).
    """

    digest: bool = Field(False, description="ask every fetch's sender for a digest and check it")
    digest_inline_bytes: int = Field(
        256 << 10,
        ge=0,
        le=1 << 30,
        description="a fetch of at most this many bytes is checked on the io thread; a larger"
        " one on the kvxferd-rx-digest thread (its check would hold other fetches' messages)",
    )


class ReceiverSettings(_RoleSettings):
    """The generation-side process: fetches requests into its own blocks."""

    name: str = Field("kvxferd-receiver", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    result_endpoint: str = Field("tcp://127.0.0.1:0", pattern=r"^(tcp|ipc)://.{1,240}$")
    access: AccessSettings = AccessSettings()
    integrity: IntegritySettings = IntegritySettings()


S = TypeVar("S", bound=_RoleSettings)


class _ThreadsEnvSource(PydanticBaseSettingsSource):
    """TRTLLM_KV_TRANSFER_NUM_THREADS as ``num_threads``: below KVXFERD_*, above the file."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        raw = os.environ.get(THREADS_ENV)
        return {} if raw is None else {"num_threads": raw.strip()}


def _env_lookup(name: str) -> str | None:
    """The environment variable ``name`` as pydantic-settings reads it (case-insensitively)."""
    if name in os.environ:
        return name
    upper = name.upper()
    return next((k for k in os.environ if k.upper() == upper), None)


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for fname, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_leaves(ann, (*prefix, fname)))
        else:
            out.append((*prefix, fname))
    return out


def _source_of(
    cls: type[_RoleSettings],
    path: tuple[str, ...],
    toml: dict[str, Any],
    toml_path: Path | None,
    overrides: dict[str, Any],
) -> str:
    """Where the value of the setting at ``path`` comes from, by the documented order."""
    if path[0] in overrides:
        return "flag"
    env = _env_lookup("KVXFERD_" + "__".join(path).upper())
    if env is not None:
        return f"env {env}"
    if len(path) > 1 and _env_lookup("KVXFERD_" + path[0].upper()) is not None:
        return f"env {_env_lookup('KVXFERD_' + path[0].upper())}"
    if cls is SenderSettings and path == ("num_threads",) and THREADS_ENV in os.environ:
        return f"env {THREADS_ENV}"
    node: Any = toml
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return "default"
        node = node[part]
    return f"file {toml_path}"


def _toml_data(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def settings_sources(
    cls: type[_RoleSettings], toml_path: str | Path | None, overrides: dict[str, Any]
) -> dict[str, str]:
    """For every setting (dotted name), the source its effective value came from."""
    path = Path(toml_path) if toml_path else None
    toml = _toml_data(path)
    return {".".join(leaf): _source_of(cls, leaf, toml, path, overrides) for leaf in _leaves(cls)}


def _check_threads_env() -> None:
    """A one-line error for TRTLLM_KV_TRANSFER_NUM_THREADS, checked only when it is the source."""
    raw = os.environ.get(THREADS_ENV)
    if raw is None:
        return
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{THREADS_ENV}={raw!r} is not a number; set it to an integer from 1 to 256"
        ) from None
    if value < 1:
        raise ConfigError(f"{THREADS_ENV}={value} is below 1; set it to an integer from 1 to 256")


def _load(cls: type[S], toml_path: str | Path | None, overrides: dict[str, Any]) -> S:
    if (
        cls is SenderSettings
        and "num_threads" not in overrides
        and _env_lookup("KVXFERD_NUM_THREADS") is None
    ):
        _check_threads_env()
    path = Path(toml_path) if toml_path else None
    toml = _toml_data(path)
    token = _TOML_PATH.set(path)
    try:
        return cls(**overrides)
    except ValidationError as e:
        raise ConfigError(_one_line(cls, e, toml, path, overrides)) from None
    finally:
        _TOML_PATH.reset(token)


def _one_line(
    cls: type[_RoleSettings],
    e: ValidationError,
    toml: dict[str, Any],
    path: Path | None,
    overrides: dict[str, Any],
) -> str:
    """A validation error as one line: each problem names its setting, its value and where
    the value came from; a check across settings (no setting of its own) is its message,
    which names the settings and the fix. Never a dump of the whole configuration."""
    parts = []
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"])
        if loc and loc[0] == "KVXFERD_NUM_THREADS":
            loc = ("num_threads", *loc[1:])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not loc:
            parts.append(msg)
            continue
        source = _source_of(cls, loc, toml, path, overrides)
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        parts.append(f"{'.'.join(loc)}: {msg} (got {got} from {source})")
    return f"invalid {cls.__name__}: " + "; ".join(parts)


def load_sender_settings(toml_path: str | Path | None = None, **overrides: Any) -> SenderSettings:
    """The effective sender settings; raises ConfigError with a readable message."""
    return _load(SenderSettings, toml_path, overrides)


def load_receiver_settings(
    toml_path: str | Path | None = None, **overrides: Any
) -> ReceiverSettings:
    """The effective receiver settings; raises ConfigError with a readable message."""
    return _load(ReceiverSettings, toml_path, overrides)
