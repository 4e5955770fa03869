"""A job's output through the gpuorch API (logs live on the nodes; only the API reaches them, with each node's own
credential), for systems that submit with ``GpuorchClient``:

    async for line in job_logs(api_url, token, job_id, since="10m", tail=100, timestamps=True, follow=True): ...

``since``: a duration back (``"30s"``, ``"10m"``, a ``timedelta``) or a time (``"2026-12-05T09:00"``, UTC without a
zone; a ``datetime``): only lines written since then, as their node saw them written (at most about a second late).
``tail``: only the last N lines (of those since); ``timestamps``: each line starts with its time (RFC 3339, UTC) and
a space; ``follow``: go on until the job ends. Lines come without their newline. A refusal (401, 404: no such job
or not the caller's, 422, 503: the node does not serve logs) raises ``LogsRefused`` before the first line.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import httpx

__all__ = ["LogsRefused", "job_logs"]


class LogsRefused(RuntimeError):
    """The API's refusal: ``status`` and its one-line ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


async def job_logs(api_url: str, token: str, job_id: uuid.UUID | str, *,
                   since: str | timedelta | datetime | None = None, tail: int | None = None,
                   timestamps: bool = False, follow: bool = False, node: str | None = None,
                   connect_timeout_s: float = 10.0) -> AsyncIterator[str]:
    """The job's log lines as they come (see the module docstring)."""
    params: dict[str, str] = {}
    if isinstance(since, timedelta):
        params["since"] = f"{since.total_seconds():g}s"
    elif isinstance(since, datetime):
        params["since"] = since.isoformat()
    elif since is not None:
        params["since"] = since
    if tail is not None:
        params["tail"] = str(tail)
    if timestamps:
        params["timestamps"] = "true"
    if follow:
        params["follow"] = "true"
    if node is not None:
        params["node"] = node
    timeout = httpx.Timeout(connect_timeout_s, read=None if follow else 60.0)
    async with httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"}) as http, \
            http.stream("GET", f"/api/v1/jobs/{job_id}/logs", params=params) as response:
        if response.status_code != 200:
            body = await response.aread()
            try:
                detail = str(response.json().get("detail") or response.json().get("error") or body.decode())
            except ValueError:
                detail = body.decode(errors="replace")
            raise LogsRefused(response.status_code, detail.strip())
        async for line in response.aiter_lines():
            yield line
