"""Reading what the workers wrote in Redis, for the operator's tools: a field that cannot be read is marked
in its place (written by hand, by another version), and the rest around it still shows."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any


def text(value: Any) -> str:
    """A Redis reply as text."""
    # Bytes no worker wrote (not UTF-8) show escaped, rather than fail the report.
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


#: How every mark of :func:`unreadable` starts.
MARK = "(unreadable: "


def unreadable(reason: str) -> str:
    """What shows in place of a record or field that cannot be read, so that the rest around it still shows."""
    return f"{MARK}{reason})"


#: How deep the JSON an operator gives (a stored entry's arguments, data and options) or a tool reads back (a
#: record, a dead letter's arguments) may nest; deeper is refused in one line. Python's JSON parser and encoder
#: recurse once a level, so some hundreds of levels already fail or not depending on the stack they start from.
MAX_JSON_DEPTH = 100
#: How deep a record read back may nest: what was given sits one level down in it (an entry's ``args``).
RECORD_DEPTH = MAX_JSON_DEPTH + 1


class TooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`."""

    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_JSON_DEPTH} levels")


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`TooDeep` if ``value``'s lists and objects nest deeper than ``limit`` (``[[]]`` is 2 deep);
    a list that holds itself is refused too. Iterative: it never recurses itself."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth == limit:
            raise TooDeep()
        stack.extend((child, depth + 1) for child in children)


def json_value(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` parsed as JSON, no deeper than ``limit``.

    Raises:
        TooDeep: nested deeper (however deep: the parser's ``RecursionError`` is this too).
        ValueError: not JSON.
    """
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TooDeep() from None
    check_depth(value, limit)
    return value


def json_object(raw: bytes | str) -> dict[str, Any] | str:
    """The JSON object a worker wrote, or the mark in its place (written by hand, by another version)."""
    try:
        value = json_value(raw, RECORD_DEPTH)
    except TooDeep as exc:
        return unreadable(str(exc))
    except ValueError:
        return unreadable("not JSON")
    return value if isinstance(value, dict) else unreadable("not a JSON object")


def shallow(value: Any) -> Any:
    """``value``, or the mark in its place when it nests deeper than :data:`MAX_JSON_DEPTH`."""
    try:
        check_depth(value)
    except TooDeep as exc:
        return unreadable(str(exc))
    return value


def moment(ms: Any, label: str) -> int | str:
    """``ms``, a time in ms since the epoch, as a whole number; its mark when it is no time a page can show
    (``'abc'``, ``inf``, past the year 9999)."""
    try:
        datetime.fromtimestamp(int(ms) / 1000, UTC)
    except (TypeError, ValueError, OverflowError, OSError):
        return unreadable(f"{label}={reprlib.repr(ms)}")
    return int(ms)


def readable(value: Any, label: str, read: Callable[[Any], Any]) -> Any:
    """``value`` as ``read`` reads it, or the mark in its place: of another type (written by hand, by another
    version)."""
    try:
        return read(value)
    except (TypeError, ValueError, OverflowError):
        return unreadable(f"{label}={reprlib.repr(value)}")


def field(record: dict[str, Any], name: str, read: Callable[[Any], Any]) -> Any:
    """``record[name]`` as ``read`` reads it, or the mark in its place: missing, or of another type."""
    return readable(record[name], name, read) if name in record else unreadable(f"no {name}")


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def seconds(value: Any) -> Any:
    timedelta(seconds=value)  # what the page makes of it: raises for a string, inf, NaN, 1e300
    return value


def raw_name(value: bytes | str) -> str:
    """A name as Redis holds it; one not UTF-8 keeps its bytes, as surrogates, to be marked (:func:`garbled`)."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def garbled(name: str) -> str:
    """The mark of a queue name that is not UTF-8 (see :func:`raw_name`), or ""."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return unreadable(f"name not UTF-8: {name.encode(errors='surrogateescape')!r}")
    return ""
