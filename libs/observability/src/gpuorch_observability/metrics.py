"""The HTTP port every service serves its operations endpoints on (``GPUORCH_METRICS_PORT``).

- ``/metrics``: Prometheus text of prometheus-client's default registry (``?name[]=`` restricts it, as
  prometheus-client's own server does), plus whatever ``extra`` renders (telemetry's per-GPU series).
- ``/healthz``: 200 while the process serves requests (liveness: restart it when this stops answering).
- ``/readyz``: 200 when every readiness check passes, else 503; the body (JSON) names each check and why it fails
  (``health.READINESS``: broker connected, database reachable, consuming...).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gpuorch_observability.health import READINESS, Readiness

Extra = Callable[[set[str] | None], bytes]
"""More exposition text for ``/metrics``, given the names asked for (None: all)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        pass


def operations_app(readiness: Readiness = READINESS, extra: Extra | None = None) -> Callable[..., list[bytes]]:
    """The WSGI application behind the port (``start_metrics_server`` serves it)."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            return _answer(start_response, "200 OK", b"ok\n", "text/plain; charset=utf-8")
        if path == "/readyz":
            ready, checks = readiness.report()
            body = json.dumps({"ready": ready, "checks": checks}, sort_keys=True).encode() + b"\n"
            return _answer(start_response, "200 OK" if ready else "503 Service Unavailable", body, "application/json")
        if path in ("/metrics", "/"):
            names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
            registry = REGISTRY.restricted_registry(names) if names else REGISTRY
            body = generate_latest(registry)  # type: ignore[arg-type]
            if extra is not None:
                body += extra(set(names) if names else None)
            return _answer(start_response, "200 OK", body, CONTENT_TYPE_LATEST)
        return _answer(start_response, "404 Not Found", b"not found: /metrics, /healthz, /readyz\n", "text/plain")

    return app


def _answer(start_response: Any, status: str, body: bytes, content_type: str) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def start_metrics_server(port: int, addr: str = "0.0.0.0", *, readiness: Readiness = READINESS,
                         extra: Extra | None = None) -> int:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr:port`` in a daemon thread; port 0 disables it.
    Returns the port served (0 when off)."""
    if not port:
        return 0
    server = make_server(addr, port, operations_app(readiness, extra), _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="operations-http", daemon=True).start()
    return int(server.server_address[1])
