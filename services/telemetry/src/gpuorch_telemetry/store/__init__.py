"""PostgreSQL adapter of telemetry (asyncpg): sample ingest, the job map, alerts, evaluation claims, rollups.

Contracts:
- ``ingest`` (``samples``) applies a batch of ``GpuUsageSampled`` in ONE transaction; a message already applied (its
  ``message_id`` is in ``telemetry_ingested_messages``) is skipped whole, so redelivery and competing consumers
  never double-count. Rows go in with COPY (no per-row round trips).
- Job events are upserts that tolerate any arrival order (``placed`` before ``accepted``, ``finished`` before
  ``started``): a job that ended stays ended.
- Alerts: at most one open row per ``dedup_key`` (a partial unique index); raising an open alert again is a no-op.
  The table is its own outbox: rows are published after commit and marked when the broker confirmed.
- ``claim_due_jobs`` hands each due job to one instance (``FOR UPDATE SKIP LOCKED``) and pushes its next evaluation
  forward in the same statement, so instances share the work without coordination.
- ``roll_up`` and ``apply_retention`` run under a transaction advisory lock: one instance at a time does them.

Parts (one module each, composed into ``TelemetryStore``): ``base`` (pool, partitions, row types), ``samples``
(the ingest transaction), ``jobs`` (the job map), ``alerts`` (the alert outbox), ``evaluations``, ``rollups``
(rollups and retention), ``metrics_text`` (the queries behind the fleet gauges). Decisions about what samples
mean (attribution, health findings) are in ``domain``, not here.
"""

from __future__ import annotations

from gpuorch_telemetry.store.base import AlertRow, IngestOutcome, RetentionPolicy
from gpuorch_telemetry.store.evaluations import EvaluationStore
from gpuorch_telemetry.store.jobs import JobMap
from gpuorch_telemetry.store.metrics_text import MetricsQueries
from gpuorch_telemetry.store.rollups import RollupStore
from gpuorch_telemetry.store.samples import IngestBatch, SampleStore


class TelemetryStore(SampleStore, JobMap, EvaluationStore, RollupStore, MetricsQueries):
    """PostgreSQL adapter of telemetry (asyncpg); see the module doc for its contracts."""


__all__ = ["AlertRow", "IngestBatch", "IngestOutcome", "RetentionPolicy", "TelemetryStore"]
