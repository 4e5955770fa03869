"""Logs, traces and metrics for every gpuorch process.

- ``configure(service, ...)``: structlog JSON logs on stderr carrying ``trace_id``/``span_id`` of the current span
  and any bound context (``job_id``, ``node_id``); OpenTelemetry tracing exported over OTLP/HTTP when an endpoint
  is given (otherwise spans are still created, so trace ids appear in logs, but nothing is exported).
- ``inject_trace(headers)`` / ``extract_trace(headers)``: W3C ``traceparent`` in AMQP headers.
- ``start_metrics_server(port)``: Prometheus ``/metrics``.
"""

from gpuorch_observability.logs import bind_context, configure_logging, get_logger
from gpuorch_observability.metrics import start_metrics_server
from gpuorch_observability.tracing import configure_tracing, extract_trace, inject_trace, tracer


def configure(service: str, *, log_level: str = "INFO", otlp_endpoint: str | None = None) -> None:
    """Set up logging and tracing for a process named ``service`` (idempotent)."""
    configure_tracing(service, otlp_endpoint)
    configure_logging(service, log_level)


__all__ = [
    "bind_context", "configure", "configure_logging", "configure_tracing", "extract_trace", "get_logger",
    "inject_trace", "start_metrics_server", "tracer",
]
