"""Reading the API's live streams: Server-Sent Events into dicts, and one job as one line of a watched listing.

    sse_events(lines, deadline, opened) -> {"type": ..., "data": {...}} per event; comments (": keepalive")
        skipped; ``opened()`` is called at the API's first comment (the stream's queue is bound: what happens from
        then on is delivered); ends at the deadline (checked as lines arrive: keepalives come every 15 s)
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_MARKUP = re.compile(r"\[/?[a-z ]*\]")


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


def job_row_line(job: dict[str, Any], cells: Iterable[Callable[[dict[str, Any]], str]]) -> str:
    """A job as one plain line of space-separated cells (rich markup removed), for ``jobs -w``."""
    return "  ".join(_MARKUP.sub("", cell(job)) for cell in cells)


def state_after(event_type: str, data: dict[str, Any]) -> str | None:
    """The state a job is in after an event, when the event alone says so. A watcher may read the job before the
    scheduler has applied the event (an executor's ``job.finished`` reaches both at once), so the event wins."""
    if event_type == "job.started":
        return "running"
    if event_type == "job.finished":
        return "succeeded" if data.get("exit_code") == 0 else "failed"
    return {"job.failed": "failed", "job.cancelled": "cancelled", "job.rejected": "rejected"}.get(event_type)
