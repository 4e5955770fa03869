"""The allow-lists of gpuorch's queues against each forged message of issue 11 (pure: no broker)."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import (
    ApplyMigLayout,
    JobFailed,
    JobSpec,
    JobStarted,
    LaunchJob,
    Message,
    MigGpuLayout,
    NodeHeartbeat,
    NodeInventory,
    NodeRegistered,
    StopJob,
    SubmissionRejected,
    SubmitJob,
)
from gpuorch_contracts.nodes import ExecutorHeartbeat
from gpuorch_messaging import (
    executor_accepts,
    node_agent_accepts,
    refusal,
    scheduler_accepts,
    telemetry_accepts,
)

JOB, PLACEMENT = uuid.uuid4(), uuid.uuid4()
SPEC = JobSpec.model_validate({"run": {"runtime": "process", "argv": ["python"]}})
FAILED = JobFailed(job_id=JOB, placement_id=PLACEMENT, node_id="node-1", cause="killed", reason="x")
STARTED = JobStarted(job_id=JOB, placement_id=PLACEMENT, node_id="node-1", log_path="/etc/shadow")
REGISTERED = NodeRegistered(inventory=NodeInventory(node_id="node-9", cpu_milli=1, memory_mib=1), inventory_hash="h")
LAUNCH = LaunchJob(node_id="node-1", job_id=JOB, placement_id=PLACEMENT, spec=SPEC)
STOP = StopJob(node_id="node-1", job_id=JOB, placement_id=PLACEMENT)
MIG = ApplyMigLayout(node_id="node-1", layouts=[MigGpuLayout(gpu_index=0)])
HEARTBEAT = NodeHeartbeat(node_id="node-1", inventory_hash="h", sequence=1)
EXECUTOR_BEAT = ExecutorHeartbeat(node_id="node-1", sequence=1, fencing_deadline_s=60, interval_s=5)

SCHEDULER, TELEMETRY, EXECUTOR, NODE_AGENT = (scheduler_accepts(), telemetry_accepts(), executor_accepts(),
                                               node_agent_accepts())


@pytest.mark.parametrize(("accepts", "message", "user", "reason"), [
    # the attacks
    (SCHEDULER, FAILED, "acme-ci", "(role submitter) refused"),         # job.failed as a submission
    (SCHEDULER, FAILED, "executor-node-2", "is not a node executor-node-2 speaks for"),
    (SCHEDULER, REGISTERED, "executor-node-9", "only node-agent"),      # a node that does not exist
    (SCHEDULER, REGISTERED, "node-agent-node-1", "is not a node node-agent-node-1 speaks for"),
    (SCHEDULER, STARTED, "node-agent-node-1", "only executor"),         # a forged log_path
    (SCHEDULER, STARTED, "executor-node-2", "is not a node"),
    (SCHEDULER, HEARTBEAT, "executor-node-1", "only node-agent"),
    (SCHEDULER, EXECUTOR_BEAT, "node-agent-node-1", "only executor"),
    (SCHEDULER, LAUNCH, "scheduler", "does not take launch_job"),
    (EXECUTOR, LAUNCH, "gpuctl-operator", "only scheduler"),             # forged LaunchJob
    (EXECUTOR, STOP, "executor-node-1", "only scheduler"),
    (EXECUTOR, FAILED, "scheduler", "does not take job.failed"),
    (NODE_AGENT, MIG, "gpuctl-operator", "only scheduler"),              # forged ApplyMigLayout
    (TELEMETRY, FAILED, "acme-ci", "refused"),
    (TELEMETRY, SubmitJob(spec=SPEC), "acme-ci", "does not take job.submit"),
    # what each may say
    (SCHEDULER, FAILED, "executor-node-1", None),
    (SCHEDULER, FAILED.model_copy(update={"node_id": None}), "scheduler", None),  # an undeliverable launch
    (SCHEDULER, REGISTERED, "node-agent-node-9", None),
    (SCHEDULER, SubmitJob(spec=SPEC), "acme-ci", None),
    (SCHEDULER, EXECUTOR_BEAT, "executor-node-1", None),
    (EXECUTOR, LAUNCH, "scheduler", None),
    (EXECUTOR, STOP, "scheduler-b", None),
    (NODE_AGENT, MIG, "scheduler", None),
    (TELEMETRY, STARTED, "executor-node-1", None),
    # telemetry binds job.#: a SubmissionRejected reaches it and must not be dead-lettered there
    (TELEMETRY, SubmissionRejected(size_bytes=1, reason="r", tenant="acme"), "scheduler", None),
    (TELEMETRY, SubmissionRejected(size_bytes=1, reason="r", tenant="acme"), "acme-ci", "refused"),
])
def test_allow_lists(accepts: dict[str, tuple[object, ...]], message: Message, user: str, reason: str | None) -> None:
    refused = refusal(accepts, message, user, queue="q")  # type: ignore[arg-type]
    if reason is None:
        assert refused is None
    else:
        assert refused is not None and reason in refused, refused
