"""How full the bounded queues are, as Prometheus gauges: a ``drop-head`` queue at its message bound is dropping.

RabbitMQ 3.10 counts no ``drop-head`` drop, so fullness is read (docs/decisions.md 42):
``gpuorch_bounded_queue_messages{queue}`` (its depth) and ``gpuorch_bounded_queue_full{queue}`` (1 at its message
bound: each new message drops its oldest; a byte bound reached is not visible through AMQP). Each process exports the
queues it is responsible for (``keep_bounded_queue_gauges``, passive declares every 15 s, no right needed): the
scheduler leader ``gpuorch.unrouted`` and the scheduler's and telemetry's dead-letter queues; each executor and
node-agent its own nodes' dead-letter queues.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

from gpuorch_observability import get_logger
from prometheus_client import Gauge

from gpuorch_messaging.broker import Broker

log = get_logger(__name__)

BOUNDED_QUEUE_MESSAGES = Gauge("gpuorch_bounded_queue_messages", "Messages in a drop-head bounded queue "
                               "(gpuorch.unrouted, each Q.dlq)", ["queue"])
BOUNDED_QUEUE_FULL = Gauge("gpuorch_bounded_queue_full", "1 while a drop-head queue is at its message bound: each "
                           "new message drops its oldest", ["queue"])


def export_bounded_queues(depths: Mapping[str, int], bounds: Mapping[str, int]) -> None:
    """Depth and fullness of each bounded queue in ``depths`` (``bounds``: its message bound). A queue at its bound
    is dropping (``drop-head``, not counted by RabbitMQ); its byte bound is not visible here."""
    for name, depth in depths.items():
        BOUNDED_QUEUE_MESSAGES.labels(name).set(depth)
        BOUNDED_QUEUE_FULL.labels(name).set(1 if depth >= bounds.get(name, math.inf) else 0)


async def keep_bounded_queue_gauges(broker: Broker, bounds: Mapping[str, int], *, period_s: float = 15.0) -> None:
    """Keep the gauges of the queues in ``bounds`` (name -> message bound) current until cancelled; a read that
    fails (the broker away) is logged and retried at the next period. A queue that does not exist is left out."""
    while True:
        try:
            export_bounded_queues(await broker.queue_depths(bounds), bounds)
        except Exception as exc:  # noqa: BLE001 - a gauge missed is retried at the next period
            log.warning("broker.bounded_queue_gauges_failed", error=repr(exc))
        await asyncio.sleep(period_s)
