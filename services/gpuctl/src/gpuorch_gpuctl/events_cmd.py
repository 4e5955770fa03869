"""gpuctl events: what happened to your tenants' jobs and to the fleet, as ``kubectl get events`` shows it.

    gpuctl events                  GET /api/v1/events/recent?since=1h   the newest logged events and telemetry's
                                                                        detections (alerts), oldest first
    gpuctl events --job ID         GET /api/v1/jobs/ID                  one job's timeline
    gpuctl events -f [--job ID]    GET /api/v1/events (Server-Sent Events): live ones (with --job: that job's,
                                   after its timeline)
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from gpuorch_gpuctl.api_client import api
from gpuorch_gpuctl.output import JsonOpt
from gpuorch_gpuctl.output import console as output_console
from gpuorch_gpuctl.terminal_text import markup
from gpuorch_gpuctl.watch import following, sse_events

console = output_console()


def events(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="then print events live as they happen")] = False,
    job: Annotated[str | None, typer.Option(help="one job's events: its timeline (then live ones with -f)")] = None,
    since: Annotated[str, typer.Option(help="without --job: how far back to list (30m, 12h, 7d)")] = "1h",
    limit: Annotated[int, typer.Option(min=1, max=1000, help="without --job: at most N, the newest")] = 100,
    count: Annotated[int, typer.Option(help="stop after this many live events (0: never)")] = 0,
    timeout: Annotated[float, typer.Option(help="stop following after this many seconds (0: never)")] = 0.0,
    as_json: JsonOpt = False,
) -> None:
    """Events of your tenants' jobs and of the fleet: the recent ones (--since, --limit), a job's timeline (--job),
    then live ones (--follow)."""
    with api() as client:
        job_id = None
        if job is not None:
            described = client.get(f"/api/v1/jobs/{job}")
            job_id = described["id"]
            for item in described.get("timeline", []):
                _print_event(item["type"], item, item.get("at"), as_json)
        elif not follow:
            for item in reversed(client.get("/api/v1/events/recent", since=since, limit=limit)):
                _print_event(item["type"], item, item.get("at"), as_json)
        if not follow:
            return
        seen = 0
        deadline = time.monotonic() + timeout if timeout else None
        for event in sse_events(client.stream_lines("/api/v1/events"), deadline, following("events")):
            data = event["data"]
            if job_id is not None and data.get("job_id") != job_id:
                continue
            _print_event(event["type"], data, data.get("occurred_at"), as_json)
            seen += 1
            if count and seen >= count:
                return


def _print_event(event_type: str, data: dict[str, Any], at: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"type": event_type, **data}, default=str), flush=True)
        return
    keys = ("job_id", "tenant", "node_id", "reason", "pending_reason", "exit_code", "kind", "explanation")
    detail = " ".join(f"{k}={str(data[k])[:80]}" for k in keys if data.get(k) is not None)
    console.print(f"{markup(str(at or '')[:19])}  {markup(event_type):<22} {markup(detail)}", soft_wrap=True)
