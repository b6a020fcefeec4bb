"""Endpoints from request data are dialled only when the strict parser and the allow-list (dial_allow) accept them."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.config import load_receiver_settings
from kvxferd.endpoints import DialAllow, parse_endpoint
from kvxferd.errors import ConfigError, Reason, RejectedError
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.receiver import Receiver
from tests.test_races import POOL, RECEIVER_DEADLINES

pytestmark = pytest.mark.timeout(60)

REFUSED = [
    "tcp://127.0.0.1:0;10.9.9.9:9999",  # libzmq's source syntax: dials the second address
    "tcp://a:0;b:9999",
    "tcp://127.0.0.1:5555;",
    "tcp://*:5555",
    "tcp://0.0.0.0:5555",
    "tcp://[::]:5555",
    "tcp://user@127.0.0.1:5555",
    "tcp://127.0.0.1:5555/path",
    "tcp://127.0.0.1:5555?x",
    "tcp://127.0.0.1 :5555",
    " tcp://127.0.0.1:5555",
    "tcp://127.0.0.1:5555\n",
    "tcp://:5555",
    "tcp://127.0.0.1:",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:05555",
    "tcp://127.0.0.1:65536",
    "tcp://127.0.0.1:+80",
    "tcp://127.1:5555",
    "tcp://127.0.0.01:5555",
    "tcp://::1:5555",
    "tcp://[::1:5555",
    "tcp://-bad.host:5555",
    "tcp://b\u00e4d:5555",
    "udp://127.0.0.1:5555",
    "pgm://eth0;239.192.1.1:5555",
    "inproc://x",
    "ipc://",
    "TCP://127.0.0.1:5555",
    "tcp://127.0.0.1%lo:5555",
]


@pytest.mark.parametrize("endpoint", REFUSED)
def test_the_parser_refuses_what_libzmq_would_read_differently(endpoint: str) -> None:
    """Source syntax, wildcards, other schemes, userinfo, whitespace, empty hosts and odd ports are refused with a reason."""
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)
    assert DialAllow().problem(endpoint) is not None


def test_the_default_allows_loopback_and_ipc_only() -> None:
    """With no dial_allow, loopback addresses, localhost and ipc are allowed, any other host is not."""
    d = DialAllow()
    for ok in (
        "tcp://127.0.0.1:5555",
        "tcp://127.9.8.7:1",
        "tcp://[::1]:9",
        "tcp://localhost:5",
        "ipc:///tmp/x.sock",
    ):
        assert d.problem(ok) is None, ok
    for no in ("tcp://10.0.0.1:5555", "tcp://sender-0:5555", "tcp://[fd00::1]:5555"):
        assert "not in dial_allow" in (d.problem(no) or ""), no


def test_rules_match_hosts_cidrs_and_port_ranges_literally() -> None:
    """A CIDR matches only literal addresses in it, a name only that name, and ports only within the range."""
    d = DialAllow(
        ["10.0.0.0/8:5000-6000", "sender-0.svc", "[fd00::/8]:7000", "ipc:///run/kvxferd/"]
    )
    assert d.problem("tcp://10.1.2.3:5555") is None
    assert d.problem("tcp://10.1.2.3:7000") is not None
    assert d.problem("tcp://11.0.0.1:5555") is not None
    assert d.problem("tcp://SENDER-0.svc:1") is None
    assert d.problem("tcp://sender-1.svc:1") is not None
    assert d.problem("tcp://[fd00::1]:7000") is None and d.problem("tcp://[fd00::1]:7001")
    assert d.problem("ipc:///run/kvxferd/tx.sock") is None and d.problem("ipc:///tmp/tx.sock")
    assert d.problem("tcp://127.0.0.1:5555") is not None, "the default is replaced, not extended"


@pytest.mark.parametrize(
    "entry",
    ["*", "0.0.0.0/0", "::/0", "10.0.0.1/8", "tcp://x:1", "a b", "h:0", "h:9-1", "[::1", "x;y"],
)
def test_bad_dial_allow_entries_are_refused_at_load(entry: str) -> None:
    """A dial_allow entry that is a wildcard, a /0, not a network, or not an entry at all stops the settings from loading."""
    with pytest.raises(ConfigError, match="dial_allow"):
        load_receiver_settings(access={"dial_allow": [entry]})


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=40))
def test_anything_with_a_semicolon_or_whitespace_is_refused(junk: str) -> None:
    """No string holding ';' or whitespace is ever an endpoint, wherever it is placed."""
    for endpoint in (
        f"tcp://127.0.0.1:1;{junk}",
        f"tcp://{junk};127.0.0.1:5",
        f"tcp://127.0.0.1:5 {junk}",
    ):
        with pytest.raises(ValueError):
            parse_endpoint(endpoint)


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(), st.integers(1, 65535))
def test_an_accepted_address_is_the_one_dialled(address: ipaddress._BaseAddress, port: int) -> None:
    """A literal address endpoint parses back to exactly that address and port, and a rule for it allows only it."""
    host = f"[{address}]" if address.version == 6 else str(address)
    endpoint = f"tcp://{host}:{port}"
    if address.is_unspecified:
        with pytest.raises(ValueError):
            parse_endpoint(endpoint)
        return
    ep = parse_endpoint(endpoint)
    assert (ep.address, ep.port) == (address, port)
    bits = 32 if address.version == 4 else 128
    rule = f"[{address}/{bits}]:{port}" if address.version == 6 else f"{address}/{bits}:{port}"
    assert DialAllow([rule]).problem(endpoint) is None
    other = port % 65535 + 1
    assert DialAllow([rule]).problem(f"tcp://{host}:{other}") is not None


@pytest.fixture
def receiver_for() -> object:
    made: list[Receiver] = []

    def make(dial_allow: list[str] | None = None) -> Receiver:
        s = load_receiver_settings(
            name="rx-dial",
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=RECEIVER_DEADLINES,
            access={"dial_allow": dial_allow or []},
        )
        rx = Receiver(s, dataplane=ControlledDataPlane("rx-dial")).start()
        made.append(rx)
        return rx

    yield make
    for rx in made:
        rx.shutdown(timeout=2.0)


def test_a_fetch_naming_an_endpoint_outside_the_allow_list_is_refused_before_any_dial(
    receiver_for: object,
) -> None:
    """A fetch whose sender endpoint fails dial_allow is refused not_authorized with the reason, counted, and opens no link."""
    rx = receiver_for()  # type: ignore[operator]
    with pytest.raises(RejectedError) as ei:
        rx.fetch("r1", "tcp://10.0.0.1:5555", [1, 2])
    assert ei.value.reason is Reason.NOT_AUTHORIZED and "dial_allow" in ei.value.detail
    with pytest.raises(RejectedError) as ei:
        rx.fetch("r2", "tcp://127.0.0.1:0;10.0.0.1:9999", [1, 2])
    assert ei.value.reason in (Reason.BAD_ENDPOINT, Reason.NOT_AUTHORIZED)
    assert "';'" in ei.value.detail
    assert rx.stats.get("endpoints_refused") == 1
    assert rx.fetches_in_flight() == 0 and not rx.links.links


def test_an_operator_rule_replaces_the_default(receiver_for: object) -> None:
    """With dial_allow set, an endpoint it allows is dialled and loopback outside it is refused."""
    rx = receiver_for(["127.0.0.2/32:1000-2000"])  # type: ignore[operator]
    h = rx.fetch("r1", "tcp://127.0.0.2:1500", [1, 2], timeout_ms=200)
    with pytest.raises(RejectedError) as ei:
        rx.fetch("r2", "tcp://127.0.0.1:1500", [1, 2])
    assert ei.value.reason is Reason.NOT_AUTHORIZED
    h.cancel()
