"""Reading the API's live streams: Server-Sent Events into dicts, and the state a job event implies.

    sse_events(lines, deadline, opened) -> {"type": ..., "data": {...}} per event; comments (": keepalive")
        skipped; ``opened()`` is called at the API's first comment (the stream's queue is bound: what happens from
        then on is delivered); ends at the deadline (checked as lines arrive: keepalives come every 15 s)
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def sse_events(lines: Iterable[str], deadline: float | None = None,
               opened: Callable[[], None] | None = None) -> Iterator[dict[str, Any]]:
    event_type, data = "message", ""
    for line in lines:
        if deadline is not None and time.monotonic() > deadline:
            return
        if line.startswith(":"):
            if opened is not None:
                opened()
                opened = None
            continue
        if not line:
            if data:
                try:
                    yield {"type": event_type, "data": json.loads(data)}
                except ValueError:
                    pass
            event_type, data = "message", ""
        elif line.startswith("event:"):
            event_type = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


def state_after(event_type: str, data: dict[str, Any]) -> str | None:
    """The state a job is in after an event, when the event alone says so. A watcher may read the job before the
    scheduler has applied the event (an executor's ``job.finished`` reaches both at once), so the event wins."""
    if event_type == "job.started":
        return "running"
    if event_type == "job.finished":
        return "succeeded" if data.get("exit_code") == 0 else "failed"
    return {"job.failed": "failed", "job.cancelled": "cancelled", "job.rejected": "rejected"}.get(event_type)


def following(what: str) -> Callable[[], None]:
    """``sse_events``'s ``opened``: says on stderr that the stream is open (what happens from now on is shown)."""
    def say() -> None:
        print(f"following {what} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    return say
