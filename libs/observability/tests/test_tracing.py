"""Which collector a process exports to, and the resource it names itself with, follow the OTEL_* variables."""

from __future__ import annotations

import pytest
from gpuorch_observability.tracing import otlp_traces_endpoint, service_resource


@pytest.mark.parametrize(("alias", "env", "expected"), [
    (None, {}, None),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, "http://jaeger:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318/",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/custom"}, "http://other:4318/custom"),
    (None, {"GPUORCH_OTLP_ENDPOINT": "http://old:4318"}, "http://old:4318/v1/traces"),
    ("http://given:4318/v1/traces", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"},
     "http://given:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
    ("http://given:4318", {"OTEL_SDK_DISABLED": "true"}, None),
])
def test_the_traces_endpoint_follows_the_standard_variables_and_the_alias(
        alias: str | None, env: dict[str, str], expected: str | None) -> None:
    assert otlp_traces_endpoint(alias, env) == expected


def test_the_resource_follows_the_conventions_and_the_environment_overrides_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    ours = service_resource("scheduler", "scheduler-2").attributes
    assert ours["service.name"] == "gpuorch-scheduler" and ours["service.namespace"] == "gpuorch"
    assert str(ours["service.instance.id"]).startswith("scheduler-2/") and ours["service.version"]
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sched-eu")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,service.instance.id=pod-7")
    theirs = service_resource("scheduler", "scheduler-2").attributes
    assert theirs["service.name"] == "sched-eu" and theirs["service.instance.id"] == "pod-7"
    assert theirs["deployment.environment"] == "prod"
