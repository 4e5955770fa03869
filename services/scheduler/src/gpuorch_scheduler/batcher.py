"""The Batcher: deliveries from every lane gathered into batches (one transaction each), and the periodic tick.

    lane "scheduler.submit.<tenant>", lane "scheduler.submit", queue "scheduler" ──► one delivery handler per lane
        (the broker calls it per message, up to the queue's prefetch; it returns once its batch committed)
    Batcher.run: one message from each waiting lane in turn, at most ``max_messages`` (and, while tenants share,
        about ``budget_s`` of work); under load it waits ``max_wait_s`` to fill; a tick due joins the batch
        ──► handle_batch(messages, tick=..., traces=..., senders=...)   (``handlers.SchedulerService``)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from gpuorch_contracts import Message
from gpuorch_observability import inject_trace

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
