"""gpuorch-scheduler: broker adapter and process lifecycle.

Pipeline::

    gpuorch.submit  job.submit.<tenant>      ─> lane "scheduler.submit.<tenant>" (per known tenant) ─┐
                    anything else ─> gpuorch.submit.shared ─> lane "scheduler.submit" ───────────────┤
    gpuorch.events  (job.started/finished/failed/lost/checkpointed,                                    │
                     node.registered, gpu.health_changed,
                     node.mig_layout_applied) ─> queue "scheduler" ──────────────────────────────────┤
                                                       │ batcher.Batcher: lanes in turn, at most GPUORCH_BATCH_MAX <┘
                                                       │ messages and GPUORCH_BATCH_BUDGET_MS of work; ticks
                                                       ▼ join it. handlers.SchedulerService.handle_batch
                                                  one PostgreSQL transaction per batch: log + outbox + read models,
                                                  then every message of the batch is acked (or answered alone)
    gpuorch.events  (node.heartbeat) ──> "scheduler.heartbeats" (latest-wins) ──> lease renewals (memory)
                                                   │
    outbox relay (its own process: relay.py) ──(confirms)──> gpuorch.events (job.accepted/placed/...) and
                                                         gpuorch.commands (LaunchJob, StopJob, ApplyMigLayout)

Leadership: a standby blocks on a PostgreSQL session advisory lock; the leader holds it on the connection that
does every write, so a leader that lost its database session can no longer write. The leader is the only consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from gpuorch_contracts import (
    ExecutorHeartbeat,
    Message,
    NodeHeartbeat,
)
from gpuorch_contracts.jobs import DEFAULT_TENANT
from gpuorch_identity import IdentityMap
from gpuorch_messaging import Broker, QueueSpec, answer_invalid_submission, queues
from gpuorch_observability import (
    READINESS,
    configure,
    connected,
    get_logger,
    keep_probing,
    start_metrics_server,
)
from gpuorch_settings import load_or_exit
from gpuorch_store import OutboxRelay, ensure_database, migrate, outbox_backlog, save_snapshot

from gpuorch_scheduler import metrics as scheduler_metrics
from gpuorch_scheduler.batcher import Batcher
from gpuorch_scheduler.handlers import STREAM, Persistence, SchedulerService
from gpuorch_scheduler.journal import JournalFile
from gpuorch_scheduler.relay import relay_process
from gpuorch_scheduler.settings import Settings

log = get_logger(__name__)

LEADER_LOCK_KEY = 0x67707552_5343_4844
SCHEDULER_QUEUE, SUBMIT_QUEUE, HEARTBEAT_QUEUE = queues.SCHEDULER_QUEUE, queues.SUBMIT_QUEUE, queues.HEARTBEAT_QUEUE
DELIVERY_LIMIT = queues.SCHEDULER_DELIVERY_LIMIT

def parse_settings(argv: list[str] | None = None) -> Settings:
    """The settings (``gpuorch_scheduler.settings``) from the environment and ``--config``; exits 2 naming each
    invalid variable."""
    settings, _ = load_or_exit(Settings, argv, prog="gpuorch-scheduler",
                               description="The gpuorch scheduler: queues, placement, node liveness.")
    return settings


def scheduler_queues(identity_map: IdentityMap | None = None) -> tuple[QueueSpec, QueueSpec]:
    """The scheduler's event and heartbeat queues (``gpuorch_messaging.queues``), each taking only its message
    types from the publishers allowed to send them. Submissions arrive on ``submission_lanes``."""
    return queues.scheduler_queues()


def submission_lanes(tenants: list[str], identity_map: IdentityMap | None = None) -> list[QueueSpec]:
    """The shared lane and one lane per tenant (``gpuorch_messaging.queues.submission_lanes``), consumed each on
    its own channel and taken in turn (``Batcher``), so a tenant's backlog waits behind nothing but its own. With
    an identity map, an identifiable invalid submission is answered with a ``job.rejected`` routed to its
    publisher's default tenant."""
    on_invalid = answer_invalid_submission(identity_map.default_tenant) if identity_map is not None else None
    return queues.submission_lanes(tenants, on_invalid)


def lane_tenants(settings: Settings) -> list[str]:
    """The tenants with a submission lane of their own: every tenant the identity map names, and every tenant
    with a quota."""
    return sorted((set(settings.identity_map.named_tenants) | set(settings.queues.quotas)) - {"*", DEFAULT_TENANT})


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Readiness (``/readyz``): the database answers and, once leader, the broker is connected and every queue is
    consumed; a standby waiting for leadership is ready (it can take over)."""
    READINESS.mark("consuming", "starting: migrating the database")
    await ensure_database(settings.database_url)
    await migrate(settings.database_url)
    conn = await asyncpg.connect(settings.database_url)
    probes = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=1)
    probing = asyncio.create_task(keep_probing("database", lambda: probes.fetchval("SELECT 1"),
                                               failing="PostgreSQL unreachable"))
    try:
        READINESS.mark("consuming", None)
        log.info("scheduler.waiting_for_leadership", instance=settings.instance)
        while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK_KEY):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            if stop.is_set():
                return
        log.info("scheduler.leader", instance=settings.instance)
        READINESS.mark("consuming", "leader: recovering its state")
        service = SchedulerService(
            conn, settings.scheduler_config,
            persistence=Persistence(snapshot_every_events=settings.snapshot_every_events,
                                    snapshot_every_s=settings.snapshot_every_s, freeze_after_recovery=True),
            snapshot_writer=snapshots_aside(settings.database_url),
            journal=JournalFile(Path(settings.step_journal)) if settings.step_journal else None)
        await service.recover()
        broker = Broker(settings.amqp_url, producer=f"scheduler/{settings.instance}",
                        node_scopes=settings.identity_map.node_scopes, **settings.broker_options())
        await broker.connect()
        READINESS.add("broker", connected(broker))
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
        relay = OutboxRelay(pool, broker, poll_interval=0.5, batch_size=1000, pipeline=True,
                            on_parked=service.on_outbox_parked)
        if settings.relay_process:
            relay_task = asyncio.create_task(_relay_elsewhere(settings, relay), name="outbox-relay-process")
        else:
            relay_task = asyncio.create_task(relay.run_forever(), name="outbox-relay")
        gauges = asyncio.create_task(_export_outbox(pool), name="outbox-gauges")
        main_queue, heartbeat_queue = scheduler_queues(settings.identity_map)

        async def on_heartbeat(message: Message) -> None:
            if isinstance(message, NodeHeartbeat):
                await service.heartbeat(message)
            elif isinstance(message, ExecutorHeartbeat):
                await service.executor_heartbeat(message)

        batcher = Batcher(service.handle_batch, settings.batch_max, settings.batch_wait_s, settings.tick_s,
                          settings.batch_budget_s)
        # The lanes first: once "scheduler" and "scheduler.heartbeats" exist (what tests and tools wait for),
        # every submission is routable.
        for lane in submission_lanes(lane_tenants(settings), settings.identity_map):
            await broker.consume(lane, batcher.lane(lane.name), with_sender=True)
        await broker.unbind(SCHEDULER_QUEUE, queues.DROPPED_BINDINGS[SCHEDULER_QUEUE])  # declare mode only
        await broker.consume(main_queue, batcher.lane(main_queue.name, submissions=False), with_sender=True)
        await broker.consume(heartbeat_queue, on_heartbeat)
        READINESS.mark("consuming", None)
        try:
            await batcher.run(stop, watch=relay_task)
        finally:
            relay.stop()
            gauges.cancel()
            await broker.close()
            relay_task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(relay_task, timeout=5)
            await pool.close()
    finally:
        probing.cancel()
        await probes.close()
        await conn.close()


async def _export_outbox(pool: Any, period_s: float = 5.0) -> None:
    """Keep the outbox gauges (``metrics.export_outbox``) current while leader."""
    while True:
        try:
            scheduler_metrics.export_outbox(await outbox_backlog(pool), datetime.now(UTC))
        except Exception as exc:  # noqa: BLE001 - a gauge missed is retried at the next period
            log.warning("scheduler.outbox_gauges_failed", error=repr(exc))
        await asyncio.sleep(period_s)


def snapshots_aside(database_url: str) -> Callable[[int, str], Awaitable[None]]:
    """A snapshot writer with a connection of its own (opened on first use, reopened after an error)."""
    held: list[Any] = []

    async def write(position: int, text: str) -> None:
        if not held or held[0].is_closed():
            held[:] = [await asyncpg.connect(database_url)]
        try:
            await save_snapshot(held[0], STREAM, position, text)
        except Exception:
            with contextlib.suppress(Exception):
                await held.pop().close()
            raise

    return write


async def _relay_elsewhere(settings: Settings, answers: OutboxRelay) -> None:
    """Run the outbox relay in its own process (the machine's other core) and keep it running; meanwhile answer
    the rows it parks from here (requeueing or failing their jobs goes through this scheduler's log). Raises if
    the relay keeps dying."""
    context = multiprocessing.get_context("spawn")
    failures = 0
    process = None
    try:
        while True:
            if process is None or not process.is_alive():
                if process is not None:
                    failures += 1
                    log.error("scheduler.relay_died", exitcode=process.exitcode, restarts=failures)
                    if failures > 5:
                        raise RuntimeError(f"the outbox relay process died {failures} times")
                process = context.Process(
                    target=relay_process, name="gpuorch-outbox-relay", daemon=True,
                    args=(settings.amqp_url, settings.database_url, f"scheduler/{settings.instance}/relay",
                          dict(settings.identity_map.node_scopes), os.getpid(), settings.log_level,
                          settings.broker_options()))
                process.start()
            await answers.report_parked()
            await asyncio.sleep(1.0)
    finally:
        if process is not None and process.is_alive():
            process.terminate()
            await asyncio.to_thread(process.join, 5)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv if argv is not None else sys.argv[1:])
    # Each batch allocates many short-lived objects beside a large long-lived state: collect the young generation
    # less often (the state itself is frozen out of collections after recovery).
    gc.set_threshold(50_000, 20, 100)
    configure("scheduler", log_level=settings.log_level, otlp_endpoint=settings.otlp_endpoint,
              instance=settings.instance)
    start_metrics_server(settings.metrics_port)

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop)

    asyncio.run(_main())


if __name__ == "__main__":
    main()
