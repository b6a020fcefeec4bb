"""Start-up checks that fail in one line, before the slow set-up (NIXL agent, pool).

:func:`check` runs first in the daemon's start-up and raises
:class:`~kvxferd.errors.ConfigError` naming the setting and its value (the CLI
prints it on one line and exits 2). Each check is the cheap form of what the
set-up would do later:

* every TCP address the daemon binds (the sender's ``listen``, the receiver's
  ``result_endpoint``, a ``tcp://`` engine socket, ``probe_host:probe_port``):
  a plain socket with ``SO_REUSEADDR`` (as libzmq and the probe server set) is
  bound and closed at once, so a host that does not resolve, an address not on
  this machine and a port in use are each named; port 0 only checks the host;
* what the daemon advertises (:func:`~kvxferd.endpoints.advertised`): a wildcard
  ``listen`` / ``result_endpoint`` needs ``service.advertise_host`` or
  ``service.advertise_interface`` (which must have an IPv4 address);
* every ``ipc://`` path: no longer than :data:`~kvxferd.endpoints.IPC_PATH_MAX`,
  its directory exists and is writable (for the engine socket, its nearest existing
  ancestor may stand in: the gateway creates the directory); a socket file there that accepts a
  connection belongs to a live daemon and is refused, one nobody listens on
  is stale and is replaced as before;
* pool segments killed daemons of the same engine socket left in /dev/shm (SIGKILL
  skips the unlink; the names start with
  :func:`~kvxferd.transfer.pool.daemon_shm_prefix`) are removed and logged, each only
  when no process holds its flock and the pid in its name is gone (a live daemon on
  the same socket string keeps its own): without that, each restart after a kill needs
  room for one more pool; a configured ``pool.shm_name`` that a live daemon holds is
  refused, one that nobody holds is removed like them;
* ``handover.adopt_blocks`` (a sender) leaves blocks of the pool for the engine;
* the pool's host part (aux slots, plus the KV blocks on ``device = "cpu"``)
  fits in the free bytes of /dev/shm;
* ``security.mode = "curve"``: the key file exists, is a secret certificate
  readable only by its owner, and the allow-list directory exists (the message
  names the setting and ``kvxferd keygen``); ``"off"`` with an advertised
  interface address that is not loopback is refused (the settings already
  refused every other non-local endpoint).

The checks race with other processes (a port can be taken after the check);
the later bind still fails then, only less clearly.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from kvxferd.config import ReceiverSettings, SenderSettings
from kvxferd.endpoints import IPC_PATH_MAX, advertise_host, advertised
from kvxferd.errors import ConfigError
from kvxferd.transfer.pool import SHM_DIR, daemon_shm_name, daemon_shm_prefix, holder_alive

log = logging.getLogger("kvxferd.daemon")

_PROBE_CONNECT_S = 0.5


def check(settings: SenderSettings | ReceiverSettings) -> None:
    """Raise ConfigError naming the first setting that cannot start this daemon."""
    svc = settings.service
    host = advertise_host(svc.advertise_host, svc.advertise_interface)
    if isinstance(settings, SenderSettings):
        _endpoint("listen", settings.listen)
        advertised(settings.listen, host, "listen")
        adopt = settings.handover.adopt_blocks
        if adopt >= settings.pool.num_blocks:
            raise ConfigError(
                f"handover.adopt_blocks = {adopt}: leaves no block of the pool's "
                f"{settings.pool.num_blocks} (pool.num_blocks) for the engine"
            )
    else:
        _endpoint("result_endpoint", settings.result_endpoint)
        advertised(settings.result_endpoint, host, "result_endpoint")
    _endpoint("service.engine_socket", svc.engine_socket)
    _security(settings, host)
    _tcp(
        "service.probe_host/probe_port",
        f"{svc.probe_host}:{svc.probe_port}",
        svc.probe_host,
        svc.probe_port,
    )
    _stale_pool(settings)
    _shm(settings)


def _security(settings: SenderSettings | ReceiverSettings, host: str | None) -> None:
    from kvxferd.auth import check_curve_settings, load_key_pair
    from kvxferd.endpoints import is_local_endpoint

    sec = settings.security
    if sec.mode == "curve":
        check_curve_settings(sec)
        assert sec.key_file is not None
        load_key_pair(sec.key_file)
    elif host is not None and not is_local_endpoint(f"tcp://{host}:1"):
        raise ConfigError(
            f'security.mode is "off" but this daemon would advertise {host!r}, which is not'
            ' loopback: set security.mode = "curve" (kvxferd keygen)'
        )


def pool_name(settings: SenderSettings | ReceiverSettings) -> str:
    """The daemon's pool segment name: the configured one, else a new name of this instance
    (:func:`~kvxferd.transfer.pool.daemon_shm_name`: unique per daemon, never derived)."""
    role = "tx" if isinstance(settings, SenderSettings) else "rx"
    return settings.pool.shm_name or daemon_shm_name(role, settings.service.engine_socket)


def _stale_pool(settings: SenderSettings | ReceiverSettings) -> None:
    """Remove the pool segments killed daemons of this engine socket left; refuse an
    operator's ``pool.shm_name`` that a live process holds (a leftover under that name is
    removed like the others). A segment is removed only when no process holds its flock
    and the pid in its name is gone."""
    engine_socket = settings.service.engine_socket
    configured = settings.pool.shm_name
    if configured is not None:
        path = os.path.join(SHM_DIR, configured)
        if not os.path.exists(path):
            return
        if holder_alive(path):
            raise ConfigError(
                f"pool.shm_name = {configured!r} is the segment of a live daemon on this"
                " host; give each daemon its own name, or leave pool.shm_name unset"
            )
        _remove_leftover(path, engine_socket)
        return
    role = "tx" if isinstance(settings, SenderSettings) else "rx"
    prefix = daemon_shm_prefix(role, engine_socket)
    try:
        names = [n for n in os.listdir(SHM_DIR) if n == prefix or n.startswith(prefix + "-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if holder_alive(path):
            continue  # a live daemon's pool (another instance on this socket string)
        _remove_leftover(path, engine_socket)


def _remove_leftover(path: str, engine_socket: str) -> None:
    """Unlink a pool segment no live process holds (checked by the caller); logged."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(
            f"pool: {path}, left by a previous daemon of {engine_socket!r}, cannot be"
            f" removed ({e.strerror})"
        ) from None
    log.warning(
        "removed %s (%d bytes): the pool a previous daemon of %s left when it was killed",
        path,
        size,
        engine_socket,
    )


def _endpoint(name: str, endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        _ipc(name, endpoint, endpoint[len("ipc://") :])
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit() and port != "*":
            raise ConfigError(f"{name} = {endpoint!r}: expected tcp://host:port")
        _tcp(name, endpoint, host, 0 if port == "*" else int(port))


def _tcp(name: str, value: str, host: str, port: int) -> None:
    bind_host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
    try:
        infos = socket.getaddrinfo(
            bind_host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ConfigError(
            f"{name} = {value!r}: host {host!r} does not resolve ({e.strerror})"
        ) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                why = f"port {port} is already in use"
            elif e.errno == errno.EADDRNOTAVAIL:
                why = f"{host!r} is not an address of this machine"
            else:
                why = f"cannot bind {host}:{port} ({e.strerror})"
            raise ConfigError(f"{name} = {value!r}: {why}") from None


def _ipc(name: str, value: str, path: str) -> None:
    if path.startswith("@"):
        return  # abstract namespace: no file, no directory
    if not path or len(path.encode()) > IPC_PATH_MAX:
        raise ConfigError(
            f"{name} = {value!r}: ipc path is {len(path.encode())} bytes, the limit is {IPC_PATH_MAX}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{name} = {value!r}: {existing} is not a directory")
    if existing != parent and name != "service.engine_socket":
        # Only the engine gateway creates its directory; ZMQ's bind would fail later, as a
        # traceback (issue 23).
        raise ConfigError(
            f"{name} = {value!r}: directory {parent} does not exist; create it or pick"
            " a path in an existing directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "directory" if existing == parent else f"directory {parent} is missing and"
        raise ConfigError(f"{name} = {value!r}: {what} {existing} is not writable")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{name} = {value!r}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(_PROBE_CONNECT_S)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale: nothing listens; the bind replaces it
        except OSError:
            return  # cannot tell (a timeout under a full backlog is not proof of life)
    raise ConfigError(f"{name} = {value!r}: a live daemon is serving on this socket")


def _shm(settings: SenderSettings | ReceiverSettings) -> None:
    pool = settings.pool
    aux = pool.aux_slots * pool.aux_slot_bytes
    need = aux + (pool.kv_bytes if pool.device == "cpu" else 0)
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return  # no /dev/shm to measure; the pool's own allocation reports it
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ConfigError(
            f"pool = {pool.num_layers} layers x {pool.num_blocks} blocks x {pool.block_bytes} B"
            f" on {pool.device}: needs {need} bytes of {SHM_DIR}, {free} free"
        )
