"""OpenTelemetry tracing whose context rides in AMQP headers (W3C traceparent).

Configuration follows the OpenTelemetry SDK's environment variables, read by every service:

- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL, ``/v1/traces``
  appended): where spans go over OTLP/HTTP (protobuf). ``GPUORCH_OTLP_ENDPOINT`` (a base URL) is kept as an alias and
  wins when set; none of them set: nothing is exported (spans are still made, so logs carry trace ids).
  ``OTEL_EXPORTER_OTLP_HEADERS``/``_TIMEOUT``/``_COMPRESSION`` are read by the exporter itself.
- ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true``: no export.
- ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` override the resource below.
- ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (read by the SDK; default ``parentbased_always_on``).
- ``OTEL_BSP_*``: the batch span processor's queue and delays (read by the SDK).

Resource (semantic conventions): ``service.name`` = ``gpuorch-<service>``, ``service.namespace`` = ``gpuorch``,
``service.instance.id`` (the instance name given, else the host name, with the process id), ``service.version``
(the installed version of the service's package), ``host.name``, ``process.pid``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping, MutableMapping
from importlib import metadata
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False
_exporting = False


def otlp_traces_endpoint(alias: str | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP traces URL from ``alias`` (a base URL; else GPUORCH_OTLP_ENDPOINT) or the standard variables;
    None when export is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return None
    alias = alias or env.get("GPUORCH_OTLP_ENDPOINT")
    if alias:
        return _traces_url(alias)
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _traces_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return None


def _traces_url(base: str) -> str:
    endpoint = base.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def service_resource(service: str, instance: str | None = None, version: str | None = None) -> Resource:
    """The resource of a gpuorch process by the conventions; ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES``
    override it."""
    name = service if service.startswith("gpuorch-") else f"gpuorch-{service}"
    host = socket.gethostname()
    ours = Resource({
        "service.name": name, "service.namespace": "gpuorch",
        "service.instance.id": f"{instance or host}/{os.getpid()}",
        "service.version": version or _version_of(name), "host.name": host, "process.pid": os.getpid(),
    })
    return Resource.create({}).merge(ours).merge(OTELResourceDetector().detect())


def _version_of(distribution: str) -> str:
    for name in (distribution, distribution.replace("-", "_"), "gpuorch-observability"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return "unknown"


def configure_tracing(service: str, otlp_endpoint: str | None = None, *, instance: str | None = None) -> None:
    """Install a tracer provider once per process (see the module doc for what is read from the environment);
    ``otlp_endpoint`` is the ``GPUORCH_OTLP_ENDPOINT`` alias (a collector base URL, e.g. ``http://jaeger:4318``)."""
    global _configured, _exporting
    if _configured:
        return
    provider = TracerProvider(resource=service_resource(service, instance))
    endpoint = otlp_traces_endpoint(otlp_endpoint)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        _exporting = True
    trace.set_tracer_provider(provider)
    _configured = True


def shutdown_tracing() -> None:
    """Export what is buffered and stop (a process that ends otherwise than by returning from its main)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracing_exported() -> bool:
    """Whether spans leave this process. Spans made only for an operator's eyes (one per job of a batch) are
    skipped when this is False, so tracing off costs nothing in the scheduler's hot loop."""
    return _exporting


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


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` naming ``span`` (what a message published about its work carries)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def epoch_ns(seconds: float) -> int:
    """Seconds since the epoch (``time.time()``) as a span timestamp."""
    return int(seconds * 1e9)


def _start_job_span(name: str, job_id: object, traceparent: str | None, attributes: Mapping[str, Any] | None,
                    start_s: float | None, tracer_name: str, kind: trace.SpanKind) -> trace.Span:
    parent = extract_trace({"traceparent": traceparent}) if traceparent else context.Context()
    return tracer(tracer_name).start_span(name, context=parent, kind=kind,
                                          attributes={"job_id": str(job_id), **(attributes or {})},
                                          start_time=epoch_ns(start_s) if start_s is not None else None)


@contextlib.contextmanager
def job_span(name: str, job_id: object, traceparent: str | None, *, attributes: Mapping[str, Any] | None = None,
             start_s: float | None = None, tracer_name: str = "gpuorch",
             kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> Iterator[trace.Span]:
    """A span in a job's trace: child of ``traceparent`` (the job's trace context; a new trace when None), with
    ``job_id`` set, not made current (a batch handles many jobs at once); ``start_s``: when the work began (epoch
    seconds). Ends on exit, with the error status if an exception escapes."""
    span = _start_job_span(name, job_id, traceparent, attributes, start_s, tracer_name, kind)
    try:
        yield span
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, repr(exc)))
        raise
    finally:
        span.end()


def record_job_span(name: str, job_id: object, traceparent: str | None, start_s: float, end_s: float | None = None,
                    attributes: Mapping[str, Any] | None = None, tracer_name: str = "gpuorch") -> str | None:
    """A finished span in a job's trace from ``start_s`` to ``end_s`` (now when None), both epoch seconds: work
    measured after the fact (a job's run, a commit shared by a batch). Returns its ``traceparent`` (what is
    published about that work carries it, so it joins the trace below the span)."""
    span = _start_job_span(name, job_id, traceparent, attributes, start_s, tracer_name, trace.SpanKind.INTERNAL)
    span.end(end_time=epoch_ns(end_s) if end_s is not None else None)
    return traceparent_of(span)
