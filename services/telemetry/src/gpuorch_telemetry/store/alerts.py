"""Alerts and recommendations: raise (deduplicated), resolve, publish after commit."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime

import asyncpg

from gpuorch_telemetry.domain.detection import (
    Finding,
)
from gpuorch_telemetry.store.base import AlertRow, StoreBase


class AlertStore(StoreBase):
    """``telemetry_alerts``: at most one open row per ``dedup_key``; the table is its own outbox (rows are published
    after commit and marked when the broker confirmed)."""

    async def raise_findings(self, conn: asyncpg.Connection, findings: Iterable[Finding], now: datetime) -> int:
        """Insert findings whose key has no open alert; returns how many were new."""
        new = 0
        for f in findings:
            row = await conn.fetchrow(
                """
                INSERT INTO telemetry_alerts (alert_id, category, kind, severity, dedup_key, job_id, node_id,
                    gpu_uuid, tenant, explanation, evidence, advice, raised_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb, $12, $13)
                ON CONFLICT (dedup_key) WHERE resolved_at IS NULL DO NOTHING
                RETURNING alert_id
                """,
                uuid.uuid4(), f.category, f.kind, f.severity, f.dedup_key, f.job_id, f.node_id, f.gpu_uuid, f.tenant,
                f.explanation, json.dumps(f.evidence), f.advice, now,
            )
            new += row is not None
        return new

    async def raise_finding(self, finding: Finding, now: datetime) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            return await self.raise_findings(conn, [finding], now)

    async def replace_open(self, kind: str, findings: Sequence[Finding], now: datetime, reason: str
                           ) -> tuple[int, int]:
        """Make ``findings`` the open alerts of ``kind``: raise those not open yet, resolve open ones of that kind
        whose key is not among them (one transaction). Returns (raised, resolved)."""
        keys = [f.dedup_key for f in findings]
        async with self.pool.acquire() as conn, conn.transaction():
            raised = await self.raise_findings(conn, findings, now)
            status = await conn.execute(
                "UPDATE telemetry_alerts SET resolved_at = $3, resolve_reason = $4 "
                "WHERE kind = $1 AND resolved_at IS NULL AND NOT (dedup_key = ANY($2::text[]))",
                kind, keys, now, reason)
        return raised, int(status.split()[-1])

    async def resolve(self, dedup_keys: Sequence[str], now: datetime, reason: str) -> int:
        status = await self.pool.execute(
            "UPDATE telemetry_alerts SET resolved_at = $2, resolve_reason = $3 "
            "WHERE dedup_key = ANY($1::text[]) AND resolved_at IS NULL",
            list(dedup_keys), now, reason,
        )
        return int(status.split()[-1])

    async def publish_pending(
        self, publish: Callable[[AlertRow], Awaitable[None]], *, limit: int = 200
    ) -> int:
        """Hand unpublished raises/resolutions to ``publish`` (which must return only once the broker confirmed),
        marking each as published; rows locked by another instance are skipped. Returns how many were handed."""
        done = 0
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                SELECT * FROM telemetry_alerts
                WHERE raised_published_at IS NULL OR (resolved_at IS NOT NULL AND resolved_published_at IS NULL)
                ORDER BY raised_at LIMIT $1 FOR UPDATE SKIP LOCKED
                """,
                limit,
            )
            for r in rows:
                alert = _alert_row(r)
                await publish(alert)
                await conn.execute(
                    "UPDATE telemetry_alerts SET raised_published_at = coalesce(raised_published_at, now()), "
                    "resolved_published_at = CASE WHEN resolved_at IS NOT NULL THEN now() END WHERE alert_id = $1",
                    alert.alert_id,
                )
                done += 1
        return done

    async def alerts(self, *, job_id: uuid.UUID | None = None, open_only: bool = False) -> list[AlertRow]:
        clauses, args = [], []
        if job_id is not None:
            args.append(job_id)
            clauses.append(f"job_id = ${len(args)}")
        if open_only:
            clauses.append("resolved_at IS NULL")
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = await self.pool.fetch(f"SELECT * FROM telemetry_alerts {where} ORDER BY raised_at", *args)
        return [_alert_row(r) for r in rows]



def _alert_row(r: asyncpg.Record) -> AlertRow:
    evidence = r["evidence"]
    if isinstance(evidence, str):
        evidence = json.loads(evidence)
    return AlertRow(
        alert_id=r["alert_id"], category=r["category"], kind=r["kind"], severity=r["severity"], job_id=r["job_id"],
        node_id=r["node_id"], gpu_uuid=r["gpu_uuid"], tenant=r["tenant"], explanation=r["explanation"],
        evidence={k: float(v) for k, v in evidence.items()}, advice=r["advice"], raised_at=r["raised_at"],
        resolved_at=r["resolved_at"], resolve_reason=r["resolve_reason"],
        raise_pending=r["raised_published_at"] is None,
        resolve_pending=r["resolved_at"] is not None and r["resolved_published_at"] is None,
    )
