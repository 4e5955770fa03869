"""``trusted`` and ``maker`` build what ``model_construct`` builds, and refuse unknown or missing fields."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from gpuorch_contracts import GpuAllocation, JobPlaced, NodeAssignment
from gpuorch_policy.trusted import maker, trusted


def _same(made: object, built: object) -> None:
    assert type(made) is type(built)
    assert made.__dict__ == built.__dict__
    assert made.model_fields_set == built.model_fields_set  # type: ignore[attr-defined]
    assert made.model_dump_json() == built.model_dump_json()  # type: ignore[attr-defined]


def test_maker_equals_model_construct_and_trusted() -> None:
    gpu = maker(GpuAllocation, ("gpu_uuid", "gpu_index", "milli", "memory_mib"))("GPU-a", 3, 500, 1024)
    _same(gpu, GpuAllocation.model_construct(gpu_uuid="GPU-a", gpu_index=3, milli=500, memory_mib=1024))
    assignment = maker(NodeAssignment, ("node_id", "gpus"))("node-1", [gpu])
    _same(assignment, trusted(NodeAssignment, node_id="node-1", gpus=[gpu]))
    values = {"message_id": uuid.uuid4(), "occurred_at": datetime(2026, 1, 1, tzinfo=UTC), "job_id": uuid.uuid4(),
              "placement_id": uuid.uuid4(), "assignments": [assignment]}
    placed = maker(JobPlaced, tuple(values))(*values.values())
    _same(placed, JobPlaced.model_construct(**values))
    validated = JobPlaced.model_validate_json(placed.model_dump_json())
    assert validated.__dict__ == placed.__dict__ and validated.model_dump_json() == placed.model_dump_json()


def test_maker_refuses_unknown_missing_or_repeated_names() -> None:
    with pytest.raises(TypeError):
        maker(GpuAllocation, ("gpu_uuid", "gpu_index", "no_such_field"))
    with pytest.raises(TypeError):
        maker(NodeAssignment, ("gpus",))
    with pytest.raises(TypeError):
        maker(NodeAssignment, ("node_id", "gpus", "gpus"))
    with pytest.raises(TypeError):
        maker(NodeAssignment, ("node_id", "gpus"))("node-1")  # a value short
