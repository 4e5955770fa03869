"""Running one or many node agents in one process: heartbeat and sample schedules, health events, publishing.

Contract:
- each node heartbeats every ``heartbeat_s`` (first one at a seeded random phase within the interval, then
  ``heartbeat_s`` +/- ``jitter`` so nodes never synchronise) and sends a usage sample every ``usage_s``;
- due messages of one tick go out in one ``publish_many`` batch (chunks of ``batch_size``), published on tasks so
  a slow confirm never delays the next tick; at most ``max_in_flight`` batches wait for confirms (back-pressure);
- a health event goes out at once, on its own task, never waiting for a heartbeat tick;
- a failed publish is logged and counted, never fatal: a heartbeat is latest-wins (the next one replaces it) and a
  node whose ``NodeRegistered`` (or heartbeat with its GPUs' state) failed re-sends it with its next heartbeat;
- ``stats`` counts what was published and each heartbeat's publish lag (confirm time minus its due time).
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import Message, NodeHeartbeat, NodeRegistered
from gpuorch_observability import get_logger

from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.nvml.events import HealthEventWatcher

log = get_logger(__name__)


@dataclass
class FleetStats:
    heartbeats: int = 0
    registrations: int = 0
    usage_samples: int = 0
    health_events: int = 0
    publish_failures: int = 0
    nvml_event_failures: int = 0
    lag_s: list[float] = field(default_factory=list)
    confirm_s: list[float] = field(default_factory=list)
    """Duration of each heartbeat batch's publish (send until every message confirmed)."""
    health_lag_s: list[float] = field(default_factory=list)

    def lag_percentile(self, q: float) -> float | None:
        if not self.lag_s:
            return None
        ordered = sorted(self.lag_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def publish_batch(publisher: Any, messages: Sequence[Message]) -> None:
    """``publish_many`` when the publisher has it (the Broker), else one by one (``RecordingPublisher``)."""
    many = getattr(publisher, "publish_many", None)
    if many is not None:
        await many(messages)
        return
    for message in messages:
        await publisher.publish(message)


class FleetRunner:
    def __init__(
        self, agents: Sequence[NodeAgent], publisher: Any, *, heartbeat_s: float = 10.0, usage_s: float = 60.0,
        jitter: float = 0.1, seed: int = 0, batch_size: int = 500, tick_s: float | None = None,
        clock: Callable[[], float] = time.monotonic, max_lag_samples: int = 200_000, max_in_flight: int = 2,
    ) -> None:
        self.agents = list(agents)
        self.publisher = publisher
        self.heartbeat_s = heartbeat_s
        self.usage_s = usage_s
        self.jitter = jitter
        self.batch_size = batch_size
        self.tick_s = tick_s if tick_s is not None else min(0.1, heartbeat_s / 10)
        self.clock = clock
        self.max_lag_samples = max_lag_samples
        self.stats = FleetStats()
        self._random = random.Random(seed)
        self._by_uuid: dict[str, tuple[NodeAgent, int]] = {}
        self._watchers: list[HealthEventWatcher] = []
        self._events: asyncio.Queue[tuple[str | None, int, int, float]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._heartbeat_due: list[tuple[float, int]] = []
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._publishing: set[asyncio.Task[None]] = set()
        self._usage_due: list[tuple[float, int]] = []

    @property
    def by_node_id(self) -> dict[str, NodeAgent]:
        return {a.node_id: a for a in self.agents}

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Discover every node, start the NVML event watchers and publish what discovery found unhealthy."""
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        startup: list[Message] = []
        for agent in self.agents:
            startup += agent.start()
        self._index_uuids()
        now = self.clock()
        for i, _ in enumerate(self.agents):
            self._heartbeat_due.append((now + self._random.uniform(0, self.heartbeat_s) if len(self.agents) > 1
                                        else now, i))
            self._usage_due.append((now + self._random.uniform(0, self.usage_s), i))
        heapq.heapify(self._heartbeat_due)
        heapq.heapify(self._usage_due)
        for nvml, handles in self._watch_groups():
            watcher = HealthEventWatcher(nvml, handles, self._on_event_thread, self._on_event_failure)
            watcher.start()
            self._watchers.append(watcher)
        for watcher in self._watchers:
            await asyncio.to_thread(watcher.ready.wait, 5.0)
        if startup:
            await self._publish([(m, now) for m in startup])
        self._tasks = [asyncio.create_task(self._health_loop(), name="fleet-health"),
                       asyncio.create_task(self._schedule_loop(), name="fleet-schedule")]

    async def run(self, duration_s: float | None = None) -> None:
        """Start (if needed) and run until ``stop`` or ``duration_s``."""
        if not self._tasks:
            await self.start()
        try:
            if duration_s is None:
                await self._stopping.wait()
            else:
                try:
                    await asyncio.wait_for(self._stopping.wait(), duration_s)
                except TimeoutError:
                    pass
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._publishing:
            await asyncio.wait(set(self._publishing), timeout=5.0)
        for watcher in self._watchers:
            await asyncio.to_thread(watcher.stop)
        self._watchers = []

    def _watch_groups(self) -> Iterable[tuple[Any, list[Any]]]:
        """One watcher per event source: simulated nodes sharing an ``EventHub`` share one watcher."""
        groups: dict[int, tuple[Any, list[Any]]] = {}
        for agent in self.agents:
            hub = getattr(agent.nvml, "events", None)
            key = id(hub) if hub is not None else id(agent)
            groups.setdefault(key, (agent.nvml, []))[1].extend(h for h in agent.handles if h is not None)
        return [g for g in groups.values() if g[1]]

    def _index_uuids(self) -> None:
        self._by_uuid = {uuid: (agent, index) for agent in self.agents for uuid, index in agent.gpu_uuids().items()}

    # -- health events ----------------------------------------------------------------------------------------

    def _on_event_thread(self, uuid: str | None, event_type: int, event_data: int) -> None:
        loop, queue = self._loop, self._events
        if loop is None or queue is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(queue.put_nowait, (uuid, event_type, event_data, self.clock()))

    def _on_event_failure(self, failure: str) -> None:
        self.stats.nvml_event_failures += 1
        log.warning("nvml.event_failure", failure=failure)

    async def _health_loop(self) -> None:
        assert self._events is not None
        while True:
            uuid, event_type, event_data, seen_at = await self._events.get()
            target = self._by_uuid.get(uuid) if uuid else None
            if target is None:
                log.warning("nvml.event_for_unknown_gpu", uuid=uuid, event_type=event_type, data=event_data)
                continue
            agent, _ = target
            message = agent.on_nvml_event(uuid, event_type, event_data)
            if message is not None:
                await self._publish([(message, seen_at)])
                self.stats.health_lag_s.append(self.clock() - seen_at)

    # -- schedules --------------------------------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while True:
            now = self.clock()
            batch: list[tuple[Message, float]] = []
            while self._heartbeat_due and self._heartbeat_due[0][0] <= now:
                due, i = heapq.heappop(self._heartbeat_due)
                batch += [(m, due) for m in self._safely(self.agents[i], self.agents[i].heartbeat_messages)]
                heapq.heappush(self._heartbeat_due, (due + self._next_interval(self.heartbeat_s), i))
            while self._usage_due and self._usage_due[0][0] <= now:
                due, i = heapq.heappop(self._usage_due)
                batch += [(m, due) for m in self._safely(self.agents[i], self.agents[i].usage_message)]
                heapq.heappush(self._usage_due, (due + self._next_interval(self.usage_s), i))
            for start in range(0, len(batch), self.batch_size):
                await self._in_flight.acquire()  # back-pressure: at most max_in_flight batches unconfirmed
                task = asyncio.create_task(self._publish_released(batch[start:start + self.batch_size]))
                self._publishing.add(task)
                task.add_done_callback(self._publishing.discard)
            await asyncio.sleep(self.tick_s)

    async def _publish_released(self, items: list[tuple[Message, float]]) -> None:
        try:
            await self._publish(items)
        finally:
            self._in_flight.release()

    def _next_interval(self, base: float) -> float:
        return base * (1.0 + self._random.uniform(-self.jitter, self.jitter))

    @staticmethod
    def _safely(agent: NodeAgent, produce: Callable[[], list[Message]]) -> list[Message]:
        try:
            return produce()
        except Exception as exc:
            log.error("agent.tick_failed", node_id=agent.node_id, error=repr(exc))
            return []

    async def _publish(self, items: list[tuple[Message, float]]) -> None:
        """Publish ``(message, due time)`` pairs as one batch; count them and their lag once confirmed."""
        if not items:
            return
        messages = [m for m, _ in items]
        started = self.clock()
        try:
            await publish_batch(self.publisher, messages)
        except Exception as exc:
            self.stats.publish_failures += len(messages)
            log.warning("fleet.publish_failed", count=len(messages), error=str(exc)[:300])
            by_id = self.by_node_id  # what was lost goes again with the next heartbeat: inventory, GPUs' state
            for m in messages:
                if isinstance(m, NodeRegistered) and m.inventory.node_id in by_id:
                    by_id[m.inventory.node_id].heartbeat.forget_sent()
                elif isinstance(m, NodeHeartbeat) and m.gpus and m.node_id in by_id:
                    by_id[m.node_id].heartbeat.sent_gpus = None
            return
        confirmed = self.clock()
        if len(self.stats.confirm_s) < self.max_lag_samples:
            self.stats.confirm_s.append(confirmed - started)
        for m, due in items:
            if isinstance(m, NodeHeartbeat):
                self.stats.heartbeats += 1
                if len(self.stats.lag_s) < self.max_lag_samples:
                    self.stats.lag_s.append(confirmed - due)
            elif isinstance(m, NodeRegistered):
                self.stats.registrations += 1
            elif m.TYPE == "gpu.usage_sampled":
                self.stats.usage_samples += 1
            elif m.TYPE == "gpu.health_changed":
                self.stats.health_events += 1

    async def publish_now(self, messages: list[Message]) -> None:
        """Publish messages produced outside the schedule (e.g. after a MIG change)."""
        await self._publish([(m, self.clock()) for m in messages])
        self._index_uuids()
