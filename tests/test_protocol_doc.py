"""docs/protocol.md against the code: reason codes, message tags and fields, version."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
MESSAGES: tuple[type[msgspec.Struct], ...] = typing.get_args(wire.ToSender) + typing.get_args(
    wire.ToReceiver
)
HEADING = re.compile(r'^### (\w+) \(`"t": "(\w+)"`\)', re.M)
FIRST_CELL = re.compile(r"^\| `([a-z_0-9]+)` \|", re.M)


def section(number: int) -> str:
    """The text of top-level section ``number`` of the document, heading excluded."""
    text = DOC.read_text(encoding="utf-8")
    start = re.search(rf"^## {number}\. .*$", text, re.M)
    assert start is not None, f"no section {number}"
    end = re.search(r"^## \d+\. ", text[start.end() :], re.M)
    return text[start.end() : start.end() + end.start()] if end else text[start.end() :]


def first_cells(table_text: str) -> list[str]:
    """The back-quoted first cell of every table row in ``table_text``."""
    return FIRST_CELL.findall(table_text)


def message_tables() -> dict[str, tuple[str, list[str]]]:
    """Each §4 heading's tag mapped to (its message name, the fields of its table)."""
    text = section(4)
    heads = list(HEADING.finditer(text))
    tables = {}
    for i, h in enumerate(heads):
        body = text[h.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        tables[h.group(2)] = (h.group(1), first_cells(body))
    return tables


def test_reason_table_lists_exactly_the_reason_codes() -> None:
    """The §5 table has one row per Reason value, each once, and no other row."""
    rows = first_cells(section(5))
    assert sorted(rows) == sorted(r.value for r in Reason)


def test_every_message_tag_has_a_section_4_heading() -> None:
    """Every message tag in protocol.py is a §4 heading under its class name, and no other tag is."""
    tables = message_tables()
    tags = {m.__struct_config__.tag: m.__name__ for m in MESSAGES}
    assert {tag: name for tag, (name, _) in tables.items()} == tags
    assert set(tags) == {m.__struct_config__.tag for m in wire._Msg.__subclasses__()}


def test_each_message_table_lists_exactly_its_struct_fields() -> None:
    """Each §4 message table names every field of its msgspec struct, once, in order, and nothing else."""
    tables = message_tables()
    for m in MESSAGES:
        _, fields = tables[str(m.__struct_config__.tag)]
        assert fields == list(m.__struct_fields__), m.__name__


def test_wire_layout_table_lists_exactly_its_fields() -> None:
    """The §3 WireLayout table names every WireLayout field, once, in order, and nothing else."""
    text = section(3)
    start = text.index("### WireLayout")
    table = text[start:].split("\n\n", 2)[1]
    assert first_cells(table) == list(wire.WireLayout.__struct_fields__)


def test_title_version_is_the_protocol_version() -> None:
    """The document's title names the version the code speaks (PROTOCOL_VERSION)."""
    title = DOC.read_text(encoding="utf-8").splitlines()[0]
    match = re.fullmatch(r"# The kvxferd wire protocol, version (\d+)", title)
    assert match is not None, title
    assert int(match.group(1)) == wire.PROTOCOL_VERSION
