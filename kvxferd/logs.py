"""Structured logs: every ``logging.getLogger("kvxferd.*")`` line becomes key/value (or JSON) on stderr.

The modules keep using the standard library; :func:`configure` routes the
root logger through structlog's ``ProcessorFormatter``, so a line carries the
level, the logger name, an ISO UTC timestamp and whatever :func:`bind` put in
the current context (session, peer and request ids)::

    logs.configure("info", json=True)
    with logs.bound(request_id="r-1", peer="decode-3"):
        log.info("fetch attached")   # {"event": "fetch attached", "request_id": "r-1", ...}
    log.warning("request ended", extra={"request_id": "r-1", "outcome": "failed"})
        # the keys of RECORD_FIELDS given in ``extra`` become fields of the line too

Context lives in ``contextvars``: it follows the asyncio task (or thread)
that bound it, never another thread's work.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import structlog
from structlog.types import Processor

_HANDLER_NAME = "kvxferd"

# Fields a stdlib record may carry in ``extra=`` that become keys of the line (the
# journal's per-request lines; see journal.py). An allow list: no other extra leaks.
RECORD_FIELDS: tuple[str, ...] = (
    "request_id",
    "role",
    "kind",
    "peer",
    "fetch_id",
    "outcome",
    "reason",
    "detail",
    "duration_ms",
    "bytes",
    "blocks",
    "post_ms",
    "transfer_ms",
    "write",
    "stalled_ms",
)

_SHARED: list[Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.ExtraAdder(RECORD_FIELDS),
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure(level: str, json: bool, *, stream: IO[str] | None = None) -> None:
    """Route stdlib and structlog logging to ``stream`` (stderr): JSON lines or console text.

    Idempotent: a second call replaces the handler the first one installed.
    """
    renderer: Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
        tail: list[Processor] = [structlog.processors.format_exc_info, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        tail = [renderer]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
    )
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    """A structlog logger that writes through the stdlib logger ``name``."""
    return structlog.stdlib.get_logger(name)


def bind(**kv: Any) -> None:
    """Add ``kv`` to every line logged from the current context (task or thread)."""
    structlog.contextvars.bind_contextvars(**kv)


def unbind(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)


def clear() -> None:
    structlog.contextvars.clear_contextvars()


@contextmanager
def bound(**kv: Any) -> Iterator[None]:
    """``bind(**kv)`` for the duration of a ``with`` block, then restore what was there."""
    with structlog.contextvars.bound_contextvars(**kv):
        yield
