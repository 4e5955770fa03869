"""Arrays and dependencies in the contract: Slurm's index syntax, its limits, the task ids, and the bounds of
``depends_on``."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import (
    ArraySpec,
    CancelJob,
    JobSpec,
    ProcessRun,
    SetArrayParallelism,
    array_task_id,
    parse_array,
    parse_indices,
    route,
)
from gpuorch_contracts.arrays import MAX_ARRAY_TASKS, indices_text
from pydantic import ValidationError

RUN = ProcessRun(argv=["python", "sweep.py"])


@pytest.mark.parametrize(("text", "indices"), [
    ("0-49", list(range(50))),
    ("1,3,5-9", [1, 3, 5, 6, 7, 8, 9]),
    ("0-99:10", list(range(0, 100, 10))),
    ("5-9,1,3", [1, 3, 5, 6, 7, 8, 9]),
    ("0-10,5-20", list(range(21))),          # overlapping parts name each index once
    ("0-9:2,1-9:2", list(range(10))),
    ("7", [7]),
])
def test_indices_in_slurms_syntax(text: str, indices: list[int]) -> None:
    assert [i for r in parse_indices(text) for i in r] == indices
    assert [i for r in parse_indices(indices_text(parse_indices(text))) for i in r] == indices


@pytest.mark.parametrize(("text", "reason"), [
    ("9-1", "empty"), ("1-5:0", "empty"), ("a-b", "is not N"), ("1--2", "is not N"),
    (f"0-{MAX_ARRAY_TASKS}", "at most"), ("0-10000000", "above the largest index"),
])
def test_indices_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_indices(text)


def test_parallelism_after_a_percent_sign_and_the_task_ids() -> None:
    assert parse_array("0-11%3") == ArraySpec(indices="0-11", parallelism=3)
    assert parse_array("0-11").parallelism is None and ArraySpec(indices="0-99:10").task_count == 10
    with pytest.raises(ValueError):
        parse_array("0-11%x")
    array_id = uuid.uuid4()
    assert array_task_id(array_id, 3) == array_task_id(array_id, 3) != array_task_id(array_id, 4)


def test_depends_on_is_bounded_and_the_steering_messages_route_on_the_submit_exchange() -> None:
    deps = [{"job_id": str(uuid.uuid4())} for _ in range(64)]
    spec = JobSpec.model_validate({"run": RUN.model_dump(), "depends_on": deps})
    assert {d.condition for d in spec.depends_on} == {"afterok"}
    with pytest.raises(ValidationError, match="at most 64"):
        JobSpec.model_validate({"run": RUN.model_dump(), "depends_on": [*deps, deps[0]]})
    with pytest.raises(ValidationError):
        JobSpec.model_validate({"run": RUN.model_dump(), "depends_on": [{"condition": "after", "job_id": deps[0]["job_id"]}]})
    with pytest.raises(ValidationError):
        CancelJob(job_id=uuid.uuid4(), array_tasks="all")
    assert route(SetArrayParallelism(job_id=uuid.uuid4(), parallelism=4, tenant="acme")) == (
        "gpuorch.submit", "job.array_set.acme")
