"""An operator's SetJobPriority on the Harness: the queue follows the new class, a submitter's is ignored with why,
and the change survives a rebuild from the log."""

from __future__ import annotations

import uuid

from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SetJobPriority
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def spec(name: str) -> JobSpec:
    return JobSpec(name=name, run=RUN, tenant="lab", resources=GpuRequest(gpus=1))


def test_an_operator_moves_a_waiting_job_back_and_a_submitter_may_not() -> None:
    identity = IdentityMap(identities={
        "ops": Identity(role="operator", tenants=["*"]),
        "alice": Identity(role="submitter", tenants=["lab"], default_tenant="lab"),
    })
    h = Harness(SchedulerConfig(identity=identity), keep_steps=True)
    h.add_node(registered_node("n0", gpus=1).inventory)
    blocker = h.submit(spec("blocker"), at=0.5, runtime_s=100, sender="alice")
    first = h.submit(spec("first"), at=1.0, runtime_s=10, sender="alice")
    second = h.submit(spec("second"), at=2.0, runtime_s=10, sender="alice")
    by_alice = SetJobPriority(job_id=first.job_id, priority_class="low", message_id=uuid.uuid4())
    h.send(by_alice, at=3.0, sender="alice")
    by_ops = SetJobPriority(job_id=first.job_id, priority_class="low", message_id=uuid.uuid4())
    h.send(by_ops, at=4.0, sender="ops")
    h.run(until=99.0)
    ignored = {m.message_id: why for step in h.steps for m, why in step.ignored}
    assert "only operators may change a job's priority" in ignored[by_alice.message_id]
    [changed] = [e for e in h.logged() if e.TYPE == "job.priority_changed"]
    assert (changed.job_id, changed.priority_class, changed.previous) == (  # type: ignore[attr-defined]
        first.job_id, "low", "normal")
    assert h.state.jobs[first.job_id].spec.priority_class == "low"
    h.run()
    assert blocker.state == first.state == second.state == "succeeded"
    assert h.state.jobs[second.job_id].started_at < h.state.jobs[first.job_id].started_at  # type: ignore[operator]

    rebuilt = SchedulerState(retention_s=h.scheduler.config.retention_s)
    for event, headers in (pair for step in h.steps for pair in step.events):
        rebuilt.apply(event, headers)
    assert rebuilt.jobs[first.job_id].spec.priority_class == "low"
