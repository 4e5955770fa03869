"""Contract rules: strict models, bounds, routing, and checked-in schemas that match the models."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    MESSAGE_TYPES,
    GpuRequest,
    JobSpec,
    LaunchJob,
    ProcessRun,
    SubmitJob,
    UnknownMessageType,
    decode,
    encode,
    route,
)
from gpuorch_contracts.schemas import asyncapi_document, message_schemas
from pydantic import ValidationError

SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "print(42)"]))
SCHEMAS = Path(__file__).parents[1] / "schemas"


def test_round_trip_of_every_registered_type_name() -> None:
    message = SubmitJob(spec=SPEC)
    assert decode(encode(message)) == message
    assert all(cls.model_fields["type"].default == name for name, cls in MESSAGE_TYPES.items())


def test_unknown_field_is_refused() -> None:
    raw = json.loads(encode(SubmitJob(spec=SPEC)))
    raw["spec"]["gpus_please"] = 8
    with pytest.raises(ValidationError, match="gpus_please"):
        decode(json.dumps(raw))


def test_bounds_are_enforced() -> None:
    with pytest.raises(ValidationError):
        ProcessRun(argv=["x"] * 257)
    with pytest.raises(ValidationError):
        GpuRequest(gpu_milli=1000)
    with pytest.raises(ValidationError):
        JobSpec(run=ProcessRun(argv=["python"]), tenant="bad tenant name with spaces")


def test_only_one_gpu_shape() -> None:
    with pytest.raises(ValidationError, match="only one"):
        GpuRequest(gpus=1, gpu_milli=500)


def test_unknown_type_and_non_object() -> None:
    with pytest.raises(UnknownMessageType):
        decode(b'{"type": "job.teleport"}')
    with pytest.raises(UnknownMessageType):
        decode(b"[1, 2]")


def test_commands_route_by_node() -> None:
    launch = LaunchJob(node_id="node-7", job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=SPEC)
    assert route(launch) == (COMMANDS_EXCHANGE, "node.node-7.launch_job")


def test_checked_in_schemas_match_the_models() -> None:
    for name, schema in message_schemas().items():
        path = SCHEMAS / f"{name}.schema.json"
        assert path.exists(), f"missing {path}: run gpuctl schema export"
        assert json.loads(path.read_text()) == json.loads(json.dumps(schema)), f"{path} is stale"
    assert json.loads((SCHEMAS / "asyncapi.json").read_text()) == asyncapi_document()


def test_job_events_route_per_tenant_and_bindings_match_both_forms() -> None:
    from gpuorch_contracts import JobAccepted, JobStarted, event_binding, tenant_binding

    job_id, placement_id = uuid.uuid4(), uuid.uuid4()
    started = JobStarted(job_id=job_id, placement_id=placement_id, node_id="n1", tenant="acme")
    assert route(started) == (EVENTS_EXCHANGE, "job.started.acme")
    assert route(started.model_copy(update={"tenant": None})) == (EVENTS_EXCHANGE, "job.started")
    spec = JobSpec.model_validate({"tenant": "team-b", "run": {"runtime": "process", "argv": ["python"]}})
    assert route(JobAccepted(job_id=job_id, spec=spec)) == (EVENTS_EXCHANGE, "job.accepted.team-b")
    assert event_binding("job.started") == "job.started.#" and event_binding("node.heartbeat") == "node.heartbeat"
    assert tenant_binding("acme") == "job.*.acme" and tenant_binding("acme", "job.rejected") == "job.rejected.acme"
    with pytest.raises(ValidationError):
        JobStarted(job_id=job_id, placement_id=placement_id, node_id="n1", tenant="a.b")  # one word of a key
