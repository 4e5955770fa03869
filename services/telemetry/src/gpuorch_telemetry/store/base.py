"""The store's shared part: its pool, retention policy and the raw tables' day partitions; the rows it hands out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Self

import asyncpg


@dataclass(frozen=True)
class RetentionPolicy:
    raw_days: int = 3
    """Raw samples (and the idempotency ledger) are kept this many whole UTC days besides today."""
    rollup_days: int = 180
    bucket_s: int = 300
    sample_interval_s: float = 10.0
    """Nominal sampling period: the weight of a series' first sample, and 3x of it caps a gap."""
    rollup_lateness_s: float = 60.0
    """A bucket is rolled up once it closed this long ago (late samples after that miss the rollup)."""
    idle_util_pct: float = 5.0


@dataclass
class IngestOutcome:
    applied: int = 0
    duplicates: int = 0
    out_of_range: int = 0
    gpu_rows: int = 0
    job_rows: int = 0
    new_alerts: int = 0
    oldest_applied_at: datetime | None = None
    applied_occurred_at: list[datetime] = field(default_factory=list)


@dataclass(frozen=True)
class AlertRow:
    alert_id: uuid.UUID
    category: str
    kind: str
    severity: str
    job_id: uuid.UUID | None
    node_id: str
    gpu_uuid: str | None
    tenant: str | None
    explanation: str
    evidence: dict[str, float]
    advice: str | None
    raised_at: datetime
    resolved_at: datetime | None
    resolve_reason: str | None
    raise_pending: bool
    resolve_pending: bool


def day_of(ts: datetime) -> date:
    return ts.astimezone(UTC).date()


class StoreBase:
    """The connection pool and the raw tables' day partitions, shared by the store's parts."""

    pool: asyncpg.Pool
    retention: RetentionPolicy
    _partition_days: set[date]

    def __init__(self, pool: asyncpg.Pool, retention: RetentionPolicy | None = None) -> None:
        self.pool = pool
        self.retention = retention or RetentionPolicy()
        self._partition_days: set[date] = set()

    @classmethod
    async def open(cls, dsn: str, retention: RetentionPolicy | None = None, *, max_size: int = 8) -> Self:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size)
        assert pool is not None
        return cls(pool, retention)

    async def close(self) -> None:
        await self.pool.close()

    # -- partitions ---------------------------------------------------------------------------------------------

    def _accepts_day(self, day: date, today: date) -> bool:
        return today - timedelta(days=self.retention.raw_days) <= day <= today + timedelta(days=1)

    async def ensure_partitions(self, first: date, last: date) -> None:
        """Create the raw tables' day partitions for ``first..last`` (own transaction; cached per process)."""
        wanted = {first + timedelta(days=i) for i in range((last - first).days + 1)}
        if wanted <= self._partition_days:
            return
        async with self.pool.acquire() as conn:
            await conn.execute("SELECT telemetry_ensure_day_partitions($1, $2)", first, last)
        self._partition_days |= wanted
