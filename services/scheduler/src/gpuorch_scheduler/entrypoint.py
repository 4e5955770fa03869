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
    gpuorch.events  (node.heartbeat) ──> "scheduler.heartbeats" (latest-wins; a paced connection of its own,
                                          handled inline as read) ──> lease renewals (memory)
                                                   │
    outbox relay (its own process: relay.py) ──(confirms)──> gpuorch.events (job.accepted/placed/...) and
                                                         gpuorch.commands (LaunchJob, StopJob, ApplyMigLayout)

Leadership (``leadership``): a lease in PostgreSQL with an expiry the leader renews every GPUORCH_LEADER_RENEW_S;
a standby takes it over, with the next epoch, once it expired (GPUORCH_LEADER_LEASE_S), ending the old leader's
sessions. Every batch's transaction checks the epoch (a superseded leader commits nothing) and every command
carries it (executors refuse older epochs). The leader is the only consumer; its broker connection's AMQP
heartbeat is a quarter of the lease, so a paused leader also loses its consumers within about a lease. Losing the lease, the
database or the broker makes the leader step down to standby, never exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
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
from gpuorch_messaging.bounded_gauges import keep_bounded_queue_gauges
from gpuorch_messaging.topology import DEAD_LETTER_MAX_LENGTH, UNROUTED, UNROUTED_MAX_LENGTH
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
from gpuorch_scheduler.leadership import CONNECTION_LOST, LeaderLease, LeadershipLost
from gpuorch_scheduler.relay import GC_THRESHOLD, relay_process
from gpuorch_scheduler.settings import Settings

log = get_logger(__name__)

SCHEDULER_QUEUE, SUBMIT_QUEUE, HEARTBEAT_QUEUE = queues.SCHEDULER_QUEUE, queues.SUBMIT_QUEUE, queues.HEARTBEAT_QUEUE
TELEMETRY_QUEUE = queues.TELEMETRY_QUEUE
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
    """Stand by, lead while the lease is this instance's, step down, stand by again: until ``stop``. A lost
    database or broker, or a lease taken over, never ends the process: the leader steps down (stops consuming and
    publishing, ends its lease) and waits as a standby, after a backoff that doubles up to 30 s while leading keeps
    failing. Readiness (``/readyz``): the database answers and, once leader, the broker is connected and every
    queue is consumed; a standby waiting for leadership is ready (it can take over)."""
    READINESS.mark("consuming", "starting: migrating the database")
    await _prepare_database(settings.database_url, stop)
    probes = await asyncpg.create_pool(settings.database_url, min_size=0, max_size=1)
    probing = asyncio.create_task(keep_probing("database", lambda: probes.fetchval("SELECT 1"),
                                               failing="PostgreSQL unreachable"))
    lease = LeaderLease(settings.database_url, f"{settings.instance} pid {os.getpid()}",
                        lease_s=settings.leader_lease_s, renew_s=settings.leader_renew_s)
    backoff = settings.leader_renew_s
    try:
        while not stop.is_set():
            READINESS.mark("consuming", None)
            log.info("scheduler.waiting_for_leadership", instance=settings.instance)
            if not await lease.acquire(stop):
                break
            try:
                await lead(settings, stop, lease)
                backoff = settings.leader_renew_s
            except Exception as exc:  # noqa: BLE001 - whatever ended leading, the process stays and stands by
                level = log.warning if isinstance(exc, (LeadershipLost, *CONNECTION_LOST)) else log.error
                level("scheduler.stepped_down", instance=settings.instance, epoch=lease.epoch, error=repr(exc),
                      standby_in_s=backoff)
                READINESS.mark("consuming", f"stepped down, standby in {backoff:.0f} s: {exc!r}"[:300])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                backoff = min(backoff * 2, 30.0)
            finally:
                await lease.release()
    finally:
        probing.cancel()
        await probes.close()
        await lease.close()


async def _prepare_database(database_url: str, stop: asyncio.Event) -> None:
    """Create and migrate the database, retrying with a backoff while PostgreSQL cannot be reached."""
    backoff = 0.5
    while not stop.is_set():
        try:
            await ensure_database(database_url)
            await migrate(database_url)
            return
        except CONNECTION_LOST as exc:
            log.warning("scheduler.database_unreachable", error=repr(exc), retry_s=backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff)
            backoff = min(backoff * 2, 10.0)


async def lead(settings: Settings, stop: asyncio.Event, lease: LeaderLease) -> None:
    """Lead for the epoch ``lease`` holds: recover, consume, decide, publish (every commit fenced by the lease,
    every command stamped with its epoch). Returns once ``stop`` is set; raises ``LeadershipLost`` once the lease
    is lost, or what the database or the broker raised. Every session it opens is named for its epoch, so the next
    leader can end them (``leadership``)."""
    log.info("scheduler.leader", instance=settings.instance, epoch=lease.epoch)
    READINESS.mark("consuming", "leader: recovering its state")
    keeper = asyncio.create_task(lease.keep(), name="leader-lease")
    leading = asyncio.Event()
    watcher = asyncio.create_task(_until_either(stop, keeper, leading), name="leader-watch")
    conn: Any = None
    broker: Broker | None = None
    pool: Any = None
    relay: OutboxRelay | None = None
    tasks: list[asyncio.Task[Any]] = [keeper, watcher]
    try:
        conn = await asyncpg.connect(settings.database_url, server_settings=lease.session_settings())
        service = SchedulerService(
            conn, settings.scheduler_config,
            persistence=Persistence(snapshot_every_events=settings.snapshot_every_events,
                                    snapshot_every_s=settings.snapshot_every_s, freeze_after_recovery=True),
            snapshot_writer=snapshots_aside(settings.database_url, lease.session_settings()),
            journal=JournalFile(Path(settings.step_journal)) if settings.step_journal else None,
            fenced=True, leader_epoch=lease.epoch)
        await service.recover()
        # The AMQP heartbeat at a quarter of the lease (the broker closes a connection silent for about two of
        # them): paused, this leader loses its single-active-consumer place (its unacked deliveries go back)
        # within about a lease, as it loses the lease itself.
        broker = Broker(settings.amqp_url, producer=f"scheduler/{settings.instance}",
                        node_scopes=settings.identity_map.node_scopes,
                        heartbeat_s=math.ceil(settings.leader_lease_s / 4), **settings.broker_options())
        await broker.connect()
        READINESS.add("broker", connected(broker))
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2,
                                         server_settings=lease.session_settings())
        relay = OutboxRelay(pool, broker, poll_interval=0.5, batch_size=1000, pipeline=True,
                            on_parked=service.on_outbox_parked)
        if settings.relay_process:
            relay_task = asyncio.create_task(_relay_elsewhere(settings, relay, lease.application_name),
                                             name="outbox-relay-process")
        else:
            relay_task = asyncio.create_task(relay.run_forever(), name="outbox-relay")
        main_queue, heartbeat_queue = scheduler_queues(settings.identity_map)
        lanes = submission_lanes(lane_tenants(settings), settings.identity_map)
        own = [main_queue, heartbeat_queue, *lanes]
        tasks += [relay_task, asyncio.create_task(_export_outbox(pool), name="outbox-gauges"),
                  asyncio.create_task(_export_bounded_queues(broker, own), name="bounded-queue-gauges")]

        def on_heartbeat(message: Message) -> None:  # plain: run inline as each beat is read (no task)
            if isinstance(message, NodeHeartbeat):
                service.heartbeat(message)
            elif isinstance(message, ExecutorHeartbeat):
                service.executor_heartbeat(message)

        batcher = Batcher(service.handle_batch, settings.batch_max, settings.batch_wait_s, settings.tick_s,
                          settings.batch_budget_s)
        # The lanes first: once "scheduler" and "scheduler.heartbeats" exist (what tests and tools wait for),
        # every submission is routable.
        for lane in lanes:
            await broker.consume(lane, batcher.lane(lane.name), with_sender=True)
        await broker.unbind(SCHEDULER_QUEUE, queues.DROPPED_BINDINGS[SCHEDULER_QUEUE])  # declare mode only
        await broker.consume(main_queue, batcher.lane(main_queue.name, submissions=False), with_sender=True)
        await broker.consume(heartbeat_queue, on_heartbeat)
        READINESS.mark("consuming", None)
        await batcher.run(leading, watch=relay_task)
        if keeper.done():
            keeper.result()  # raises LeadershipLost
    finally:
        leading.set()
        if relay is not None:
            relay.stop()
        for task in tasks:
            task.cancel()
        if broker is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(broker.close(), timeout=5)
        READINESS.add("broker", lambda: None)  # a standby needs no broker
        for task in tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=5)
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), timeout=5)
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=5)


async def _until_either(stop: asyncio.Event, keeper: asyncio.Task[None], leading: asyncio.Event) -> None:
    """Set ``leading`` (the batcher's stop) once ``stop`` is set or the lease keeper ended (leadership lost)."""
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([stopping, keeper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        leading.set()


async def _export_outbox(pool: Any, period_s: float = 5.0) -> None:
    """Keep the outbox gauges (``metrics.export_outbox``) current while leader."""
    while True:
        try:
            scheduler_metrics.export_outbox(await outbox_backlog(pool), datetime.now(UTC))
        except Exception as exc:  # noqa: BLE001 - a gauge missed is retried at the next period
            log.warning("scheduler.outbox_gauges_failed", error=repr(exc))
        await asyncio.sleep(period_s)


async def _export_bounded_queues(broker: Broker, own: list[QueueSpec], period_s: float = 15.0) -> None:
    """Keep the bounded-queue gauges (``gpuorch_messaging.bounded_gauges``) current while leader: ``gpuorch.unrouted``
    and the dead-letter queues of the scheduler's queues and telemetry's (a few passive declares; each node's
    dead-letter queue is exported by its executor and node-agent)."""
    bounds = {UNROUTED: UNROUTED_MAX_LENGTH, f"{TELEMETRY_QUEUE}.dlq": DEAD_LETTER_MAX_LENGTH}
    bounds.update({spec.dead_letter_queue: spec.dead_letter_max_length for spec in own if spec.dead_letter})
    await keep_bounded_queue_gauges(broker, bounds, period_s=period_s)


def snapshots_aside(database_url: str, server_settings: dict[str, str] | None = None
                    ) -> Callable[[int, str], Awaitable[None]]:
    """A snapshot writer with a connection of its own (opened on first use, reopened after an error)."""
    held: list[Any] = []

    async def write(position: int, text: str) -> None:
        if not held or held[0].is_closed():
            held[:] = [await asyncpg.connect(database_url, server_settings=server_settings)]
        try:
            await save_snapshot(held[0], STREAM, position, text)
        except Exception:
            with contextlib.suppress(Exception):
                await held.pop().close()
            raise

    return write


async def _relay_elsewhere(settings: Settings, answers: OutboxRelay, application_name: str) -> None:
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
                          settings.broker_options(), application_name))
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
    gc.set_threshold(*GC_THRESHOLD)
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
