"""gpuctl dlq: list dead letters with their reasons, and replay them to where they were going.

Each consumer queue ``Q`` has ``Q.dlq``. A dead letter keeps its body and original headers plus
``x-gpuorch-dead-letter-reason``, ``x-gpuorch-original-queue``/``-exchange``/``-routing-key``.
Listing holds the messages unacked and then releases them, so it removes nothing. Replay publishes each message
to its original exchange and routing key with confirms, and only then acks it off the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl.terminal_text import cell

dlq_app = typer.Typer(help="Inspect and replay dead-lettered messages.", no_args_is_help=True)
console = Console(emoji=False)
err = Console(stderr=True, emoji=False)

KNOWN_QUEUES = ("scheduler", "scheduler.submit", "scheduler.heartbeats", "telemetry.samples")
"""Consumer queues whose dead letters `gpuctl dlq` shows by default (a tenant lane: `--queue scheduler.submit.<tenant>`)."""
AmqpOpt = Annotated[str, typer.Option(
    "--amqp-url", envvar=["GPUORCH_OPERATOR_AMQP_URL", "GPUORCH_AMQP_URL"],
    help="RabbitMQ URL of an operator user (gpuctl-operator): dead letters are not for submitters")]
DEFAULT_AMQP = os.environ.get("GPUORCH_OPERATOR_AMQP_URL",
                              os.environ.get("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"))


async def _dead_letters(amqp_url: str, queues: list[str], limit: int) -> list[dict[str, Any]]:
    import aio_pika
    from gpuorch_messaging import EXCHANGE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER

    connection = await aio_pika.connect(amqp_url)
    found: list[dict[str, Any]] = []
    try:
        for queue_name in queues:
            channel = await connection.channel()
            try:
                queue = await channel.declare_queue(f"{queue_name}.dlq", passive=True)
            except Exception:
                continue
            held: list[Any] = []
            while len(held) < limit:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                held.append(message)
                headers = message.headers or {}
                found.append({
                    "queue": queue_name, "message_id": message.message_id,
                    "reason": str(headers.get(REASON_HEADER, "rejected by the broker (no reason recorded)")),
                    "exchange": str(headers.get(EXCHANGE_HEADER, "")),
                    "routing_key": str(headers.get(ROUTING_KEY_HEADER, "")),
                    "bytes": len(message.body), "body_head": message.body[:200].decode("utf-8", "replace"),
                })
            await channel.close()  # releases every held message back to the queue
    finally:
        await connection.close()
    return found


@dlq_app.command("list")
def list_dead_letters(
    queue: Annotated[list[str] | None, typer.Option(help="consumer queue (repeatable); default: known queues")] = None,
    limit: Annotated[int, typer.Option(help="at most N per queue")] = 100,
    amqp_url: AmqpOpt = DEFAULT_AMQP,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List dead-lettered messages and why each was refused."""
    rows = asyncio.run(_dead_letters(amqp_url, list(queue or KNOWN_QUEUES), limit))
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("queue", "message id", "reason", "bytes")
    for r in rows:
        table.add_row(cell(r["queue"]), cell(r["message_id"]), cell(r["reason"][:100]), str(r["bytes"]))
    console.print(table)


async def _replay(amqp_url: str, queue_name: str, limit: int) -> int:
    import aio_pika
    from gpuorch_messaging import EXCHANGE_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER, Broker

    broker = Broker(amqp_url, producer="gpuctl/dlq")
    await broker.connect(timeout_s=10)
    connection = await aio_pika.connect(amqp_url)
    replayed = 0
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"{queue_name}.dlq", passive=True)
        while replayed < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            headers = dict(message.headers or {})
            exchange, key = str(headers.get(EXCHANGE_HEADER, "")), str(headers.get(ROUTING_KEY_HEADER, ""))
            if not exchange:
                await message.nack(requeue=True)
                err.print(f"{cell(message.message_id)}: no original exchange recorded; left in place")
                break
            for name in (REASON_HEADER, QUEUE_HEADER, EXCHANGE_HEADER, ROUTING_KEY_HEADER, "x-delivery-count"):
                headers.pop(name, None)
            headers["x-gpuorch-replayed"] = int(headers.get("x-gpuorch-replayed", 0)) + 1  # type: ignore[arg-type]
            await broker.publish_raw(exchange, key, message.body, message_id=message.message_id or "", headers=headers)
            await message.ack()
            replayed += 1
            err.print(f"replayed {cell(message.message_id)} -> {cell(exchange)}/{cell(key)}")
    finally:
        await connection.close()
        await broker.close()
    return replayed


@dlq_app.command("replay")
def replay_dead_letters(
    queue: Annotated[str, typer.Option(help="consumer queue whose dead letters to replay")],
    limit: Annotated[int, typer.Option(help="at most N messages")] = 1000,
    amqp_url: AmqpOpt = DEFAULT_AMQP,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Publish dead letters back to their original exchange/routing key (after you fixed the cause)."""
    count = asyncio.run(_replay(amqp_url, queue, limit))
    print(json.dumps({"queue": queue, "replayed": count}) if as_json else f"replayed {count} message(s)")
