"""Admission with a margin: any spec that validates fits every message it causes (issue 12).

The largest admissible ``SubmitJob`` is built field by field up to ``MAX_SPEC_BYTES``, with the characters that
grow most when encoded (quotes and backslashes double, 4-byte UTF-8); the ``JobAccepted`` and ``LaunchJob`` built
from it, with every other field at its own maximum, must still be at most ``MAX_MESSAGE_BYTES``. The largest gang
likewise yields a ``JobPlaced`` that fits.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from gpuorch_contracts import (
    MAX_GANG_GPUS,
    MAX_GANG_NODES,
    MAX_MESSAGE_BYTES,
    MAX_SPEC_BYTES,
    Checkpoint,
    Gang,
    GpuAllocation,
    GpuRequest,
    JobAccepted,
    JobPlaced,
    JobSpec,
    LaunchJob,
    ModelHints,
    NodeAssignment,
    ProcessRun,
    SubmitJob,
    decode,
    encode,
)
from pydantic import ValidationError

LONGEST_TIME = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=-23, minutes=-59)))
ENVELOPE = {"producer": "p" * 128, "schema_version": 1000, "occurred_at": LONGEST_TIME}
EXPANDING = '"\\🚀'
"""Each character here costs 2 (quote, backslash) or 4 (emoji) bytes in JSON: argv and env filled with them."""


def _largest_spec_fields(target_bytes: int = MAX_SPEC_BYTES) -> dict[str, Any]:
    """Fields of a spec whose JSON is at most ``target_bytes`` and within a few bytes of it: every scalar at its
    longest, labels and GPU models full, then env values and argv elements of expanding characters, then ASCII."""
    fields: dict[str, Any] = dict(
        name="n" * 128, tenant="t" * 63, tier="training", priority_class="critical",
        resources=GpuRequest(gpus=8, gpu_models=["m" * 128] * 32), cpu_milli=1_024_000, memory_mib=16_777_216,
        gang=Gang(nodes=MAX_GANG_NODES), preemptible=True, runtime_estimate_s=99_999_999.123456,
        max_runtime_s=99_999_999.123456, max_requeues=100, checkpoint=Checkpoint(signal="SIGUSR2", grace_s=3599.999),
        model=ModelHints(parameter_count=10**13, dtype="bf16"),
        labels={f"label-{i:02d}".ljust(128, "x"): "v" * 256 for i in range(64)},
    )
    env: dict[str, str] = {}
    argv: list[str] = []

    def size() -> int:
        run = ProcessRun.model_construct(argv=argv, env=env, workdir="w" * 1024)
        return len(encode(JobSpec.model_construct(**fields, run=run)))

    expanding = (EXPANDING * 2048)[:4096]
    while len(env) < 128:
        env[f"ENV_{len(env):03d}".ljust(128, "X")] = expanding
        if size() > target_bytes:
            env.popitem()
            break
    while len(argv) < 256:
        argv.append(expanding)
        if size() > target_bytes:
            argv.pop()
            break
    while len(argv) < 256 and (left := target_bytes - size() - 3) > 0:  # 3: the quotes and comma of one more
        argv.append("a" * min(left, 4096))
    return {**fields, "run": ProcessRun.model_construct(argv=argv, env=env, workdir="w" * 1024)}


@pytest.fixture(scope="module")
def largest_spec() -> JobSpec:
    fields = _largest_spec_fields()
    spec = JobSpec(**{**fields, "run": ProcessRun(**dict(fields["run"]))})  # validates: it is admissible
    assert MAX_SPEC_BYTES - 64 <= len(encode(spec)) <= MAX_SPEC_BYTES
    return spec


def _largest_allocations(count: int) -> list[GpuAllocation]:
    return [GpuAllocation(gpu_uuid=f"MIG-{i:04d}".ljust(96, "f"), gpu_index=1024, milli=1000, memory_mib=16_777_216,
                          mig_profile="p" * 32) for i in range(count)]


def test_the_largest_admissible_submission_fits_every_message_it_causes(largest_spec: JobSpec) -> None:
    submit = SubmitJob(spec=largest_spec, **ENVELOPE)  # type: ignore[arg-type]
    submitted = encode(submit)
    assert len(submitted) <= MAX_MESSAGE_BYTES
    admitted = decode(submitted)
    assert isinstance(admitted, SubmitJob)
    accepted = JobAccepted(job_id=admitted.job_id, spec=admitted.spec, **ENVELOPE)  # type: ignore[arg-type]
    launch = LaunchJob(node_id="n" * 128, job_id=admitted.job_id, placement_id=uuid.uuid4(), spec=admitted.spec,
                       gpus=_largest_allocations(64), gang_rank=MAX_GANG_NODES - 1, gang_size=MAX_GANG_NODES,
                       **ENVELOPE)  # type: ignore[arg-type]
    sizes = {type(m).__name__: len(encode(m)) for m in (submit, accepted, launch)}
    assert all(size <= MAX_MESSAGE_BYTES for size in sizes.values()), sizes
    assert sizes["LaunchJob"] > MAX_SPEC_BYTES  # the spec really is inside it
    for message in (accepted, launch):
        assert decode(encode(message)) == message


def test_one_byte_more_is_refused_with_the_reason(largest_spec: JobSpec) -> None:
    raw = largest_spec.model_dump()
    left = MAX_SPEC_BYTES - len(encode(largest_spec))
    raw["run"]["argv"][-1] = "a" * min(4096, len(raw["run"]["argv"][-1]) + left + 1)
    with pytest.raises(ValidationError, match=f"at most {MAX_SPEC_BYTES}"):
        JobSpec.model_validate(raw)


def test_a_body_under_the_limit_with_a_spec_over_it_is_refused() -> None:
    """The body limit alone would admit it; its LaunchJob would then be over the limit (the 260,911 bytes case)."""
    body = encode(SubmitJob.model_construct(spec=JobSpec.model_construct(**_largest_spec_fields(MAX_SPEC_BYTES + 2048))))
    assert len(body) <= MAX_MESSAGE_BYTES
    with pytest.raises(ValidationError, match="bytes as JSON"):
        decode(body)


def test_the_largest_gang_fits_its_placement_message() -> None:
    per_node = MAX_GANG_GPUS // MAX_GANG_NODES
    spec = JobSpec(run=ProcessRun(argv=["x"]), resources=GpuRequest(gpus=per_node), gang={"nodes": MAX_GANG_NODES})
    placed = JobPlaced(job_id=uuid.uuid4(), placement_id=uuid.uuid4(), **ENVELOPE,  # type: ignore[arg-type]
                       assignments=[NodeAssignment(node_id=f"{i:04d}".ljust(128, "n"),
                                                   gpus=_largest_allocations(per_node))
                                    for i in range(spec.gang.nodes)])
    assert len(encode(placed)) <= MAX_MESSAGE_BYTES


@pytest.mark.parametrize(("nodes", "gpus"), [(MAX_GANG_NODES + 1, 1), (MAX_GANG_NODES, 9), (17, 64)])
def test_a_gang_larger_than_one_placement_message_is_refused(nodes: int, gpus: int) -> None:
    with pytest.raises(ValidationError):
        JobSpec(run=ProcessRun(argv=["x"]), resources=GpuRequest(gpus=gpus), gang={"nodes": nodes})
