"""OpenTelemetry tracing whose context rides in AMQP headers (W3C traceparent)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False


def configure_tracing(service: str, otlp_endpoint: str | None = None) -> None:
    """Install a tracer provider once per process; export over OTLP/HTTP when ``otlp_endpoint`` is set.

    ``otlp_endpoint`` is the collector base URL (e.g. ``http://jaeger:4318``); spans go to ``/v1/traces``.
    """
    global _configured
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _configured = True


_TRACERS: dict[tuple[str, int], trace.Tracer] = {}


def tracer(name: str = "gpuorch") -> trace.Tracer:
    """The named tracer of the current provider (cached: building one costs more than a span, and consumers ask
    for it once per message)."""
    key = (name, id(trace.get_tracer_provider()))
    found = _TRACERS.get(key)
    if found is None:
        found = _TRACERS[key] = trace.get_tracer(name)
    return found


def inject_trace(headers: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Write the current span's ``traceparent`` (and ``tracestate``) into ``headers``; returns them."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers.update(carrier)
    return headers


def extract_trace(headers: Mapping[str, Any] | None) -> context.Context:
    """Context of the remote parent span carried in ``headers`` (empty context when absent)."""
    carrier = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in (headers or {}).items()
               if k in ("traceparent", "tracestate")}
    return propagate.extract(carrier)
