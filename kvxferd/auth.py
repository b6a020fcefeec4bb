"""Who a peer is: the CURVE public key that ZAP authenticated for its connection.

The identity of a peer is never a field a message claims. With CURVE on, libzmq attaches
the User-Id that the ZAP handler returned for the connection (the client's public key in
Z85) to every message received on it; with security off (loopback and ipc only) there is
one anonymous identity, the empty string.

The parts, top-down:

* **Keys**: every daemon has one key pair in the ``zmq.auth`` certificate format
  (``NAME.key`` public, ``NAME.key_secret`` secret, mode 0600), written by
  ``kvxferd keygen`` (:func:`keygen`) and read by :func:`load_key_pair`.
* **Allow-list** (:class:`AllowList`): the public keys of the ``*.key`` certificates
  in ``security.allowed_keys_dir``. Re-read on SIGHUP (:func:`reload_allow_lists`, the
  daemon's loop handler) and when the directory's files change (names, sizes and
  mtimes checked every ``security.allowed_keys_poll_ms`` by the auth thread). A key
  removed refuses that client's *next* handshake; on a connection it already opened, the
  sender's listener refuses each of its messages and the receiver's result socket drops
  them (:meth:`Transport.admits`).
* **The auth thread** (:class:`_AuthThread`, ``kvxferd-auth``, one per process
  context): the ZAP handler (a REP socket at ``inproc://zeromq.zap.01``) and the
  reader of every CURVE server socket's monitor. Each service (a sender, a receiver,
  a gateway on TCP) has its own ZAP domain, so a sender and a receiver in one process
  have separate allow-lists and separate counters. It answers a CURVE client whose
  key is in the domain's allow-list with 200 and User-Id = that key (Z85); everything
  else gets 400 and is counted ``auth_refused_{reason}`` in the service's Stats. A
  plaintext client or a client expecting another server key never reaches ZAP: the
  handshake fails, and the monitor counts it ``handshakes_failed_{kind}``.
* **Transport** (:class:`Transport`): what a service builds from ``[security]``: its
  :class:`Curve` options for ``kvxferd.transfer.control``, its allow-list and, on a receiver,
  the key each sender endpoint must present (:meth:`Transport.server_key_for`).

The auth thread is started before the first CURVE server socket binds: libzmq lets
every CURVE client in when no ZAP handler is bound, so a server socket never exists
without it (:func:`zap_handler`).

The auth thread serves the process context of the control plane
(``kvxferd.transfer.control.process_context``), which installs it here when imported
(:func:`serve_context`): this module, like every shared top-level one, imports nothing
of ``kvxferd.transfer`` (tests/test_layering.py checks it).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvxferd.endpoints import is_local_endpoint as is_local_endpoint  # re-exported (its old home)
from kvxferd.errors import ConfigError, Reason, RejectedError

if TYPE_CHECKING:
    from kvxferd.config import SecuritySettings
    from kvxferd.stats import Stats

log = logging.getLogger("kvxferd.auth")

ANONYMOUS = ""  # the identity of every peer when security is off
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
Mode = Literal["curve", "off"]

# Why the ZAP handler refused a client (the label of auth_refused_{reason}).
REFUSALS: tuple[str, ...] = ("unknown_key", "mechanism", "unknown_domain", "malformed")
# A failed handshake on a server socket, by libzmq's event (handshakes_failed_{kind}).
HANDSHAKE_KINDS: tuple[str, ...] = ("protocol", "auth", "no_detail")
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_TICK_MS = 200  # the auth thread's poll bound (new monitors join within it)
_Z85_KEY_LEN = 40


def peer_identity(frame: zmq.Frame) -> str:
    """The authenticated identity of the peer that sent ``frame`` (``ANONYMOUS`` if none)."""
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, KeyError):
        return ANONYMOUS
    return uid if isinstance(uid, str) else ANONYMOUS


def handshake_kind(event: int) -> str:
    """The kind (``handshakes_failed_{kind}``) of one failed-handshake monitor ``event``."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "protocol"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "auth"
    return "no_detail"


def is_z85_key(text: str) -> bool:
    """True for the 40-character Z85 text of a 32-byte CURVE key."""
    if len(text) != _Z85_KEY_LEN:
        return False
    try:
        return len(z85.decode(text.encode("ascii"))) == 32
    except (ValueError, UnicodeEncodeError, KeyError):
        return False


# -- keys ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyPair:
    """One daemon's CURVE key pair (Z85 text); the secret never appears in a repr."""

    public: str
    secret: str = field(repr=False)


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (secret, 0600) into ``directory``.

    Refuses (FileExistsError) to overwrite either file. The pair is made in a private
    (0700) temporary directory and linked into place, so the secret is never readable by
    others, not even for a moment, and a concurrent keygen cannot interleave.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r}: give a plain file name")
    target = Path(directory)
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = target / f"{name}.key", target / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; keygen never overwrites a key")
    with tempfile.TemporaryDirectory(dir=target, prefix=".keygen-") as tmp:
        tmp_public, tmp_secret = zmq.auth.create_certificates(tmp, name)
        os.chmod(tmp_secret, 0o600)
        os.chmod(tmp_public, 0o644)
        os.link(tmp_secret, secret)  # fails if it appeared meanwhile: never overwrites
        try:
            os.link(tmp_public, public)
        except FileExistsError:
            secret.unlink()
            raise
    return public, secret


def load_key_pair(path: str | Path, setting: str = "security.key_file") -> KeyPair:
    """The key pair in secret certificate ``path``; ConfigError naming ``setting`` otherwise."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{setting} = {str(p)!r} cannot be read as a secret key certificate ({e}); "
            "write a key pair with `kvxferd keygen --dir DIR --name NAME` and point "
            f"{setting} at DIR/NAME.key_secret"
        ) from None
    if secret is None:
        raise ConfigError(
            f"{setting} = {str(p)!r} is a public certificate; give the .key_secret file"
        )
    if mode & 0o027:  # group read is tolerated: a Kubernetes Secret with fsGroup is 0440
        raise ConfigError(
            f"{setting} = {str(p)!r} is open to others (mode {mode & 0o777:o}); chmod 600 it"
        )
    return KeyPair(public.decode("ascii"), secret.decode("ascii"))


def load_public_key(path: str | Path) -> str:
    """The public key (Z85) of certificate ``path`` (public or secret certificate)."""
    public, _ = zmq.auth.load_certificate(Path(path))
    return public.decode("ascii")


# -- allow-list ---------------------------------------------------------------------------------


class AllowList:
    """The client public keys of the ``*.key`` certificates in one directory.

    ``keys`` is replaced whole on :meth:`reload` (readers see the old or the new set,
    never a half-read one). A certificate that cannot be read is skipped and logged;
    the others still count.
    """

    def __init__(
        self, directory: str | Path | None, extra: Iterable[str] = (), poll_s: float = 0.0
    ) -> None:
        self.directory = Path(directory) if directory else None
        self.poll_s = poll_s  # 0: re-read on SIGHUP only
        self.next_check = 0.0  # auth thread only: when changed() is asked next
        self._reload_lock = threading.Lock()  # SIGHUP (the loop) and the poll may overlap
        self._extra = frozenset(extra)
        self._signature: tuple[tuple[str, int, int], ...] = ()
        self.keys: frozenset[str] = frozenset()
        self.reload()

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def _current_signature(self) -> tuple[tuple[str, int, int], ...]:
        if self.directory is None:
            return ()
        try:
            entries = sorted(self.directory.glob("*.key"))
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in entries)
        except OSError:
            return (("<unreadable>", 0, 0),)

    def changed(self) -> bool:
        """True when the directory's certificates differ from the ones last read."""
        return self._current_signature() != self._signature

    def reload(self) -> tuple[int, int]:
        """Read the directory again; (keys added, keys removed)."""
        with self._reload_lock:
            return self._reload()

    def _reload(self) -> tuple[int, int]:
        signature = self._current_signature()
        keys: set[str] = set(self._extra)
        if self.directory is not None:
            try:
                paths = sorted(self.directory.glob("*.key"))
            except OSError as e:
                log.error("allow-list %s cannot be read: %s (keeping no keys)", self.directory, e)
                paths = []
            for path in paths:
                try:
                    keys.add(load_public_key(path))
                except (OSError, ValueError) as e:
                    log.warning("allow-list: %s skipped: %s", path, e)
        new = frozenset(keys)
        added, removed = len(new - self.keys), len(self.keys - new)
        self.keys, self._signature = new, signature
        if added or removed:
            log.info(
                "allow-list %s: %d keys (%d added, %d removed)",
                self.directory,
                len(new),
                added,
                removed,
            )
        return added, removed


# -- CURVE options for one socket -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Curve:
    """CURVE options: this daemon's key pair; a server's ZAP domain; a client's expected server key."""

    keys: KeyPair
    zap_domain: str = ""  # a server socket: the domain (allow-list, counters) ZAP judges it by
    server_key: str = ""  # a client socket: the key the server must present
    stats: Stats | None = field(default=None, compare=False, repr=False)

    def client(self, server_key: str) -> Curve:
        """The same keys as a client expecting ``server_key``."""
        return Curve(self.keys, self.zap_domain, server_key, self.stats)

    def apply_server(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not yet bound) a CURVE server judged by the auth thread."""
        zap_handler()  # before the bind: without a handler libzmq admits every client
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret.encode("ascii"))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public.encode("ascii"))
        sock.setsockopt(zmq.ZAP_DOMAIN, self.zap_domain.encode("ascii"))

    def apply_client(self, sock: zmq.Socket[bytes], server_key: str = "") -> None:
        """Make ``sock`` (not yet connected) a CURVE client that verifies the server's key."""
        key = server_key or self.server_key
        if not is_z85_key(key):
            raise zmq.ZMQError(errno.EACCES, "no valid CURVE server key known for this endpoint")
        sock.setsockopt(zmq.CURVE_SERVERKEY, key.encode("ascii"))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public.encode("ascii"))
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret.encode("ascii"))


def watch_server(sock: zmq.Socket[bytes], stats: Stats | None, domain: str = "") -> None:
    """Count the failed handshakes of server socket ``sock`` (call before it binds).

    When ``sock`` closes, its ZAP ``domain`` is forgotten. The monitor's PAIR is connected
    here, on the owner's thread, so no event is lost before the auth thread reads it; from
    then on only the auth thread touches it.
    """
    if stats is None:
        return
    handler = zap_handler()
    addr = f"inproc://kvxferd-auth-monitor-{next(_monitor_ids)}"
    sock.monitor(addr, HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
    pair = handler.ctx.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(addr)
    handler.watch(pair, stats, domain)


_monitor_ids = itertools.count(1)
_domain_ids = itertools.count(1)


# -- the auth thread: ZAP and monitors ----------------------------------------------------------


@dataclass(slots=True)
class _Domain:
    allow: AllowList
    stats: Stats | None


class _AuthThread:
    """The ZAP handler and server-socket monitor reader of one process context.

    Thread ``kvxferd-auth`` owns the ZAP REP socket and every monitor PAIR (handed over
    under ``_lock`` by :meth:`watch`). ``_lock`` guards ``_domains`` and ``_new_monitors``.
    It never stops while its context lives (the process context is never terminated).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._domains: dict[str, _Domain] = {}
        self._new_monitors: list[tuple[zmq.Socket[bytes], Stats, str]] = []
        self.refused_unknown_domain = 0  # refusals with no service to count them in
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kvxferd-auth", daemon=True)
        self._thread.start()

    def register(self, domain: str, allow: AllowList, stats: Stats | None) -> None:
        with self._lock:
            self._domains[domain] = _Domain(allow, stats)

    def unregister(self, domain: str) -> None:
        with self._lock:
            self._domains.pop(domain, None)

    def watch(self, pair: zmq.Socket[bytes], stats: Stats, domain: str) -> None:
        with self._lock:
            self._new_monitors.append((pair, stats, domain))

    def reload(self) -> None:
        """Re-read every registered allow-list (SIGHUP)."""
        with self._lock:
            lists = {id(d.allow): d.allow for d in self._domains.values()}
        for allow in lists.values():
            allow.reload()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: dict[zmq.Socket[bytes], tuple[Stats, str]] = {}
        while True:
            try:
                with self._lock:
                    fresh, self._new_monitors = self._new_monitors, []
                for pair, stats, domain in fresh:
                    monitors[pair] = (stats, domain)
                    poller.register(pair, zmq.POLLIN)
                events = dict(poller.poll(_TICK_MS))
                if self._zap in events:
                    for _ in range(256):
                        try:
                            msg = self._zap.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._zap.send_multipart(self._answer(msg))
                for pair in [p for p in monitors if p in events]:
                    stats, domain = monitors[pair]
                    if self._on_monitor(pair, stats):  # its socket closed
                        poller.unregister(pair)
                        del monitors[pair]
                        pair.close(linger=0)
                        if domain:
                            self.unregister(domain)
                self._poll_allow_lists(time.monotonic())
            except zmq.ContextTerminated:
                return
            except Exception:  # no input may end the thread that admits every client
                log.exception("auth thread: unexpected error (continuing)")

    def _poll_allow_lists(self, now: float) -> None:
        with self._lock:
            lists = {id(d.allow): d.allow for d in self._domains.values()}
        for allow in lists.values():
            if allow.poll_s and now >= allow.next_check:
                allow.next_check = now + allow.poll_s
                if allow.changed():
                    allow.reload()

    def _on_monitor(self, pair: zmq.Socket[bytes], stats: Stats) -> bool:
        """Count the failed handshakes queued on ``pair``; True when its socket closed."""
        for _ in range(256):
            try:
                event = parse_monitor_message(pair.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return False
            if event == zmq.EVENT_MONITOR_STOPPED:
                return True
            if event & HANDSHAKE_FAILED:
                stats.add(f"handshakes_failed_{handshake_kind(event)}")
        return False

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request."""
        if len(msg) < 6:
            rid = msg[1] if len(msg) > 1 else b""
            return [b"1.0", rid, b"400", b"malformed ZAP request", b"", b""]
        version, rid, domain_b, _address, _identity, mechanism, *credentials = msg
        domain = domain_b.decode("ascii", "replace")

        def refuse(reason: str, stats: Stats | None) -> list[bytes]:
            if stats is not None:
                stats.add(f"auth_refused_{reason}")
            else:
                self.refused_unknown_domain += 1
            log.info(
                "ZAP %s: refused (%s, %s)", domain, reason, mechanism.decode("ascii", "replace")
            )
            return [b"1.0", rid, b"400", reason.encode(), b"", b""]

        if version != b"1.0":
            return refuse("malformed", None)
        if not domain and mechanism == b"NULL":
            # A plaintext socket kvxferd did not give a domain (ipc engine socket, loopback
            # with security off): nothing to judge; it is anonymous.
            return [b"1.0", rid, b"200", b"OK", b"", b""]
        with self._lock:
            entry = self._domains.get(domain)
        if entry is None:
            return refuse("unknown_domain", None)
        if mechanism != b"CURVE":
            return refuse("mechanism", entry.stats)
        if len(credentials) != 1 or len(credentials[0]) != 32:
            return refuse("malformed", entry.stats)
        key = z85.encode(credentials[0]).decode("ascii")
        if key not in entry.allow:
            return refuse("unknown_key", entry.stats)
        return [b"1.0", rid, b"200", b"OK", key.encode("ascii"), b""]


_handler_lock = threading.Lock()
_handler: _AuthThread | None = None


# The process's one zmq.Context (kvxferd.transfer.control.process_context), installed by the
# control plane when it is imported: auth sits below the transfer core and imports none of it.
_context_source: Callable[[], zmq.Context[zmq.Socket[bytes]]] | None = None


def serve_context(source: Callable[[], zmq.Context[zmq.Socket[bytes]]]) -> None:
    """The ZAP handler serves the context ``source()`` returns (control.py installs its own)."""
    global _context_source
    _context_source = source


def zap_handler() -> _AuthThread:
    """The auth thread of the process context, started on first use."""
    global _handler
    if _context_source is None:
        raise RuntimeError("no process context: kvxferd.transfer.control installs it on import")
    ctx = _context_source()
    with _handler_lock:
        if _handler is None or _handler.ctx is not ctx:
            _handler = _AuthThread(ctx)
        return _handler


def reload_allow_lists() -> None:
    """Re-read every allow-list this process uses (the daemon's SIGHUP handler)."""
    with _handler_lock:
        handler = _handler
    if handler is not None:
        handler.reload()
    log.info("SIGHUP: allow-lists reloaded")


# -- one service's transport security -----------------------------------------------------------


class Transport:
    """A service's ``[security]`` made real: its CURVE options, allow-list and ZAP domain.

    With ``mode = "off"`` ``curve`` is None: sockets are plaintext, every peer is
    ``ANONYMOUS``, and :func:`kvxferd.transfer.control.connect_dealer` dials only loopback and
    ipc endpoints. With ``"curve"`` the key file and the allow-list directory are
    required (ConfigError naming the setting and ``kvxferd keygen``).
    """

    def __init__(self, security: SecuritySettings, role: str, stats: Stats | None) -> None:
        self.mode: Mode = security.mode
        self.sender_keys: dict[str, str] = {
            endpoint: key if is_z85_key(key) else _certificate_key(key, endpoint)
            for endpoint, key in security.sender_keys.items()
        }
        self.allow: AllowList | None = None
        self.curve: Curve | None = None
        self.domain = ""
        self._given: dict[str, str] = {}  # endpoint -> key given with a fetch (bounded)
        self._lock = threading.Lock()
        if self.mode == "off":
            return
        check_curve_settings(security)
        assert security.key_file is not None and security.allowed_keys_dir is not None
        keys = load_key_pair(security.key_file)
        self.allow = AllowList(
            security.allowed_keys_dir, poll_s=security.allowed_keys_poll_ms / 1000
        )
        self.domain = f"kvxferd.{role}.{next(_domain_ids)}"
        self.curve = Curve(keys, self.domain, stats=stats)
        zap_handler().register(self.domain, self.allow, stats)

    @property
    def public_key(self) -> str:
        """This daemon's public key (Z85), ``""`` when security is off."""
        return self.curve.keys.public if self.curve is not None else ""

    def server_curve(
        self, name: str, stats: Stats | None, allowed_dir: str | None = None
    ) -> Curve | None:
        """CURVE options for another server socket of this service (the engine socket on
        TCP): the same keys, its own ZAP domain and counters, and the allow-list of
        ``allowed_dir`` (re-read like the peers' one) or, without one, the peers'."""
        if self.curve is None or self.allow is None:
            return None
        allow = self.allow
        if allowed_dir is not None:
            if not Path(allowed_dir).is_dir():
                raise ConfigError(f"{allowed_dir!r} (the {name} socket's keys) is not a directory")
            allow = AllowList(allowed_dir, poll_s=self.allow.poll_s)
        domain = f"{self.domain}.{name}.{next(_domain_ids)}"
        zap_handler().register(domain, allow, stats)
        return Curve(self.curve.keys, domain, stats=stats)

    def admits(self, identity: str) -> bool:
        """True while ``identity`` may talk to this service (its key is still allowed)."""
        return self.allow is None or identity in self.allow

    def server_key_for(self, endpoint: str, given: str = "") -> str:
        """The key the sender at ``endpoint`` must present (with security off: ``given``).

        The configured ``security.sender_keys`` entry for ``endpoint`` first, else
        ``given`` (the key passed along with a fetch), else the ``"*"`` entry (every
        sender presents that key), else the last key given for that endpoint. The key
        must be in the allow-list. RejectedError ``not_authorized`` otherwise.
        """
        if self.curve is None or self.allow is None:
            return given  # security off: nothing to check; "" unless the fetch named a key
        with self._lock:
            key = (
                self.sender_keys.get(endpoint)
                or given
                or self.sender_keys.get("*")
                or self._given.get(endpoint, "")
            )
        if not key:
            raise RejectedError(
                Reason.NOT_AUTHORIZED,
                f"no public key known for sender {endpoint!r} (security.sender_keys, or the"
                " key published with the request)",
            )
        if key not in self.allow:
            raise RejectedError(
                Reason.NOT_AUTHORIZED,
                f"the key given for sender {endpoint!r} is not in security.allowed_keys_dir",
            )
        if given and given == key:
            with self._lock:
                self._given.pop(endpoint, None)
                self._given[endpoint] = key
                while len(self._given) > 4096:
                    del self._given[next(iter(self._given))]
        return key

    def learn_key(self, endpoint: str, key: str) -> bool:
        """A sender's key from discovery: expect it at ``endpoint`` (after the configured
        ``security.sender_keys`` and a key given with a fetch). False, and nothing kept,
        when security is off or the key is not in the allow-list."""
        if self.curve is None or self.allow is None or key not in self.allow:
            return False
        with self._lock:
            self._given.pop(endpoint, None)
            self._given[endpoint] = key
            while len(self._given) > 4096:
                del self._given[next(iter(self._given))]
        return True

    def close(self) -> None:
        """Stop judging this service's domain (its server socket is closed)."""
        if self.domain:
            zap_handler().unregister(self.domain)


def _certificate_key(path: str, endpoint: str) -> str:
    try:
        return load_public_key(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"security.sender_keys[{endpoint!r}] = {path!r} cannot be read as a public key"
            f" certificate ({e})"
        ) from None


def check_curve_settings(security: SecuritySettings) -> None:
    """ConfigError naming the setting when ``mode = "curve"`` lacks a key file or allow-list."""
    if security.mode != "curve":
        return
    hint = (
        "create a key pair with `kvxferd keygen --dir /etc/kvxferd/keys --name NAME`"
        ' and set security.key_file = "/etc/kvxferd/keys/NAME.key_secret"'
        ' (or security.mode = "off" on loopback/ipc only)'
    )
    if not security.key_file:
        raise ConfigError(f'security.key_file is not set and security.mode is "curve": {hint}')
    if not Path(security.key_file).is_file():
        raise ConfigError(f"security.key_file = {security.key_file!r} does not exist: {hint}")
    if not security.allowed_keys_dir:
        raise ConfigError(
            'security.allowed_keys_dir is not set and security.mode is "curve": give the'
            " directory holding the public certificates (NAME.key) of the peers allowed in"
        )
    if not Path(security.allowed_keys_dir).is_dir():
        raise ConfigError(
            f"security.allowed_keys_dir = {security.allowed_keys_dir!r} is not a directory"
        )
