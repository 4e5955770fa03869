"""The report's period from what people type (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from gpuorch_report import OPEN_END, resolve_period

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(("since", "start_text", "end_text", "start", "end", "upper"), [
    ("7d", None, None, NOW - timedelta(days=7), NOW, NOW + OPEN_END),
    ("30m", None, None, NOW - timedelta(minutes=30), NOW, NOW + OPEN_END),
    ("7d", "2026-11-24", "2026-11-30T09:00", datetime(2026, 11, 24, tzinfo=UTC),
     datetime(2026, 11, 30, 9, tzinfo=UTC), datetime(2026, 11, 30, 9, tzinfo=UTC)),
    ("7d", "2d", None, NOW - timedelta(days=2), NOW, NOW + OPEN_END),
    ("1d", None, "2026-11-30", datetime(2026, 11, 29, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC),
     datetime(2026, 11, 30, tzinfo=UTC)),
])
def test_periods(since: str, start_text: str | None, end_text: str | None, start: datetime, end: datetime,
                 upper: datetime) -> None:
    period = resolve_period(NOW, since, start_text, end_text)
    assert (period.start, period.end, period.upper, period.since) == (start, end, upper, since)


@pytest.mark.parametrize(("since", "start_text", "end_text", "says"), [
    ("7 days", None, None, "use a number and m, h, d or w"),
    ("7d", "last tuesday", None, "use a date"),
    ("7d", "2026-11-30", "2026-11-24", "must be before"),
])
def test_bad_periods_say_what_to_type(since: str, start_text: str | None, end_text: str | None, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        resolve_period(NOW, since, start_text, end_text)
