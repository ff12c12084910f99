"""Go-style durations (``500ms``, ``30s``, ``1h30m``, ``7d``) as used in env vars and ``@every``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_UNITS = {
    "ms": timedelta(milliseconds=1),
    "s": timedelta(seconds=1),
    "m": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
}
#: The earliest time the kit keeps (a dispatch's ``at=``, a stored date, a time option): the tools count in ms since
#: it, and ``@every`` ticks are anchored to it.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The furthest ahead the kit keeps a time: a dispatch's due time, an ``@every`` interval, a stored one-off
#: entry's date. Far past any reminder or period a business uses, and far from the year 9999 a ``datetime``
#: ends at, so every tool shows such a time in any zone.
MAX_AHEAD = timedelta(days=36_525)  # 100 years

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")


def parse_duration(value: str | float | timedelta) -> timedelta:
    """Parse ``"1h30m"``-style text, or a plain number of seconds.

    Raises:
        ValueError: the text is not a duration, it is negative, or longer than a ``timedelta`` holds.
    """
    try:
        result = _duration(value)
    except OverflowError:
        raise ValueError(f"{value!r} is longer than a duration can be (999999999 days)") from None
    if result < timedelta():
        raise ValueError(f"{value!r} is negative; a duration must be zero or more")
    return result


def _duration(value: str | float | timedelta) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    text = value.strip().lower()
    try:
        return timedelta(seconds=float(text))
    except ValueError:
        if not _WHOLE.fullmatch(text):
            raise ValueError(
                f"{value!r} is not a duration; use e.g. 500ms, 30s, 15m, 1h30m, 7d or a number of seconds"
            ) from None
        return sum((float(n) * _UNITS[unit] for n, unit in _PART.findall(text)), timedelta())


def format_duration(value: timedelta) -> str:
    """The shortest Go-style text for ``value`` (``90s`` -> ``1m30s``)."""
    ms = round(value.total_seconds() * 1000)
    if ms == 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
