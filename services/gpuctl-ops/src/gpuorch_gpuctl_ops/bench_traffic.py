"""The measured traffic of ``gpuctl bench``: SubmitJob bodies published at a paced rate with plain aio-pika, and
receivers that note when each job's message arrives.

Latency is send time (just before the publish call) to first arrival, matched by ``job_id``; later copies of a key
are counted as duplicates.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


@dataclass
class Arrivals:
    """First arrival time of each key (a job id) at a receiver; later copies are counted as duplicates."""

    expected: int
    received_at: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_message(self, message: Any) -> None:
        now = time.perf_counter()
        key = str(json.loads(message.body)["job_id"])
        if key in self.received_at:
            self.duplicates += 1
            return
        self.received_at[key] = now
        if len(self.received_at) >= self.expected:
            self.all_in.set()

    def latencies(self, sent_at: dict[str, float]) -> list[float]:
        """Seconds from send to first arrival of every key that arrived, ascending."""
        return sorted(self.received_at[k] - sent_at[k] for k in self.received_at if k in sent_at)

    def per_second(self, first_sent: float) -> float:
        """Sustained rate: arrivals / (last arrival - ``first_sent``), 0 when nothing arrived."""
        if not self.received_at:
            return 0.0
        return round(len(self.received_at) / max(max(self.received_at.values()) - first_sent, 1e-9), 1)


async def publish_paced(exchange: Any, routing_key: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                        user_id: str | None, max_in_flight: int = 2000) -> tuple[dict[str, float], float]:
    """Publish ``(key, body)`` at ``rate`` per second (confirms, mandatory, persistent), confirms awaited
    concurrently (at most ``max_in_flight`` unconfirmed). Returns each key's send time and the seconds it took
    to send them all (so the achieved rate can be reported). Raises on the first unconfirmed message."""
    import aio_pika

    sent_at: dict[str, float] = {}
    gate = asyncio.Semaphore(max_in_flight)
    pending: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    async def send(key: str, body: bytes) -> None:
        try:
            message = aio_pika.Message(body, message_id=str(uuid.uuid4()), content_type="application/json",
                                       delivery_mode=aio_pika.DeliveryMode.PERSISTENT, user_id=user_id)
            sent_at[key] = time.perf_counter()
            await exchange.publish(message, routing_key, mandatory=True, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported after the loop
            failures.append(exc)
        finally:
            gate.release()

    started = time.perf_counter()
    sent = 0
    while sent < len(bodies) and not failures:
        due = min(len(bodies), int((time.perf_counter() - started) * rate) + 1)
        while sent < due:
            await gate.acquire()
            task = asyncio.create_task(send(*bodies[sent]))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.sleep(max(0.0, started + sent / rate - time.perf_counter()))
    if pending:
        await asyncio.wait(set(pending))
    if failures:
        raise RuntimeError(f"{len(failures)} publishes not confirmed: {failures[0]!r}") from failures[0]
    return sent_at, time.perf_counter() - started


def submit_bodies(jobs: int) -> list[tuple[str, bytes]]:
    """``jobs`` SubmitJob bodies for one whole GPU each, keyed by job id (serialised before timing starts)."""
    from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob

    spec = JobSpec(name="bench", tenant="bench", tier="batch", resources=GpuRequest(gpus=1),
                   cpu_milli=1000, memory_mib=4096, run=ProcessRun(argv=["python", "-c", "pass"]))
    bodies = []
    for _ in range(jobs):
        message = SubmitJob(spec=spec, producer="bench")
        bodies.append((str(message.job_id), message.model_dump_json().encode()))
    return bodies
