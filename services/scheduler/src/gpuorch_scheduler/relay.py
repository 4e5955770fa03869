"""The scheduler's outbox relay in a process of its own.

    scheduler process                         relay process (spawned by the leader, one per leader)
    ───────────────                           ─────────────
    batches → log + outbox rows ──(commit, NOTIFY)──► OutboxRelay(pipeline=True): publish with confirms, mark sent
    answers parked rows (requeue/fail the job) ◄── rows the broker refused park_after times (outbox.parked_at)

Publishing a batch of outbox rows costs about as much CPU as deciding it; in its own process it runs on the
machine's other core. Only one relay publishes per database at a time (the outbox's advisory lock), so a relay
left behind by a killed scheduler cannot publish beside the next leader's; and it exits on its own once its parent
is gone (checked every second). Delivery stays at-least-once in commit order, as ``gpuorch_store.outbox`` states.

Its garbage collector is set as the scheduler's (``entrypoint.main``): once connected, what is loaded (modules,
the broker's and the pool's objects) is frozen out of collections, and the young generation is collected less
often. With the defaults, full collections traversing every module object stopped publishing for tens of ms
(up to 220 ms measured under load 7) several times a minute: the tail of submit -> LaunchJob.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Collection, Mapping
from typing import Any

import asyncpg
from gpuorch_messaging import Broker
from gpuorch_observability import configure, get_logger, shutdown_tracing
from gpuorch_store import OutboxRelay

GC_THRESHOLD = (50_000, 20, 100)
"""The collector's thresholds of the scheduler's processes (``entrypoint.main`` and the relay's): a batch allocates
many short-lived objects beside a large long-lived state, so the young generation is collected less often."""

log = get_logger(__name__)


def relay_process(amqp_url: str, database_url: str, producer: str, node_scopes: Mapping[str, Collection[str]],
                  parent_pid: int, log_level: str = "INFO", broker_options: Mapping[str, Any] | None = None,
                  application_name: str = "gpuorch-scheduler-relay") -> None:
    """Entry point of the relay process (a ``multiprocessing`` target): relay until SIGTERM or orphaned.
    ``broker_options``: the scheduler's ``BrokerSettings.broker_options()``; ``application_name`` names its
    database sessions (the leader's, so that the next leader ends them: ``leadership``)."""
    configure("scheduler", log_level=log_level, instance=producer.removeprefix("scheduler/"))
    try:
        asyncio.run(_relay(amqp_url, database_url, producer, node_scopes, parent_pid, broker_options or {},
                           application_name))
    finally:
        shutdown_tracing()


async def _relay(amqp_url: str, database_url: str, producer: str, node_scopes: Mapping[str, Collection[str]],
                 parent_pid: int, broker_options: Mapping[str, Any], application_name: str) -> None:
    broker = Broker(amqp_url, producer=producer, node_scopes=node_scopes, **broker_options)
    await broker.connect()
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2,
                                     server_settings={"application_name": application_name})
    relay = OutboxRelay(pool, broker, poll_interval=0.5, batch_size=1000, pipeline=True)
    gc.collect()
    gc.freeze()  # long-lived from here on: no later collection traverses it
    gc.set_threshold(*GC_THRESHOLD)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, relay.stop)
    running = asyncio.create_task(relay.run_forever(), name="outbox-relay")
    try:
        while not running.done():
            if os.getppid() != parent_pid:
                log.warning("relay.orphaned", note="the scheduler that started this relay is gone")
                relay.stop()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(running), timeout=1.0)
        running.result()
    finally:
        await broker.close()
        await pool.close()
