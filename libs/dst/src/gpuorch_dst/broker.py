"""The broker's delivery semantics, as RabbitMQ gives them to gpuorch (DESIGN.md §3), with its faults.

    publish(queue, message)  ──network delay (per publisher and queue: FIFO)──►  queue.ready
                             ──(a lost confirm: the publisher sends it again)──►  a duplicate, later
    take(queue, consumer)    ready ──► unacked (on the consumer's connection)
    ack(delivery)            unacked ──► gone; an ack on a connection that dropped is lost
    drop(connection)         every unacked delivery of that connection ──► the front of its queue, redelivered

At-least-once: a message is delivered until a consumer acks it on a live connection; consumers dedupe by
``message_id``. Order holds per publisher and queue only: queues are consumed independently, so what one publisher
sends to two queues is seen in either order. A latest-wins queue (heartbeats) keeps one ready message per key.
Every delay and duplicate is drawn from the loop's one random source.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuorch_contracts import Message

from gpuorch_dst.loop import SimLoop


@dataclass
class Delivery:
    message: Message
    epoch: int | None = None
    """The epoch of the leader whose committed decision this command is (commands only; an AMQP header in a real
    deployment)."""
    tag: int = 0
    redelivered: bool = False
    connection: int | None = None
    """The consumer connection holding it unacked."""


@dataclass
class SimQueue:
    name: str
    latest_wins: Callable[[Message], str] | None = None
    """Key of a latest-wins queue (a newer ready message of the same key replaces the older one)."""
    ready: deque[Delivery] = field(default_factory=deque)
    unacked: dict[int, Delivery] = field(default_factory=dict)
    notify: Callable[[], None] | None = None
    """Called when a delivery becomes ready (the consumer schedules its work)."""


@dataclass
class BrokerFaults:
    delay_s: tuple[float, float] = (0.001, 0.05)
    duplicate_p: float = 0.0
    """Chance that a publish is delivered twice (its confirm was lost and the publisher sent it again)."""


class SimBroker:
    """Queues with at-least-once delivery, per-publisher FIFO, redelivery of what a dropped connection held."""

    def __init__(self, loop: SimLoop, faults: BrokerFaults | None = None) -> None:
        self.loop = loop
        self.faults = faults or BrokerFaults()
        self.queues: dict[str, SimQueue] = {}
        self._tags = itertools.count(1)
        self._connections = itertools.count(1)
        self._fifo: dict[tuple[str, str], float] = {}
        self.published = 0
        self.duplicated = 0
        self.redelivered = 0
        self.trace: Callable[[str], None] | None = None
        """Told every publish (``--trace``)."""

    def queue(self, name: str, latest_wins: Callable[[Message], str] | None = None) -> SimQueue:
        found = self.queues.get(name)
        if found is None:
            found = self.queues[name] = SimQueue(name, latest_wins)
        return found

    def connect(self) -> int:
        """A new connection id (a process that reconnects gets a fresh one)."""
        return next(self._connections)

    def publish(self, queue: str, message: Message, *, publisher: str, epoch: int | None = None) -> None:
        """Deliver ``message`` to ``queue`` after a network delay (after whatever ``publisher`` sent there before)."""
        self.published += 1
        if self.trace is not None:
            self.trace(f"{self.loop.now:9.3f}   {publisher} publishes {describe(message)} to {queue}"
                       + (f" (epoch {epoch})" if epoch is not None else ""))
        key = (publisher, queue)
        arrives = max(self._fifo.get(key, 0.0), self.loop.now + self.loop.jitter(*self.faults.delay_s))
        self._fifo[key] = arrives
        self.loop.at(arrives, lambda: self._arrive(queue, message, epoch), f"deliver {message.TYPE} to {queue}")
        if self.loop.chance(self.faults.duplicate_p):
            self.duplicated += 1
            self.loop.at(arrives + self.loop.jitter(0.05, 2.0), lambda: self._arrive(queue, message, epoch),
                         f"duplicate {message.TYPE} to {queue}")

    def _arrive(self, name: str, message: Message, epoch: int | None) -> None:
        queue = self.queue(name)
        if queue.latest_wins is not None:
            key = queue.latest_wins(message)
            queue.ready = deque(d for d in queue.ready if queue.latest_wins(d.message) != key)
        queue.ready.append(Delivery(message, epoch, next(self._tags)))
        if queue.notify is not None:
            queue.notify()

    def take(self, name: str, connection: int, limit: int) -> list[Delivery]:
        """Up to ``limit`` ready deliveries, now unacked on ``connection``."""
        queue = self.queue(name)
        taken: list[Delivery] = []
        while queue.ready and len(taken) < limit:
            delivery = queue.ready.popleft()
            delivery.connection = connection
            queue.unacked[delivery.tag] = delivery
            taken.append(delivery)
        return taken

    def ack(self, name: str, delivery: Delivery, connection: int | None) -> None:
        """Ack on ``connection``: lost if that connection is gone (the delivery was already requeued)."""
        queue = self.queue(name)
        held = queue.unacked.get(delivery.tag)
        if held is not None and connection is not None and held.connection == connection:
            del queue.unacked[delivery.tag]

    def nack(self, name: str, delivery: Delivery, connection: int | None) -> None:
        """Return an unacked delivery to the front of its queue (its handler failed)."""
        queue = self.queue(name)
        held = queue.unacked.get(delivery.tag)
        if held is not None and held.connection == connection:
            del queue.unacked[delivery.tag]
            self._requeue(queue, [held])

    def drop(self, connection: int | None) -> None:
        """A connection closed: every delivery it held unacked is ready again, at the front, redelivered."""
        if connection is None:
            return
        for queue in self.queues.values():
            held = [d for d in queue.unacked.values() if d.connection == connection]
            for delivery in held:
                del queue.unacked[delivery.tag]
            if held:
                self._requeue(queue, held)

    def _requeue(self, queue: SimQueue, deliveries: list[Delivery]) -> None:
        for delivery in reversed(sorted(deliveries, key=lambda d: d.tag)):
            delivery.redelivered, delivery.connection = True, None
            queue.ready.appendleft(delivery)
            self.redelivered += 1
        if queue.notify is not None:
            queue.notify()


def describe(message: Message) -> str:
    """A message in one line, for traces."""
    parts = [message.TYPE]
    for name in ("job_id", "placement_id", "node_id", "reason", "stop_reason"):
        value = getattr(message, name, None)
        if value is not None:
            parts.append(f"{name}={str(value)[:8] if name.endswith('_id') and name != 'node_id' else value}")
    return " ".join(parts)
