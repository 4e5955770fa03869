"""``gpuctl reserve``: advance reservations through the API (create and delete: operators; list and show: anyone,
for their tenants).

    reserve create --gpus 16 [--model h100] [--nodes n1,n2] --start 2026-12-10T14:00Z|now+2h --duration 4h --tenant X
        -> POST /api/v1/reservations; then waits a moment for the scheduler's answer (the nodes, or why refused)
    reserve list [--all]  -> GET /api/v1/reservations      reserve show ID  -> GET /api/v1/reservations/{id}
    reserve delete ID     -> DELETE /api/v1/reservations/{id}

Mounted as ``gpuctl reserve`` by lazy.py.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.api_client import api
from gpuorch_gpuctl.errors import fail
from gpuorch_gpuctl.output import Column, Format, JsonOpt, NoHeadersOpt, OutputOpt, chosen, dump, emit
from gpuorch_gpuctl.output import console as output_console
from gpuorch_gpuctl.terminal_text import cell
from gpuorch_report.period import parse_since

reserve_app = typer.Typer(help="Advance reservations: GPUs promised to a tenant for a window (operators create).",
                          no_args_is_help=True)
console = output_console()

COLUMNS = [
    Column("id", lambda r: str(r["reservation_id"])[:8]), Column("tenant", lambda r: cell(r["tenant"])),
    Column("gpus", lambda r: str(r["gpus"])), Column("model", lambda r: cell(r["gpu_model"] or "any")),
    Column("nodes", lambda r: cell(",".join(r["nodes"]) or "-")),
    Column("start", lambda r: cell(str(r["start_at"] or "-"))), Column("end", lambda r: cell(str(r["end_at"] or "-"))),
    Column("state", lambda r: r["state"]),
    Column("problems", lambda r: cell("; ".join(r["problems"]) or r.get("reason") or "-")),
]


@reserve_app.callback()
def _group() -> None:
    """Advance reservations: GPUs promised to a tenant for a window (operators create)."""


def parse_start(text: str, now: datetime) -> datetime:
    """``now``, ``now+DURATION`` (``now+2h``, ``now+30m``, ``now+1d``) or an ISO 8601 time (UTC without a zone)."""
    value = text.strip()
    if value == "now":
        return now
    if value.startswith("now+"):
        return now + parse_since(value[4:])
    when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@reserve_app.command("create")
def create(
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs to reserve (whole nodes are reserved)")],
    start: Annotated[str, typer.Option("--start", help="ISO 8601 time (UTC without a zone), now or now+DURATION")],
    duration: Annotated[str, typer.Option("--duration", help="how long: 30m, 4h, 2d")],
    tenant: Annotated[str, typer.Option("--tenant", help="the tenant it is for")],
    model: Annotated[str | None, typer.Option("--model", help="GPU model (substring, any case: h100)")] = None,
    nodes: Annotated[str | None, typer.Option("--nodes", help="choose among these nodes only (comma-separated)")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Reserve GPUs for a tenant from --start for --duration (operators). Until the start, backfill may use them
    with jobs that end in time or can checkpoint and leave."""
    try:
        start_at = parse_start(start, datetime.now(UTC))
        duration_s = parse_since(duration).total_seconds()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    body = {"tenant": tenant, "gpus": gpus, "gpu_model": model, "start_at": start_at.isoformat(),
            "duration_s": duration_s, "nodes": [n for n in (nodes or "").split(",") if n]}
    with api() as client:
        answer = client.post("/api/v1/reservations", body)
        found = None
        for _ in range(20):  # the scheduler's answer reaches the read model within a batch or two
            found = client.find(f"/api/v1/reservations/{answer['reservation_id']}")
            if found is not None:
                break
            time.sleep(0.25)
    if as_json:
        print(json.dumps(found or answer, default=str))
    elif found is None:
        console.print(f"reservation {answer['reservation_id']} requested; the scheduler has not answered yet "
                      f"(gpuctl reserve show {answer['reservation_id']})")
    elif found["state"] != "refused":
        console.print(f"reservation {found['reservation_id']}: {found['gpus']} GPUs for {cell(found['tenant'])} on "
                      f"{cell(', '.join(found['nodes']))}, {found['start_at']} to {found['end_at']} ({found['state']})")
    if found is not None and found["state"] == "refused":  # a result that is a failure: printed, then errors.py's line
        fail(f"reservation {found['reservation_id']} refused: {found['reason'] or 'no reason given'}")


@reserve_app.command("list")
def list_(
    show_all: Annotated[bool, typer.Option("--all", help="also ended, deleted and refused ones")] = False,
    output: OutputOpt = Format.table, no_headers: NoHeadersOpt = False, as_json: JsonOpt = False,
) -> None:
    """Reservations of your tenants (operators: all): window, nodes, state, and why one cannot be honoured."""
    with api() as client:
        rows = client.get("/api/v1/reservations", ended=show_all or None)
    emit(rows, COLUMNS, chosen(output, as_json), no_headers=no_headers, out=console)


def _resolve(client: Any, reference: str) -> str:
    """A reservation's full id from its id or a unique prefix of it (as ``list`` shows it)."""
    if len(reference) == 36:
        return reference
    matches = [r["reservation_id"] for r in client.get("/api/v1/reservations", ended=True)
               if str(r["reservation_id"]).startswith(reference)]
    if len(matches) != 1:
        fail(f"{'no' if not matches else 'more than one'} reservation whose id starts with {reference!r}")
    return str(matches[0])


@reserve_app.command("show")
def show(reservation_id: Annotated[str, typer.Argument(help="the reservation's id (or a unique prefix)")],
         as_json: JsonOpt = False) -> None:
    """One reservation: tenant, GPUs, nodes, window, state, problems."""
    with api() as client:
        found: dict[str, Any] = client.get(f"/api/v1/reservations/{_resolve(client, reservation_id)}")
    if as_json:
        dump(found, Format.json)
        return
    for key in ("reservation_id", "tenant", "gpus", "gpu_model", "nodes", "start_at", "end_at", "created_by",
                "state", "reason", "problems"):
        console.print(f"{key:15} {cell(str(found.get(key)))}")


@reserve_app.command("delete")
def delete(reservation_id: Annotated[str, typer.Argument(help="the reservation's id (or a unique prefix)")],
           reason: Annotated[str, typer.Option(help="why (kept with it)")] = "deleted by an operator",
           as_json: JsonOpt = False) -> None:
    """Delete a reservation (operators): its nodes are open to every tenant again."""
    with api() as client:
        reservation_id = _resolve(client, reservation_id)
        answer = client.delete(f"/api/v1/reservations/{reservation_id}", reason=reason)
    print(json.dumps(answer) if as_json else f"deletion of {reservation_id} requested")
