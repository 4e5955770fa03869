"""The job page's trace link searches Jaeger for the attribute the services set on a job's spans, in a service
that has a span of every job: if either side is renamed, this fails."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import pytest
from gpuorch_api.routes import trace_url
from gpuorch_observability import job_span, tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

JOB = uuid.UUID("0b6f2a8e-3c1d-4e5f-9a7b-2c3d4e5f6a7b")
SUBMITTED = datetime(2026, 12, 1, 10, tzinfo=UTC)


def test_the_link_is_a_jaeger_ui_search_by_tags_over_the_jobs_lifetime() -> None:
    link = trace_url("http://jaeger:16686/", JOB, SUBMITTED, SUBMITTED + timedelta(hours=1))
    assert link is not None
    parts = urlsplit(link)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "jaeger:16686", "/search")
    query = {k: v[0] for k, v in parse_qs(parts.query, strict_parsing=True).items()}
    assert json.loads(query["tags"]) == {"job_id": str(JOB)}  # JSON, as Jaeger UI's search form sends tags
    assert query["lookback"] == "custom"
    assert int(query["start"]) == int((SUBMITTED - timedelta(minutes=1)).timestamp() * 1e6)  # microseconds
    assert int(query["end"]) == int((SUBMITTED + timedelta(hours=1, minutes=5)).timestamp() * 1e6)
    assert "{" not in parts.query and " " not in parts.query  # encoded
    assert trace_url(None, JOB, SUBMITTED) is None


def test_the_link_names_the_attribute_and_the_service_of_the_jobs_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=tracing.service_resource("scheduler"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda name: provider.get_tracer(name))
    with job_span("scheduler.admit", JOB, None):  # the scheduler's span of every admitted job
        pass
    [span] = exporter.get_finished_spans()
    link = trace_url("http://jaeger:16686", JOB, SUBMITTED)
    assert link is not None
    query = {k: v[0] for k, v in parse_qs(urlsplit(link).query).items()}
    assert query["service"] == span.resource.attributes["service.name"]
    searched = json.loads(query["tags"])
    assert {key: (span.attributes or {}).get(key) for key in searched} == searched
