"""Telemetry's message handlers and periodic duties: message -> store effects -> published alerts.

One registry (``TelemetryHandlers.handlers``, dispatched by ``gpuorch_messaging.dispatch``) maps each consumed
message type to its handler:

    gpu.usage_sampled        -> SampleBatcher -> _ingest: store.ingest (the batch's transaction: fresh messages)
                                -> domain.ingest.analyse (attribution, health findings) -> IngestBatch.write
    gpu.health_changed       -> raise / resolve ``gpu_unhealthy``
    job.accepted             -> job facts (tenant, tier, requested CPU, model hints)
    job.placed               -> allocated devices, evaluation scheduled
    job.started              -> the executor's pid / container map
    job.finished/failed/lost/cancelled -> job ended: devices released, its alerts resolved
    job.requeued             -> devices released
    mig.plan_proposed        -> the scheduler's MIG plan as ``mig_layout`` recommendations (domain.mig_advice)

Periodic duties (``evaluate_due_jobs``, ``publish_pending``, ``maintain``) run in every instance; the store hands
each piece of work to one instance at a time.

Delivery: a handler returns only when its effect is committed, so the broker acks after commit; every effect is
idempotent (redelivered samples are skipped by ``message_id``; job events are upserts; alerts dedupe by key), so
at-least-once delivery and competing consumers are safe. Alerts are published after commit from the alerts table
(its own outbox) with a ``message_id`` derived from the alert id, so a re-publish is recognisable downstream.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gpuorch_contracts import (
    AlertRaised,
    AlertResolved,
    GpuHealthChanged,
    GpuUsageSampled,
    JobAccepted,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobLost,
    JobPlaced,
    JobRequeued,
    JobStarted,
    Message,
    MigPlanProposed,
    RecommendationMade,
    utc_now,
)
from gpuorch_messaging import Publisher, dispatch
from gpuorch_observability import get_logger, inject_trace, record_job_span, tracing_exported

from gpuorch_telemetry import metrics
from gpuorch_telemetry.domain.detection import (
    GPU_UNHEALTHY,
    DetectionConfig,
    Evaluation,
    Finding,
    Neighbour,
    evaluate_job,
    gpu_dedup_key,
    health_event_finding,
)
from gpuorch_telemetry.domain.ingest import analyse
from gpuorch_telemetry.domain.mig_advice import MIG_LAYOUT, plan_findings
from gpuorch_telemetry.store import AlertRow, IngestOutcome, TelemetryStore

log = get_logger(__name__)

ALERT_MESSAGE_NAMESPACE = uuid.UUID("6d1b7a0e-3f5c-4b8e-9a51-7c2f0e4d9b10")
Clock = Callable[[], datetime]


def alert_message(row: AlertRow, *, producer: str) -> Message:
    """The event for an alert row's next unpublished step (raise, or resolution), with a stable message id."""
    if not row.raise_pending and row.resolve_pending:
        return AlertResolved(
            message_id=uuid.uuid5(ALERT_MESSAGE_NAMESPACE, f"{row.alert_id}:resolved"), producer=producer,
            occurred_at=row.resolved_at or utc_now(), alert_id=row.alert_id, kind=row.kind, job_id=row.job_id,
            node_id=row.node_id, gpu_uuid=row.gpu_uuid, tenant=row.tenant, reason=row.resolve_reason or "resolved",
        )
    common = dict(
        message_id=uuid.uuid5(ALERT_MESSAGE_NAMESPACE, f"{row.alert_id}:raised"), producer=producer,
        occurred_at=row.raised_at, kind=row.kind, severity=row.severity, job_id=row.job_id, node_id=row.node_id,
        gpu_uuid=row.gpu_uuid, tenant=row.tenant, explanation=row.explanation[:1024], evidence=row.evidence,
        advice=row.advice[:1024] if row.advice else None,
    )
    if row.category == "recommendation":
        return RecommendationMade(recommendation_id=row.alert_id, **common)  # type: ignore[arg-type]
    return AlertRaised(alert_id=row.alert_id, **common)  # type: ignore[arg-type]


class SampleBatcher:
    """Gathers concurrently delivered samples into few, large ingest transactions.

    ``submit`` returns when the message's batch committed (or raises if it could not be stored). Up to
    ``max_concurrent_flushes`` flushers run; each takes up to ``max_batch`` pending messages at the moment it is
    free, so batches grow by themselves under load. With no flusher running, a flush starts when ``max_batch``
    messages wait or ``max_delay_s`` after the first one. If a batch fails, its messages are retried one by one so
    that one bad message fails alone (and is dead-lettered alone).
    """

    def __init__(
        self, flush: Callable[[list[GpuUsageSampled]], Awaitable[IngestOutcome]], *, max_batch: int = 256,
        max_delay_s: float = 0.05, max_concurrent_flushes: int = 2,
    ) -> None:
        self._flush = flush
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.max_concurrent_flushes = max_concurrent_flushes
        self._pending: list[tuple[GpuUsageSampled, asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushers: set[asyncio.Task[None]] = set()

    async def submit(self, message: GpuUsageSampled) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((message, future))
        if len(self._pending) >= self.max_batch:
            self._start_flusher()
        elif not self._flushers and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_delay_s, self._start_flusher)
        await future

    def _start_flusher(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending and len(self._flushers) < self.max_concurrent_flushes:
            task = asyncio.get_running_loop().create_task(self._flush_while_pending())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)

    async def _flush_while_pending(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                await self._run(batch)
        finally:
            # Leave the set in the same step as the last emptiness check: a later submit then starts a timer.
            self._flushers.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _run(self, batch: list[tuple[GpuUsageSampled, asyncio.Future[None]]]) -> None:
        try:
            await self._flush([m for m, _ in batch])
        except Exception as exc:  # noqa: BLE001 - isolate the failing message(s) below
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            log.warning("telemetry.batch_failed_retrying_singly", size=len(batch), error=repr(exc))
            for message, future in batch:
                try:
                    await self._flush([message])
                except Exception as single_exc:  # noqa: BLE001 - reported to the message's handler
                    _settle(future, single_exc)
                else:
                    _settle(future, None)
            return
        for _, future in batch:
            _settle(future, None)

    async def drain(self) -> None:
        """Flush what is pending and wait for every flush in flight."""
        self._start_flusher()
        while self._flushers:
            await asyncio.gather(*list(self._flushers), return_exceptions=True)
            self._start_flusher()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


@dataclass
class TelemetryHandlers:
    store: TelemetryStore
    publisher: Publisher
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    producer: str = "telemetry"
    evaluation_interval_s: float = 60.0
    evaluation_batch: int = 200
    clock: Clock = utc_now
    max_batch: int = 256
    max_delay_s: float = 0.05
    batcher: SampleBatcher = field(init=False)
    job_traces: dict[uuid.UUID, str] = field(default_factory=dict)
    """Job -> the trace context its placement arrived with (memory only, while spans are exported): detections
    about the job are spans in its trace. A restarted telemetry learns it again from the job's next event."""

    def __post_init__(self) -> None:
        self.batcher = SampleBatcher(self._ingest, max_batch=self.max_batch, max_delay_s=self.max_delay_s)
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            GpuUsageSampled.TYPE: self.batcher.submit,
            GpuHealthChanged.TYPE: self.on_health_changed,
            JobAccepted.TYPE: self.store.record_job_accepted,
            JobPlaced.TYPE: self.on_job_placed,
            JobStarted.TYPE: self.on_job_started,
            JobFinished.TYPE: self.on_job_finished,
            JobFailed.TYPE: self._ended_as("failed"),
            JobLost.TYPE: self._ended_as("lost"),
            JobCancelled.TYPE: self._ended_as("cancelled"),
            JobRequeued.TYPE: self.on_job_requeued,
            MigPlanProposed.TYPE: self.on_mig_plan,
        }
        """The registry: message type -> handler (``gpuorch_messaging.dispatch``)."""

    async def handle(self, message: Message) -> None:
        """Apply one consumed message through ``handlers``; other types are ignored (acked)."""
        await dispatch(self.handlers, message, service="telemetry")

    async def on_job_placed(self, message: JobPlaced) -> None:
        self._remember_trace(message.job_id)
        await self.store.record_job_placed(message, self._first_evaluation(message.occurred_at))

    async def on_job_started(self, message: JobStarted) -> None:
        self._remember_trace(message.job_id)
        await self.store.record_job_started(message, self._first_evaluation(message.occurred_at))

    def _remember_trace(self, job_id: uuid.UUID) -> None:
        if tracing_exported():
            traceparent = inject_trace({}).get("traceparent")
            if traceparent:
                self.job_traces[job_id] = traceparent

    def _trace_detection(self, job_id: uuid.UUID | None, findings: list[Finding], cleared: set[str]) -> None:
        """A ``telemetry.detect`` span in the job's trace for what an evaluation found about it (none for an
        evaluation that found nothing: a running job is evaluated every interval)."""
        traceparent = self.job_traces.get(job_id) if job_id is not None else None
        if traceparent is None or not findings:
            return
        now = utc_now().timestamp()
        record_job_span("telemetry.detect", job_id, traceparent, now, now, {
            "gpuorch.findings": [f.kind for f in findings], "gpuorch.severities": [f.severity for f in findings],
            "gpuorch.cleared": sorted(cleared),
            "gpuorch.explanation": "; ".join(f.explanation for f in findings)[:2000]},
            tracer_name="gpuorch.telemetry")

    async def on_job_finished(self, message: JobFinished) -> None:
        await self._ended(message.job_id, "succeeded" if message.exit_code == 0 else "failed", message.occurred_at)

    async def on_job_requeued(self, message: JobRequeued) -> None:
        await self.store.record_job_requeued(message.job_id, message.occurred_at)

    def _ended_as(self, state: str) -> Callable[[JobFailed | JobLost | JobCancelled], Awaitable[None]]:
        async def ended(message: JobFailed | JobLost | JobCancelled) -> None:
            await self._ended(message.job_id, state, message.occurred_at)
        return ended

    def _first_evaluation(self, at: datetime) -> datetime:
        """Once a window's worth of samples can exist, plus up to 10 % of the interval so that jobs placed
        together are not all evaluated in the same tick."""
        return at + timedelta(seconds=self.detection.window_s * self.detection.min_coverage
                              + random.uniform(0, 0.1 * self.evaluation_interval_s))

    async def _ingest(self, batch: list[GpuUsageSampled]) -> IngestOutcome:
        async with self.store.ingest(batch, self.clock()) as transaction:  # one transaction per batch
            if transaction.fresh:
                allocations = await transaction.active_allocations()
                await transaction.write(analyse(transaction.fresh, allocations))
        outcome = transaction.outcome
        metrics.record_ingest(outcome, utc_now())
        if outcome.new_alerts:
            await self._publish_after_commit()
        return outcome

    async def _ended(self, job_id: uuid.UUID, state: str, at: datetime) -> None:
        self.job_traces.pop(job_id, None)
        resolved = await self.store.record_job_ended(job_id, state, at, f"job {state}")
        if resolved:
            await self._publish_after_commit()

    async def on_mig_plan(self, message: MigPlanProposed) -> None:
        """The scheduler's MIG plan: its proposals become the open ``mig_layout`` recommendations (those no longer
        proposed are resolved)."""
        raised, resolved = await self.store.replace_open(MIG_LAYOUT, plan_findings(message), self.clock(),
                                                         "no longer in the MIG plan")
        if raised or resolved:
            await self._publish_after_commit()

    async def on_health_changed(self, message: GpuHealthChanged) -> None:
        now = self.clock()
        owner = await self.store.job_on_gpu(message.node_id, message.gpu_uuid, message.gpu_index)
        finding = health_event_finding(
            message.node_id, message.gpu_uuid, message.health, message.reason, message.xid, message.action,
            owner[0] if owner else None, owner[1] if owner else None,
        )
        if finding is None:
            await self.store.resolve(
                [gpu_dedup_key(GPU_UNHEALTHY, message.node_id, message.gpu_uuid)], now, "GPU healthy again"
            )
        else:
            await self.store.raise_finding(finding, now)
            self._trace_detection(finding.job_id, [finding], set())
        await self._publish_after_commit()

    async def evaluate_due_jobs(self) -> tuple[int, int, int]:
        """Evaluate the jobs due now (claimed for this instance); returns (jobs, raised, resolved)."""
        now = self.clock()
        jobs = await self.store.claim_due_jobs(now, self.evaluation_interval_s, self.evaluation_batch)
        if not jobs:
            return 0, 0, 0
        windows = await self.store.device_windows(
            [j.job_id for j in jobs], now, self.detection.window_s, self.detection.pressure_memory_ratio
        )
        neighbours = await self.store.share_neighbours([j.job_id for j in jobs], now)
        windows.update(await self.store.device_windows(
            [n.job_id for n in neighbours if n.job_id not in windows], now, self.detection.window_s,
            self.detection.pressure_memory_ratio))
        beside = [Neighbour(n, w) for n in [*jobs, *neighbours] for w in windows.get(n.job_id, [])]
        evaluations: list[tuple[uuid.UUID, Evaluation]] = [
            (job.job_id, evaluate_job(job, windows.get(job.job_id, []), self.detection,
                                      [b for b in beside if b.job.job_id != job.job_id]))
            for job in jobs
        ]
        raised, resolved = await self.store.apply_evaluations(evaluations, now)
        if self.job_traces:
            for job_id, evaluation in evaluations:
                self._trace_detection(job_id, evaluation.findings, evaluation.cleared)
        metrics.JOBS_EVALUATED.inc(len(jobs))
        if raised or resolved:
            await self._publish_after_commit()
        return len(jobs), raised, resolved

    async def evaluate_until_idle(self) -> int:
        """Evaluate batch after batch until no job is due (so a large fleet never falls behind its interval)."""
        total = 0
        while True:
            jobs, _, _ = await self.evaluate_due_jobs()
            total += jobs
            if jobs < self.evaluation_batch:
                return total

    async def _publish_after_commit(self) -> None:
        """Publish now what was just committed; a failure (broker down, no queue bound to ``alert.*``) must not
        fail the message that caused it: the rows stay unpublished and the periodic ``publish_pending`` retries."""
        try:
            await self.publish_pending()
        except Exception as exc:  # noqa: BLE001 - retried by the periodic duty
            log.warning("telemetry.publish_deferred", error=repr(exc))

    async def publish_pending(self) -> int:
        """Publish committed but unpublished alert steps (raise, then resolution) with broker confirms."""
        total = 0
        while True:
            async def publish(row: AlertRow) -> None:
                message = alert_message(row, producer=self.producer)
                await self.publisher.publish(message)
                metrics.ALERTS_PUBLISHED.labels(message.TYPE, row.kind).inc()
                if row.raise_pending and row.resolve_pending:
                    await self.publisher.publish(
                        alert_message(_resolution_only(row), producer=self.producer)
                    )

            done = await self.store.publish_pending(publish)
            total += done
            if done == 0:
                return total

    async def maintain(self) -> dict[str, int]:
        """Create partitions ahead, roll up closed buckets, apply retention (one instance at a time)."""
        now = self.clock()
        today = now.date()
        await self.store.ensure_partitions(today - timedelta(days=1), today + timedelta(days=2))
        rolled = await self.store.roll_up(now)
        dropped = await self.store.apply_retention(now)
        return {"buckets_rolled": rolled, **dropped}


def _resolution_only(row: AlertRow) -> AlertRow:
    from dataclasses import replace

    return replace(row, raise_pending=False)
