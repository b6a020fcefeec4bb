"""Structured logs: stdlib loggers come out as JSON lines (or console text) with bound context."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from kvxferd import logs

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    """A stream to configure logging onto; the root logger and structlog are restored after."""
    root = logging.getLogger()
    level = root.level
    buf = io.StringIO()
    try:
        yield buf
    finally:
        for h in [h for h in root.handlers if h.get_name() == "kvxferd"]:
            root.removeHandler(h)
        root.setLevel(level)
        logs.clear()
        structlog.reset_defaults()


def lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_stdlib_lines_become_json_objects(out: io.StringIO) -> None:
    """A stdlib call with %-arguments is one JSON object with level, logger and a UTC ISO time."""
    logs.configure("info", json=True, stream=out)
    logging.getLogger("kvxferd.sender").info("receiver %s registered", "rx-1")
    logging.getLogger("kvxferd.sender").debug("not at info")
    (line,) = lines(out)
    assert line["event"] == "receiver rx-1 registered"
    assert line["level"] == "info"
    assert line["logger"] == "kvxferd.sender"
    assert str(line["timestamp"]).endswith("Z")


def test_bound_context_appears_on_lines_and_leaves_after(out: io.StringIO) -> None:
    """Keys bound with bound()/bind() appear on every line inside and are gone after."""
    logs.configure("info", json=True, stream=out)
    log = logging.getLogger("kvxferd.receiver")
    with logs.bound(request_id="r-7", peer="decode-3"):
        log.info("inside")
    log.info("outside")
    logs.bind(session=12)
    logs.get_logger("kvxferd.daemon").info("native", sessions=2)
    inside, outside, native = lines(out)
    assert inside["request_id"] == "r-7" and inside["peer"] == "decode-3"
    assert "request_id" not in outside
    assert native["session"] == 12 and native["sessions"] == 2 and native["event"] == "native"


def test_exceptions_are_rendered_into_the_json_line(out: io.StringIO) -> None:
    """log.exception puts the traceback in the same JSON object, not on extra lines."""
    logs.configure("info", json=True, stream=out)
    try:
        raise ValueError("bad frame")
    except ValueError:
        logging.getLogger("kvxferd.sender").exception("listener: message failed")
    (line,) = lines(out)
    assert "ValueError: bad frame" in str(line["exception"])


def test_console_renderer_and_reconfigure_do_not_duplicate(out: io.StringIO) -> None:
    """json=False gives one readable line with key=value context, even after configuring twice."""
    logs.configure("info", json=True, stream=out)
    logs.configure("debug", json=False, stream=out)
    with logs.bound(peer="p1"):
        logging.getLogger("kvxferd.x").debug("hello %d", 3)
    (text,) = out.getvalue().splitlines()
    assert "hello 3" in text and "peer=p1" in text and "[kvxferd.x]" in text
