"""The period a report covers, from what people type: ``--since 7d`` or ``--from``/``--to`` (``?since=``,
``?from=``, ``?to=`` on the API). Pure: ``now`` is passed in; a bad value raises ``ValueError`` with one line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

OPEN_END = timedelta(days=1)
"""Without an end the period is open-ended: rows stamped up to this far after the reader's clock still count (clock
skew between the servers that stamp samples and the one that reads them)."""

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> timedelta:
    """``30m``, ``12h``, ``7d``, ``2w`` -> timedelta."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"{text!r}: use a number and m, h, d or w, e.g. 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def parse_when(text: str, now: datetime) -> datetime:
    """``2026-11-24``, ``2026-11-24T09:00``, ``2026-11-24 09:00:00+01:00`` (UTC when no zone), or a duration back
    from now (``7d``)."""
    if _DURATION.match(text.strip()):
        return now - parse_since(text)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise ValueError(f"{text!r}: use a date (2026-11-24), a date and time (2026-11-24T09:00) or a duration "
                         "back from now (7d)") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Period:
    """``[start, end)`` as people read it; rows are read up to ``upper`` (``end``, or ``now + OPEN_END`` when no
    end was given); ``since`` is what was asked (kept in the report)."""

    since: str
    start: datetime
    end: datetime
    upper: datetime
    now: datetime


def resolve_period(now: datetime, since: str = "7d", start_text: str | None = None,
                   end_text: str | None = None) -> Period:
    """The period ``since`` back from now, or from ``start_text`` to ``end_text`` (default: now). Raises
    ``ValueError`` for a value it cannot read and for a start that is not before the end."""
    parse_since(since)
    end = parse_when(end_text, now) if end_text else None
    start = parse_when(start_text, now) if start_text else None
    if start is not None and start >= (end or now):
        raise ValueError("the start (from) must be before the end (to)")
    upper = end or now + OPEN_END
    end = end or now
    return Period(since, start or end - parse_since(since), end, upper, now)
