"""The API's Prometheus metrics, served at ``/metrics`` on ``GPUORCH_METRICS_PORT`` (an internal port, as every
service's: for the cluster's Prometheus, never on the API's public port).

    gpuorch_api_requests_total{method, route, code}       requests answered, by route template (not raw path)
    gpuorch_api_request_duration_seconds{method, route}   time to the response's start (a stream's start, for
                                                          SSE and followed logs)

Route labels are templates (``/api/v1/jobs/{job_ref}``) so a caller cannot grow the label set; a path no route
matched counts as ``unmatched``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import Response

REQUESTS = Counter("gpuorch_api_requests_total", "HTTP requests the API answered", ["method", "route", "code"])
LATENCY = Histogram("gpuorch_api_request_duration_seconds", "Seconds from a request to its response's start",
                    ["method", "route"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


async def record_request(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """HTTP middleware: count and time every request by its route template."""
    started = time.perf_counter()
    response = await call_next(request)
    route = route_label(request)
    REQUESTS.labels(request.method, route, str(response.status_code)).inc()
    LATENCY.labels(request.method, route).observe(time.perf_counter() - started)
    return response


def route_label(request: Request) -> str:
    """The matched route's template; ``dashboard`` for the static files; else ``unmatched``."""
    route = request.scope.get("route")
    if getattr(route, "name", None) == "dashboard":
        return "dashboard"
    path = getattr(route, "path", "")
    return path if path else "unmatched"
