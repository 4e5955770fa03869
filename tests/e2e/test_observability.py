"""Observability end to end: one job's life is one trace across services; JSON logs carry trace and job ids;
each service serves Prometheus metrics."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl.stack import LocalStack
from gpuorch_observability import configure_tracing, inject_trace, tracer
from gpuorch_scheduler.testing import registered_node
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.harness import nodes_online, publish_when_routable, wait_jobs_terminal

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class FakeCollector:
    """An OTLP/HTTP endpoint (what Jaeger listens on at :4318) that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service, trace id, span name)
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    service = next((a.value.string_value for a in resource_spans.resource.attributes
                                    if a.key == "service.name"), "?")
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            collector.spans.append((service, span.trace_id.hex(), span.name))
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


async def test_one_job_is_one_trace_across_services_with_ids_in_logs_and_metrics(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    collector = FakeCollector()
    metrics_port = _free_port()
    stack.extra_env["GPUORCH_OTLP_ENDPOINT"] = collector.url
    stack.start_scheduler(GPUORCH_METRICS_PORT=str(metrics_port))
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    configure_tracing("test-submitter")
    async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=1)]) as broker:
        submit = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["python", "-c", "pass"])))
        with tracer().start_as_current_span("submit") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            await publish_when_routable(broker, submit)
            assert inject_trace({})["traceparent"].split("-")[1] == trace_id
        await wait_jobs_terminal(pg_dsn, [submit.job_id])
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    stack.stop_all()  # flushes the services' span exporters

    in_trace = {(service.split("/")[0], name) for service, tid, name in collector.spans if tid == trace_id}
    services = {service for service, _ in in_trace}
    assert {"scheduler", "executor"} <= services, collector.spans
    assert ("scheduler", "consume job.submit") in in_trace
    assert ("executor", "consume launch_job") in in_trace
    assert ("scheduler", "consume job.finished") in in_trace, "the executor's report joined the job's trace"

    log_lines = [json.loads(line) for line in stack.processes["scheduler-1"].log_path.read_text().splitlines()
                 if line.startswith("{")]
    handled = [line for line in log_lines if line.get("event") == "message.handled"
               and line.get("job_id") == str(submit.job_id)]
    assert handled and all(line["trace_id"] == trace_id for line in handled)
    assert "gpuorch_scheduler_placements_total 1.0" in scraped
    assert 'gpuorch_messages_consumed_total{queue="scheduler.submit",type="job.submit"} 1.0' in scraped
