"""gpuorch-scheduler: broker adapter and process lifecycle.

Pipeline::

    gpuorch.submit  job.submit.<tenant>      ─> lane "scheduler.submit.<tenant>" (per known tenant) ─┐
                    anything else ─> gpuorch.submit.shared ─> lane "scheduler.submit" ───────────────┤
    gpuorch.events  (job.started/finished/failed/lost/checkpointed,                                    │
                     node.registered, gpu.health_changed,
                     node.mig_layout_applied) ─> queue "scheduler" ──────────────────────────────────┤
                                                       │ Batcher: lanes in turn, at most GPUORCH_BATCH_MAX <┘
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
import collections
import contextlib
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
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
    inject_trace,
    keep_probing,
    start_metrics_server,
)
from gpuorch_settings import load_or_exit
from gpuorch_store import OutboxRelay, ensure_database, migrate, outbox_backlog, save_snapshot

from gpuorch_scheduler import metrics as scheduler_metrics
from gpuorch_scheduler.domain.decide import LivenessPolicy
from gpuorch_scheduler.handlers import STREAM, SchedulerConfig, SchedulerService
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
        service = SchedulerService(conn, SchedulerConfig(
            liveness=LivenessPolicy(suspect_after_s=settings.suspect_after_s, lost_after_s=settings.lost_after_s),
            queues=settings.queues, preemption_margin_s=settings.preemption_margin_s,
            snapshot_every_events=settings.snapshot_every_events, snapshot_every_s=settings.snapshot_every_s,
            retention_s=settings.retention_s, freeze_after_recovery=True, identity=settings.identity_map,
            trust_unidentified=settings.trust_all, mig=settings.mig_control), snapshot_writer=snapshots_aside(settings.database_url))
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


BatchHandler = Callable[..., Awaitable[list[Exception | None]]]


Waiting = tuple[Message, dict[str, Any], str | None, "asyncio.Future[None]"]
MIN_BATCH = 8
"""The smallest batch a budget shrinks to: below it the per-transaction cost dominates."""
SHARED_WINDOW_S = 300.0
"""Submission lanes that received a message this recently count as active tenants (``Batcher.sharing``): a tenant
that submits now and then (a CI pipeline, a person) stays protected between its submissions. With 30 s, a quiet
tenant's submission right behind a 100,000-job flood waited 1.4 s (the flood took longer than 30 s to publish)."""


class Batcher:
    """Gathers deliveries into batches for one transaction each, and runs the periodic tick between them.

    The broker calls a lane's handler once per delivery (``lane(name)``: one per queue; ``handle`` is the lane
    ``""``), concurrently up to the queue's prefetch; it waits until the batch holding its message is committed
    and returns (the broker then acks), or raises that message's own error (the broker retries it, then
    dead-letters it). A batch takes what has arrived, from every lane in turn (one message from each waiting lane,
    round after round), at most ``max_messages``. Under load (the last batch held a tenth of ``max_messages`` or
    more) it waits up to ``max_wait_s`` after its first message to close at ``max_messages``. A tick due meanwhile
    joins the batch, so ticks and batches never overlap.

    Sharing: while two or more submission lanes (tenants) have submitted within ``shared_window_s`` and one of them
    has little waiting, a batch also ends at about ``budget_s`` of work (at the recent cost per message) and with
    the round that took a lane's last waiting message, so one tenant's backlog delays another's submission by one
    short batch at most. A lone flood (one lane active), or every active lane backlogged, keeps full batches:
    throughput when nobody is left waiting for it; the first submission of a tenant that was quiet for
    ``shared_window_s`` may wait for one full batch in progress.
    """

    def __init__(self, handle_batch: BatchHandler, max_messages: int = 500, max_wait_s: float = 0.02,
                 tick_s: float = 1.0, budget_s: float = 0.0, shared_window_s: float = SHARED_WINDOW_S) -> None:
        self._handle_batch = handle_batch
        self.max_messages, self.max_wait_s, self.tick_s = max(1, max_messages), max_wait_s, tick_s
        self.budget_s, self.shared_window_s = budget_s, shared_window_s
        self.cost_s = 0.0
        """Seconds per message, a moving average over recent batches."""
        self._lanes: dict[str, collections.deque[Waiting]] = {}
        self._last_submission: dict[str, float] = {}
        """Submission lane -> when it last received a message (loop time)."""
        self._waiting = 0
        self.busy_batch = max(2, self.max_messages // 10)
        self._busy = False
        """The last batch was large: under load, wait up to ``max_wait_s`` to gather the next one (fewer, larger
        transactions); otherwise handle what is there at once (low latency)."""
        self._arrived = asyncio.Event()

    def lane(self, name: str, *, submissions: bool = True) -> Callable[[Message, str | None], Awaitable[None]]:
        """The delivery handler of lane ``name`` (a queue); ``submissions``: a tenant's lane (counts for
        sharing), not the events queue."""
        waiting = self._lanes.setdefault(name, collections.deque())

        async def handle(message: Message, user_id: str | None = None) -> None:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            trace = dict(inject_trace({}))  # the delivery's span: decisions about this message join its trace
            waiting.append((message, trace, user_id, done))
            if submissions:
                self._last_submission[name] = loop.time()
            self._waiting += 1
            self._arrived.set()
            await done

        return handle

    async def handle(self, message: Message, user_id: str | None = None) -> None:
        """One delivery on the lane ``""`` (``user_id``: its verified publisher); returns once its batch
        committed."""
        await self.lane("")(message, user_id)

    @property
    def sharing(self) -> bool:
        """Two or more submission lanes received messages within ``shared_window_s``, and one of them has little
        waiting (a tenant whose next submission should not wait behind another's backlog). When every active lane
        is backlogged, each tenant waits mostly for its own backlog: full batches, taken in turn, serve all of them
        sooner."""
        if self.budget_s <= 0 or len(self._last_submission) < 2:
            return False
        since = asyncio.get_running_loop().time() - self.shared_window_s
        active = [name for name, at in self._last_submission.items() if at >= since]
        return len(active) >= 2 and any(len(self._lanes[name]) < MIN_BATCH for name in active)

    @property
    def limit(self) -> int:
        """The size the next batch may reach: ``max_messages``, or while sharing what fits ``budget_s`` at the
        recent cost per message."""
        if not self.sharing or self.cost_s <= 0:
            return self.max_messages
        return min(self.max_messages, max(MIN_BATCH, int(self.budget_s / self.cost_s)))

    def _take(self) -> list[Waiting]:
        """The next batch: up to ``limit``, one from each waiting lane in turn (while sharing: until a lane runs
        empty)."""
        busy = [lane for lane in self._lanes.values() if lane]
        limit, sharing = self.limit, self.sharing
        if len(busy) == 1:
            lane = busy[0]
            batch = [lane.popleft() for _ in range(min(len(lane), limit))]
        else:
            batch = []
            while busy and len(batch) < limit:
                for lane in busy:
                    batch.append(lane.popleft())
                    if len(batch) == limit:
                        break
                if sharing and not all(busy):
                    break  # a lane's last message is in: close the batch so it is decided at once
                busy = [lane for lane in busy if lane]
        self._waiting -= len(batch)
        return batch

    async def run(self, stop: asyncio.Event, watch: asyncio.Task[Any] | None = None) -> None:
        """Until ``stop``: batches as messages arrive, a tick every ``tick_s``. Raises if ``watch`` ends."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()

        async def wake_on_stop() -> None:
            await stop.wait()
            self._arrived.set()

        waker = asyncio.create_task(wake_on_stop())
        try:
            await self._loop(stop, watch, next_tick)
        finally:
            waker.cancel()

    async def _loop(self, stop: asyncio.Event, watch: asyncio.Task[Any] | None, next_tick: float) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if watch is not None and watch.done():
                watch.result()  # surface a crashed relay
                raise RuntimeError("outbox relay stopped")
            if not self._waiting:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, next_tick - loop.time()))
                if stop.is_set():
                    break
            if self._waiting and self._waiting < self.limit and self._busy:
                closes = loop.time() + self.max_wait_s
                while self._waiting < self.limit and loop.time() < closes:
                    self._arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, closes - loop.time()))
            batch = self._take()
            self._busy = len(batch) >= self.busy_batch
            tick = loop.time() >= next_tick
            if tick:
                next_tick = loop.time() + self.tick_s
            if not batch and not tick:
                continue
            started = loop.time()
            try:
                outcomes = await self._handle_batch([m for m, _, _, _ in batch], tick=tick,
                                                    traces=[t for _, t, _, _ in batch],
                                                    senders=[u for _, _, u, _ in batch])
            except BaseException as exc:
                for _, _, _, done in batch:
                    if not done.done():
                        done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
                raise
            if batch:
                cost = (loop.time() - started) / len(batch)
                self.cost_s = cost if self.cost_s <= 0 else 0.8 * self.cost_s + 0.2 * cost
            for (_, _, _, done), outcome in zip(batch, outcomes, strict=True):
                if done.done():
                    continue  # the delivery was cancelled (its connection dropped): the broker redelivers it
                if outcome is None:
                    done.set_result(None)
                else:
                    done.set_exception(outcome)


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
