"""Dead letters: list them with the reason each was refused, and replay them to where they were going.

Each consumer queue ``Q`` has ``Q.dlq`` (``broker.py``). A dead letter keeps its body and original headers plus
``x-gpuorch-dead-letter-reason``, ``x-gpuorch-original-queue``/``-exchange``/``-routing-key``.

    peek(url, queues, limit)   holds up to ``limit`` messages of each ``Q.dlq`` unacked, then closes the channel:
                               every message goes back to its queue, nothing is removed. A queue without a
                               ``.dlq`` is skipped.
    replay(url, queue, limit)  publishes each message to its original exchange and routing key with confirms
                               (``Broker.publish_raw``), and only then acks it off ``Q.dlq``: a message is never
                               lost, and may be published twice if the ack is lost (consumers dedupe by
                               ``message_id``). A message without an original exchange is left in place and
                               stops the replay (``Replay.stopped`` says why). ``DeadLetterQueueMissing`` when
                               ``Q.dlq`` does not exist.

The broker user needs read on ``.+\\.dlq`` (basic.get, ack) and write on the original exchanges: the operator's
(``gpuctl-operator`` in deploy/rabbitmq). Used by ``gpuctl dlq`` (direct path) and the API's operator routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq.exceptions

from gpuorch_messaging.broker import EXCHANGE_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER, Broker

KNOWN_QUEUES = ("scheduler", "scheduler.submit", "scheduler.heartbeats", "telemetry.samples")
"""Consumer queues whose dead letters are listed when none is named (a tenant lane: ``scheduler.submit.<tenant>``)."""
REPLAYED_HEADER = "x-gpuorch-replayed"
"""How many times a message was replayed from a dead-letter queue."""


class DeadLetterQueueMissing(LookupError):
    """The queue has no dead-letter queue (``Q.dlq``): not a consumer queue of gpuorch, or never declared."""


@dataclass(frozen=True)
class DeadLetter:
    queue: str
    message_id: str | None
    reason: str
    exchange: str
    routing_key: str
    bytes: int
    body_head: str
    """The first 200 bytes of the body, as text."""


@dataclass
class Replay:
    queue: str
    replayed: list[DeadLetter] = field(default_factory=list)
    stopped: str | None = None
    """Why the replay stopped before the queue was empty or the limit reached (None: it did not)."""


def _dead_letter(queue: str, message: Any) -> DeadLetter:
    headers = message.headers or {}
    return DeadLetter(
        queue=queue, message_id=message.message_id,
        reason=str(headers.get(REASON_HEADER, "rejected by the broker (no reason recorded)")),
        exchange=str(headers.get(EXCHANGE_HEADER, "")), routing_key=str(headers.get(ROUTING_KEY_HEADER, "")),
        bytes=len(message.body), body_head=message.body[:200].decode("utf-8", "replace"))


async def peek(amqp_url: str, queues: list[str], limit: int) -> list[DeadLetter]:
    """Up to ``limit`` dead letters of each queue, oldest first; nothing is removed."""
    connection = await aio_pika.connect(amqp_url)
    found: list[DeadLetter] = []
    try:
        for queue_name in queues:
            channel = await connection.channel()
            try:
                queue = await channel.declare_queue(f"{queue_name}.dlq", passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                continue
            held = 0
            while held < limit:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                held += 1
                found.append(_dead_letter(queue_name, message))
            await channel.close()  # releases every held message back to the queue
    finally:
        await connection.close()
    return found


async def replay(amqp_url: str, queue_name: str, limit: int, *, producer: str) -> Replay:
    """Publish up to ``limit`` dead letters of ``queue_name`` back where they were going (see the module doc)."""
    broker = Broker(amqp_url, producer=producer, declare_topology=False)
    await broker.connect(timeout_s=10)
    connection = await aio_pika.connect(amqp_url)
    done = Replay(queue_name)
    try:
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(f"{queue_name}.dlq", passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise DeadLetterQueueMissing(f"no dead-letter queue {queue_name}.dlq") from exc
        while len(done.replayed) < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            letter = _dead_letter(queue_name, message)
            if not letter.exchange:
                await message.nack(requeue=True)
                done.stopped = f"{letter.message_id}: no original exchange recorded; left in place"
                break
            headers = dict(message.headers or {})
            for name in (REASON_HEADER, QUEUE_HEADER, EXCHANGE_HEADER, ROUTING_KEY_HEADER, "x-delivery-count"):
                headers.pop(name, None)
            headers[REPLAYED_HEADER] = int(headers.get(REPLAYED_HEADER, 0)) + 1  # type: ignore[arg-type]
            await broker.publish_raw(letter.exchange, letter.routing_key, message.body,
                                     message_id=message.message_id or "", headers=headers)
            await message.ack()
            done.replayed.append(letter)
    finally:
        await connection.close()
        await broker.close()
    return done
