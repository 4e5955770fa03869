"""gpuctl's pre-API paths (decision 31), apart from the thin client: ``submit``/``cancel --amqp-url`` publish to
the broker directly (with a ``gpuctl <type>`` span, the root of the job's trace), and ``--dsn`` reads the read
models (jobs_view.py). The thin client reaches these through ``gpuorch_gpuctl.lazy.ops_module``.

    checked_spec(spec)                 the spec as a JobSpec; raises pydantic's ValidationError
    submit(spec, amqp_url, otlp)       publish SubmitJob with confirms; the job id
    cancel(job_id, reason, amqp_url, dsn, otlp)   resolve the id in the read model, publish CancelJob; the full id
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpuorch_gpuctl.errors import fail

from gpuorch_gpuctl_ops import jobs_view


def checked_spec(spec: dict[str, Any]) -> Any:
    """``spec`` validated as ``gpuorch_contracts.JobSpec`` (raises ``pydantic.ValidationError``)."""
    from gpuorch_contracts import JobSpec

    return JobSpec.model_validate(spec)


def submit(spec: Any, amqp_url: str, otlp_endpoint: str | None) -> str:
    """Publish SubmitJob for the checked ``spec``; its job id."""
    from gpuorch_contracts import SubmitJob

    message = SubmitJob(spec=spec, producer="gpuctl")
    asyncio.run(publish(amqp_url, message, otlp_endpoint))
    return str(message.job_id)


def cancel(job_id: str, reason: str, amqp_url: str, dsn: str, otlp_endpoint: str | None) -> str:
    """Publish CancelJob for the job ``job_id`` (an id or a unique prefix) names in the read model; its full id."""
    from gpuorch_contracts import CancelJob

    full = asyncio.run(jobs_view.resolve_id(dsn, job_id))
    asyncio.run(publish(amqp_url, CancelJob(job_id=full, reason=reason, producer="gpuctl"), otlp_endpoint))
    return str(full)


async def publish(amqp_url: str, message: Any, otlp_endpoint: str | None) -> None:
    """Publish with confirms inside a ``gpuctl <type>`` span: the root of the job's trace in Jaeger."""
    from gpuorch_messaging import Broker, PublishError, TopologyMissing
    from gpuorch_observability import configure_tracing, tracer
    from opentelemetry import trace

    configure_tracing("gpuctl", otlp_endpoint)
    # a submit-only broker user (gpuctl-submit) may not declare exchanges: look them up only
    broker = Broker(amqp_url, producer="gpuctl", publish_timeout_s=15, declare_topology=False, topology_wait_s=5)
    try:
        await broker.connect(timeout_s=10)
        with tracer("gpuctl").start_as_current_span(f"gpuctl {message.TYPE}", kind=trace.SpanKind.PRODUCER,
                                                      attributes={"gpuorch.job_id": str(message.job_id)}):
            await broker.publish(message)
    except (PublishError, ConnectionError, TopologyMissing) as exc:
        fail(f"not submitted: {exc} (is the scheduler running?)")
    finally:
        await broker.close()
        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(5000)
