"""``gpuctl reserve``: what --start accepts (the API round trip is tested in services/api and on the demo)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from gpuorch_gpuctl_ops.reserve_cmd import parse_start

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "expected"), [
    ("now", NOW),
    ("now+2h", NOW + timedelta(hours=2)),
    ("now+30m", NOW + timedelta(minutes=30)),
    ("2026-12-10T14:00", datetime(2026, 12, 10, 14, 0, tzinfo=UTC)),
    ("2026-12-10T14:00Z", datetime(2026, 12, 10, 14, 0, tzinfo=UTC)),
    ("2026-12-10T15:00+01:00", datetime(2026, 12, 10, 14, 0, tzinfo=UTC)),
])
def test_start_is_iso_8601_or_now_plus_a_duration(text: str, expected: datetime) -> None:
    assert parse_start(text, NOW) == expected


@pytest.mark.parametrize("text", ["tomorrow", "now+2x", "now-1h"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_start(text, NOW)
