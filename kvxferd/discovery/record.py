"""The record a daemon advertises: its role, name, incarnation, endpoints, key and topology.

One record per daemon, JSON on the wire (etcd value, static file entry)::

    {"role": "sender", "name": "prefill-0", "incarnation": "3f2c...",
     "endpoints": {"listen": "tcp://10.1.2.3:5555"},
     "public_key": "", "topology": {"host": "node-7", "zone": "a", "tp_rank": 0}}

``endpoints`` holds the advertised addresses peers dial: ``listen`` for a sender
(its ROUTER), ``result`` for a receiver (its result ROUTER). Each passes
:func:`kvxferd.endpoints.connect_problem`, so a record advertising a wildcard
(``tcp://0.0.0.0:5555``) is malformed. ``incarnation`` changes on every daemon
start ("" where the backend cannot know it: dns, a static file without one).
``public_key`` is the daemon's CURVE public key (Z85; "" with security off): a
receiver that discovers a sender expects that key at its endpoint, if its own
allow-list holds it (a record cannot bring in a key the operator did not allow).
Unknown fields are ignored, so a newer daemon's record still reads in an older one.

:func:`decode_record` validates everything; a bad record raises
:class:`RecordError` and the watcher counts and skips it.
"""

from __future__ import annotations

import socket
from typing import Annotated, Literal

import msgspec

from kvxferd.endpoints import connect_problem

Role = Literal["sender", "receiver"]
ROLES: tuple[Role, ...] = ("sender", "receiver")

# The endpoint peers dial, by the advertising daemon's role.
MAIN_ENDPOINT: dict[str, str] = {"sender": "listen", "receiver": "result"}

NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"  # the settings' name pattern (config.py)
MAX_RECORD_BYTES = 16_384
MAX_TOPOLOGY_ITEMS = 32
MAX_ENDPOINTS = 8

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
TopologyValue = str | int | float | bool


class RecordError(ValueError):
    """A record that does not decode or does not validate; the reason is the message."""


class PeerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What one daemon advertises about itself."""

    role: Role
    name: Name
    incarnation: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{0,128}$")] = ""
    endpoints: dict[Annotated[str, msgspec.Meta(pattern=r"^[a-z_]{1,32}$")], str]
    public_key: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    topology: dict[
        Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], TopologyValue
    ] = msgspec.field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The address peers dial: a sender's ``listen``, a receiver's ``result``."""
        return self.endpoints[MAIN_ENDPOINT[self.role]]


def check_record(rec: PeerRecord) -> PeerRecord:
    """``rec`` if it is usable; RecordError naming what is wrong otherwise."""
    main = MAIN_ENDPOINT[rec.role]
    if main not in rec.endpoints:
        raise RecordError(f"{rec.role} {rec.name!r} advertises no {main!r} endpoint")
    if len(rec.endpoints) > MAX_ENDPOINTS:
        raise RecordError(f"{rec.name!r}: more than {MAX_ENDPOINTS} endpoints")
    for key, url in rec.endpoints.items():
        why = connect_problem(url)
        if why is not None:
            raise RecordError(f"{rec.name!r} endpoint {key}: {why}")
    if len(rec.topology) > MAX_TOPOLOGY_ITEMS:
        raise RecordError(f"{rec.name!r}: more than {MAX_TOPOLOGY_ITEMS} topology entries")
    for key, value in rec.topology.items():
        if isinstance(value, str) and len(value) > 256:
            raise RecordError(f"{rec.name!r}: topology {key!r} longer than 256 characters")
    return rec


_decoder = msgspec.json.Decoder(PeerRecord)
_encoder = msgspec.json.Encoder()


def encode_record(rec: PeerRecord) -> bytes:
    """The record as JSON (checked first: a daemon never advertises a bad one)."""
    return _encoder.encode(check_record(rec))


def decode_record(data: bytes | str) -> PeerRecord:
    """The validated record in ``data``; RecordError if it is not one."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes (limit {MAX_RECORD_BYTES})")
    try:
        rec = _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise RecordError(str(e)) from None
    return check_record(rec)


def record_from_dict(obj: object) -> PeerRecord:
    """A record from an already parsed object (a static file's entry); RecordError if bad."""
    try:
        rec = msgspec.convert(obj, PeerRecord)
    except msgspec.ValidationError as e:
        raise RecordError(str(e)) from None
    return check_record(rec)


def own_record(
    role: Role,
    name: str,
    incarnation: str,
    endpoint: str,
    topology: dict[str, TopologyValue] | None = None,
    public_key: str = "",
) -> PeerRecord:
    """This daemon's record: ``endpoint`` as its role's main endpoint, ``host`` filled in.

    ``endpoint`` must be the advertised address (never the bind address: a wildcard
    is refused here, as peers would refuse it).
    """
    topo: dict[str, TopologyValue] = {"host": socket.gethostname()[:256]}
    topo.update(topology or {})
    rec = PeerRecord(
        role=role,
        name=name,
        incarnation=incarnation,
        endpoints={MAIN_ENDPOINT[role]: endpoint},
        public_key=public_key,
        topology=topo,
    )
    return check_record(rec)
