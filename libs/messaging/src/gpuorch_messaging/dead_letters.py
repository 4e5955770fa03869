"""Dead letters: list them with the reason each was refused, and replay them, judged as who first sent them.

Each consumer queue ``Q`` has ``Q.dlq`` (``consuming.py``). A dead letter keeps its body and original headers plus
``x-gpuorch-dead-letter-reason``, ``x-gpuorch-original-queue``/``-exchange``/``-routing-key`` and its first
publisher (``x-gpuorch-original-user-id``, ``provenance.py``).

    peek(url, queues, limit)   holds up to ``limit`` messages of each ``Q.dlq`` unacked, then closes the channel:
                               every message goes back to its queue, nothing is removed. A queue without a
                               ``.dlq`` is skipped.
    replay(url, queue, limit)  for each dead letter, oldest first, until ``limit`` were replayed:
        replayable?  an original exchange recorded; a body within MAX_MESSAGE_BYTES; a first publisher that
                     ``provenance.recorded_publisher`` trusts (not none: a message published without a user_id
                     is never made the replayer's)
            no  ──> skipped with the reason, held unacked, returned to Q.dlq when the replay ends (so one such
                    letter, a 60 MB body say, never blocks the ones behind it)
            yes ──> published to its original exchange and routing key with confirms (``Broker.publish_raw``),
                    header x-gpuorch-original-user-id = that first publisher, then acked off ``Q.dlq``: never
                    lost, perhaps published twice if the ack is lost (consumers dedupe by ``message_id``)
        the broker refuses the replayer on an exchange (an operator may publish submissions only) ──> the
        replay stops there (``Replay.stopped`` says why); what was replayed stays replayed
    ``DeadLetterQueueMissing`` when ``Q.dlq`` does not exist.

The consumer of a replay judges it as the first publisher only because the replayer is an operator
(``provenance.judged_publisher``): a replay by anyone else is refused. The broker user needs read on ``.+\\.dlq``
and write on the original exchanges: the operator's (``gpuctl-operator`` in deploy/rabbitmq). Used by
``gpuctl dlq`` (direct path) and the API's operator routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq.exceptions
from gpuorch_contracts import MAX_MESSAGE_BYTES

from gpuorch_messaging.abc import PublishRefused
from gpuorch_messaging.broker import Broker
from gpuorch_messaging.consuming import EXCHANGE_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER
from gpuorch_messaging.provenance import ORIGINAL_PUBLISHER_HEADER, header_text, recorded_publisher
from gpuorch_messaging.queues import HEARTBEAT_QUEUE, SCHEDULER_QUEUE, SUBMIT_QUEUE, TELEMETRY_QUEUE, consumer_of

KNOWN_QUEUES = (SCHEDULER_QUEUE, SUBMIT_QUEUE, HEARTBEAT_QUEUE, TELEMETRY_QUEUE)
"""Consumer queues whose dead letters are listed when none is named (a tenant lane: ``scheduler.submit.<tenant>``)."""
REPLAYED_HEADER = "x-gpuorch-replayed"
"""How many times a message was replayed from a dead-letter queue."""
MAX_SKIPPED = 10_000
"""Dead letters a replay passes over (held unacked) before it stops looking further."""


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
    publisher: str = ""
    """Its first publisher as recorded ("" when none was)."""


@dataclass(frozen=True)
class SkippedDeadLetter:
    letter: DeadLetter
    why: str
    """Why it was not replayed (it stays in the dead-letter queue)."""


@dataclass
class Replay:
    queue: str
    replayed: list[DeadLetter] = field(default_factory=list)
    skipped: list[SkippedDeadLetter] = field(default_factory=list)
    stopped: str | None = None
    """Why the replay stopped before the queue was empty or the limit reached (None: it did not)."""


def _dead_letter(queue: str, message: Any) -> DeadLetter:
    headers = message.headers or {}
    recorded = header_text(headers, ORIGINAL_PUBLISHER_HEADER)
    return DeadLetter(
        queue=queue, message_id=message.message_id,
        reason=header_text(headers, REASON_HEADER) or "rejected by the broker (no reason recorded)",
        exchange=header_text(headers, EXCHANGE_HEADER) or "", routing_key=header_text(headers, ROUTING_KEY_HEADER) or "",
        bytes=len(message.body), body_head=message.body[:200].decode("utf-8", "replace"),
        publisher=recorded if recorded is not None else (message.user_id or ""))


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


def _why_not_replayable(queue_name: str, letter: DeadLetter, message: Any) -> tuple[str | None, str | None]:
    """(the first publisher to replay it as, None) or (None, why it is not replayed)."""
    if not letter.exchange:
        return None, "no original exchange recorded"
    if letter.bytes > MAX_MESSAGE_BYTES:
        return None, f"{letter.bytes} bytes: larger than any message gpuorch takes ({MAX_MESSAGE_BYTES})"
    judged = recorded_publisher(queue_name, message.user_id, message.headers, message.body, accepts_of=consumer_of)
    return judged.publisher, judged.refused


async def replay(amqp_url: str, queue_name: str, limit: int, *, producer: str) -> Replay:
    """Publish up to ``limit`` dead letters of ``queue_name`` back where they were going, each as its first
    publisher (see the module doc)."""
    broker = Broker(amqp_url, producer=producer, declare_topology=False, topology_wait_s=0)
    await broker.connect(timeout_s=10)
    connection = await aio_pika.connect(amqp_url)
    done = Replay(queue_name)
    try:
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(f"{queue_name}.dlq", passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise DeadLetterQueueMissing(f"no dead-letter queue {queue_name}.dlq") from exc
        while len(done.replayed) < limit and len(done.skipped) < MAX_SKIPPED:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            letter = _dead_letter(queue_name, message)
            publisher, why = _why_not_replayable(queue_name, letter, message)
            if publisher is None:
                done.skipped.append(SkippedDeadLetter(letter, why or "not replayable"))
                continue  # held unacked: back in the queue when the channel closes
            headers = dict(message.headers or {})
            for name in (REASON_HEADER, QUEUE_HEADER, EXCHANGE_HEADER, ROUTING_KEY_HEADER, "x-delivery-count"):
                headers.pop(name, None)
            headers[ORIGINAL_PUBLISHER_HEADER] = publisher
            headers[REPLAYED_HEADER] = int(headers.get(REPLAYED_HEADER, 0)) + 1  # type: ignore[arg-type]
            try:
                await broker.publish_raw(letter.exchange, letter.routing_key, message.body,
                                         message_id=message.message_id or "", headers=headers)
            except PublishRefused as exc:
                done.skipped.append(SkippedDeadLetter(letter, str(exc)))
                continue
            except aiormq.exceptions.ChannelAccessRefused as exc:
                done.stopped = (f"{letter.message_id}: {broker.user_id} may not publish to {letter.exchange}/"
                                f"{letter.routing_key} (an operator replays submissions and cancels; events and "
                                f"commands are sent again by their publishers): {exc}")
                break
            await message.ack()
            done.replayed.append(letter)
    finally:
        await connection.close()
        await broker.close()
    return done
