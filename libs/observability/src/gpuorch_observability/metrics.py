"""Prometheus ``/metrics`` endpoint per service (prometheus-client's default registry)."""

from __future__ import annotations

from prometheus_client import start_http_server


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread; port 0 disables it."""
    if port:
        start_http_server(port, addr=addr)
