"""Logs, traces and metrics for every gpuorch process.

- ``configure(service, ...)``: structlog JSON logs on stderr carrying ``trace_id``/``span_id`` of the current span
  and any bound context (``job_id``, ``node_id``); OpenTelemetry tracing exported over OTLP/HTTP when an endpoint
  is given or set by the standard ``OTEL_*`` variables (otherwise spans are still created, so trace ids appear in
  logs, but nothing is exported); resource ``service.name`` = ``gpuorch-<service>`` (see ``tracing``).
- ``job_span``/``record_job_span``: a span in one job's trace (``job_id`` set), for work done for many jobs at once.
- ``inject_trace(headers)`` / ``extract_trace(headers)``: W3C ``traceparent`` in AMQP headers.
- ``start_metrics_server(port)``: Prometheus ``/metrics``, ``/healthz`` and ``/readyz`` on one port; ``READINESS``
  holds the checks ``/readyz`` answers (``mark``, ``add``, ``connected(broker)``, ``keep_probing``; ``until_up`` waits out a server down at start).
"""

from gpuorch_observability.health import READINESS, Readiness, connected, keep_probing, until_up
from gpuorch_observability.logs import bind_context, configure_logging, get_logger
from gpuorch_observability.metrics import start_metrics_server
from gpuorch_observability.tracing import (
    configure_tracing,
    extract_trace,
    inject_trace,
    job_span,
    record_job_span,
    shutdown_tracing,
    traceparent_of,
    tracer,
    tracing_exported,
)


def configure(service: str, *, log_level: str = "INFO", otlp_endpoint: str | None = None,
              instance: str | None = None) -> None:
    """Set up logging and tracing for a process named ``service`` (``instance``: which one, e.g. ``scheduler-2``;
    idempotent). ``otlp_endpoint`` is the GPUORCH_OTLP_ENDPOINT alias; the OTEL_* variables are read too."""
    configure_tracing(service, otlp_endpoint, instance=instance)
    configure_logging(service, log_level)


__all__ = [
    "READINESS", "Readiness", "bind_context", "connected", "keep_probing", "configure", "configure_logging", "configure_tracing", "extract_trace", "get_logger",
    "inject_trace", "job_span", "record_job_span", "shutdown_tracing", "start_metrics_server", "traceparent_of", "tracer",
    "tracing_exported", "until_up",
]
