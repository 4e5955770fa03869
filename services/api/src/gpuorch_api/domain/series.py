"""Utilisation and memory over time, shaped for a chart: one time axis and, per device, a value or None for each
point of it. A bucket without a sample is None (a gap the chart leaves open), never a value carried over or a line
joined across it.

    SeriesWindow.pick(start, end)   which resolution a window is read at: telemetry's 5-minute rollups when the
                                    window holds at least MIN_ROLLUP_POINTS of them, else raw samples in buckets
                                    of about span / RAW_POINTS (5 s at least)
    aligned(rows, window, labels)   {"t": [epoch s...], "series": [{"key", "label", "util_pct": [...], ...}]}
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

ROLLUP_S = 300
"""Telemetry's rollup bucket (migration 0202; the pending view 0204 bins the newest samples the same way)."""
MIN_ROLLUP_POINTS = 6
RAW_POINTS = 120
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
"""The origin telemetry's buckets are binned from (``date_bin(..., '2000-01-01')``)."""


@dataclass(frozen=True)
class SeriesWindow:
    start: datetime
    """The first bucket's start (aligned on ``bucket_s`` from EPOCH)."""
    end: datetime
    bucket_s: int

    @property
    def from_rollups(self) -> bool:
        return self.bucket_s == ROLLUP_S

    @property
    def source(self) -> str:
        return "rollups" if self.from_rollups else f"raw samples ({self.bucket_s} s buckets)"

    @classmethod
    def pick(cls, start: datetime, end: datetime) -> SeriesWindow:
        span = max(0.0, (end - start).total_seconds())
        bucket_s = ROLLUP_S if span >= MIN_ROLLUP_POINTS * ROLLUP_S else int(max(5, min(ROLLUP_S, span // RAW_POINTS)))
        return cls(_floor(start, bucket_s), end, bucket_s)

    def axis(self) -> list[datetime]:
        step = timedelta(seconds=self.bucket_s)
        points, at = [], self.start
        while at <= self.end:
            points.append(at)
            at += step
        return points


def _floor(at: datetime, bucket_s: int) -> datetime:
    offset = (at - EPOCH).total_seconds()
    return EPOCH + timedelta(seconds=offset - offset % bucket_s)


def aligned(rows: list[dict[str, Any]], window: SeriesWindow, labels: dict[str, str]) -> dict[str, Any]:
    """``rows`` (``bucket``, ``key``, ``util_pct``, ``memory_mib``) on ``window``'s axis, one series per key of
    ``labels`` (in its order; a key without rows is a series of gaps). Values rounded to 0.1."""
    axis = window.axis()
    index = {at: i for i, at in enumerate(axis)}
    values: dict[tuple[str, str], list[float | None]] = {
        (key, field): [None] * len(axis) for key in labels for field in FIELDS}
    for row in rows:
        i = index.get(row["bucket"])
        if row["key"] not in labels or i is None:
            continue
        for field in FIELDS:
            value = row.get(field)
            values[row["key"], field][i] = None if value is None else round(float(value), 1)
    return {"source": window.source, "bucket_s": window.bucket_s, "start": window.start, "end": window.end,
            "t": [int(at.timestamp()) for at in axis],
            "series": [{"key": key, "label": label, **{field: values[key, field] for field in FIELDS}}
                       for key, label in labels.items()]}


FIELDS = ("util_pct", "memory_mib")
