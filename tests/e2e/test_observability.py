"""Observability end to end: one job's life is one trace across services whose spans explain it (admission, the
decision, the commit, the outbox publish, the launch, the run and its exit code), each carrying the job id, under
resource attributes by the OpenTelemetry conventions; heartbeats are not traced; JSON logs carry trace and job ids;
each service serves Prometheus metrics."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_observability import configure_tracing, inject_trace, tracer
from gpuorch_scheduling.testing import registered_node
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.e2e.harness import nodes_online, publish_when_routable, wait_jobs_terminal

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    resource: dict[str, Any]
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in pairs}


class FakeCollector:
    """An OTLP/HTTP endpoint (what Jaeger listens on at :4318): decodes the protobuf export requests and keeps every
    span it receives."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    resource = _attributes(resource_spans.resource.attributes)
                    for scope in resource_spans.scope_spans:
                        collector.spans.extend(ReceivedSpan(
                            resource.get("service.name", "?"), resource, span.trace_id.hex(), span.span_id.hex(),
                            span.parent_span_id.hex(), span.name, _attributes(span.attributes))
                            for span in scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_one_job_is_one_trace_that_explains_it_with_ids_in_logs_and_metrics(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    collector = FakeCollector()
    metrics_port = _free_port()
    # the standard variable for one service, the gpuorch alias for the other
    stack.start_scheduler(GPUORCH_METRICS_PORT=str(metrics_port), OTEL_EXPORTER_OTLP_ENDPOINT=collector.url)
    stack.start_executor(GPUORCH_OTLP_ENDPOINT=collector.url)
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    configure_tracing("test-submitter")
    async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=1)]) as broker:
        submit = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1),
                                        run=ProcessRun(argv=["python", "-c", "raise SystemExit(3)"])))
        with tracer().start_as_current_span("submit") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            await publish_when_routable(broker, submit)
            assert inject_trace({})["traceparent"].split("-")[1] == trace_id
        await wait_jobs_terminal(pg_dsn, [submit.job_id])
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    stack.stop_all()  # flushes the services' span exporters

    job = [s for s in collector.spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in job}

    def one(service: str, name: str, **attributes: Any) -> ReceivedSpan:
        found = [s for s in job if s.service == service and s.name == name
                 and all(s.attributes.get(k) == v for k, v in attributes.items())]
        assert found, f"no {name} span of {service} with {attributes}: {sorted((s.service, s.name) for s in job)}"
        return found[0]

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        assert span.parent_id in by_id, f"{span.name}'s parent is not in the job's trace"
        return by_id[span.parent_id]

    submitted = one("gpuorch-scheduler", "consume job.submit")
    admitted = one("gpuorch-scheduler", "scheduler.admit", **{"gpuorch.admission": "accepted"})
    assert parent(admitted) is submitted
    decided = one("gpuorch-scheduler", "scheduler.decide", **{"gpuorch.decision": "placed"})
    assert decided.attributes["gpuorch.scheduler.chosen_nodes"] == ["node-1"]
    assert decided.attributes["gpuorch.scheduler.nodes_considered"] == 1 and decided.attributes["gpuorch.scheduler.policy"]
    assert parent(decided) is submitted
    assert parent(one("gpuorch-scheduler", "scheduler.commit")) in (submitted, decided)
    published = one("gpuorch-scheduler", "outbox publish node.node-1.launch_job")
    assert parent(published) is decided, "the LaunchJob was published below the decision that made it"
    consumed = one("gpuorch-executor", "consume launch_job")
    assert parent(consumed) is published
    assert parent(one("gpuorch-executor", "executor.launch", **{"gpuorch.launch": "running"})) is consumed
    run = one("gpuorch-executor", "job.run", **{"gpuorch.exit_code": 3})
    assert parent(run) is consumed and run.attributes["gpuorch.outcome"] == "job.failed"
    reported = one("gpuorch-executor", "outbox publish job.failed.default")
    assert parent(reported) is run, "the outcome was published below the job's run"
    assert parent(one("gpuorch-scheduler", "consume job.failed")) is reported

    job_id = str(submit.job_id)
    assert all(s.attributes.get("job_id") == job_id for s in job if s.service != "gpuorch-test-submitter"), \
        [(s.name, s.attributes.get("job_id")) for s in job]
    resource = submitted.resource
    assert resource["service.instance.id"].startswith("scheduler-1/") and resource["service.version"]
    assert resource["service.namespace"] == "gpuorch"
    assert not [s for s in collector.spans if "heartbeat" in s.name], "heartbeats are not traced one by one"

    log_lines = [json.loads(line) for line in stack.processes["scheduler-1"].log_path.read_text().splitlines()
                 if line.startswith("{")]
    handled = [line for line in log_lines if line.get("event") == "message.handled"
               and line.get("job_id") == job_id]
    assert handled and all(line["trace_id"] == trace_id for line in handled)
    assert "gpuorch_scheduler_placements_total 1.0" in scraped
    assert 'gpuorch_messages_consumed_total{queue="scheduler.submit",type="job.submit"} 1.0' in scraped
