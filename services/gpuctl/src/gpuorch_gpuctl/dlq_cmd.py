"""gpuctl dlq: list dead letters with their reasons, and replay them to where they were going (operators only).

    gpuctl dlq list   [--queue Q ...] [--limit N]   GET  /api/v1/dlq?queue=Q&limit=N        (the API's operator routes;
    gpuctl dlq replay --queue Q       [--limit N]   POST /api/v1/dlq/Q/replay?limit=N        a submitter gets 403)
        --amqp-url / GPUORCH_OPERATOR_AMQP_URL, no API named: RabbitMQ directly as the operator's broker user
        (decision 31: scripts, stacks without an API)

Listing removes nothing; replay publishes each message with confirms before acking it off ``Q.dlq``, as its first
publisher, and keeps those it may not replay (``gpuorch_messaging.dead_letters`` says what is guaranteed).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl.api_client import api_or_dsn
from gpuorch_gpuctl.errors import fail
from gpuorch_gpuctl.lazy import OPS_DISTRIBUTION, OPS_HINT
from gpuorch_gpuctl.terminal_text import cell

dlq_app = typer.Typer(help="Inspect and replay dead-lettered messages (operators).", no_args_is_help=True)
console = Console(emoji=False)
err = Console(stderr=True, emoji=False)

AmqpOpt = Annotated[str | None, typer.Option(
    "--amqp-url", envvar="GPUORCH_OPERATOR_AMQP_URL",
    help="RabbitMQ URL of an operator broker user (gpuctl-operator): talk to the broker directly instead of the "
         "API (for scripts and stacks without an API, decision 31); an API named with --server/--context/"
         "GPUCTL_SERVER wins")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]


def _dead_letters() -> Any:
    """gpuorch_messaging's dead-letter tools: the direct path, installed with gpuorch-gpuctl-ops."""
    try:
        from gpuorch_messaging import dead_letters
    except ModuleNotFoundError:
        fail(f"the direct path (--amqp-url) needs {OPS_DISTRIBUTION}: {OPS_HINT}")
    return dead_letters


def _direct_list(amqp_url: str, queues: list[str] | None, limit: int) -> list[dict[str, Any]]:
    dead_letters = _dead_letters()
    found = asyncio.run(dead_letters.peek(amqp_url, queues or list(dead_letters.KNOWN_QUEUES), limit))
    return [asdict(letter) for letter in found]


def _direct_replay(amqp_url: str, queue: str, limit: int) -> dict[str, Any]:
    dead_letters = _dead_letters()
    try:
        done = asyncio.run(dead_letters.replay(amqp_url, queue, limit, producer="gpuctl/dlq"))
    except dead_letters.DeadLetterQueueMissing as exc:
        fail(str(exc))
    return {"queue": done.queue, "replayed": len(done.replayed), "stopped": done.stopped,
            "messages": [asdict(letter) for letter in done.replayed],
            "skipped": [asdict(skipped) for skipped in done.skipped]}


@dlq_app.command("list")
def list_dead_letters(
    queue: Annotated[list[str] | None, typer.Option(help="consumer queue (repeatable); default: known queues")] = None,
    limit: Annotated[int, typer.Option(help="at most N per queue")] = 100,
    amqp_url: AmqpOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List dead-lettered messages and why each was refused (through the API: operators only)."""
    target = api_or_dsn(amqp_url)
    if isinstance(target, str):
        rows = _direct_list(target, queue, limit)
    else:
        with target:
            rows = target.get("/api/v1/dlq", queue=queue, limit=limit)
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("queue", "message id", "first publisher", "reason", "bytes")
    for r in rows:
        table.add_row(cell(r["queue"]), cell(r["message_id"]), cell(r.get("publisher") or "(none)"),
                      cell(r["reason"][:100]), str(r["bytes"]))
    console.print(table)


@dlq_app.command("replay")
def replay_dead_letters(
    queue: Annotated[str, typer.Option(help="consumer queue whose dead letters to replay")],
    limit: Annotated[int, typer.Option(help="at most N messages")] = 1000,
    amqp_url: AmqpOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish dead letters back to their original exchange/routing key, after you fixed the cause, each judged as
    its first publisher; those that cannot be (none recorded, too large) stay and are listed (through the API:
    operators only)."""
    target = api_or_dsn(amqp_url)
    if isinstance(target, str):
        done = _direct_replay(target, queue, limit)
    else:
        with target:
            done = target.post(f"/api/v1/dlq/{queue}/replay?limit={limit}")
    if as_json:
        print(json.dumps(done))
        return
    for letter in done["messages"]:
        err.print(f"replayed {cell(letter['message_id'])} -> {cell(letter['exchange'])}/{cell(letter['routing_key'])}")
    for skipped in done.get("skipped", []):
        err.print(f"kept {cell(skipped['letter']['message_id'])}: {cell(skipped['why'])}")
    if done.get("stopped"):
        err.print(cell(done["stopped"]))
    print(f"replayed {done['replayed']} message(s)")
