"""Interactive sessions through the Harness: parked when idle (and only then), resumed on request, and parked
state that a scheduler rebuilt from the log (failover) keeps."""

from __future__ import annotations

from gpuorch_contracts import (
    ChangeSession,
    Checkpoint,
    ExecutorHeartbeat,
    GpuLive,
    GpuRequest,
    JobRequeued,
    JobSpec,
    NodeHeartbeat,
    ProcessRun,
    RunningPlacement,
    SessionParked,
    SessionSpec,
)
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduling import journal
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.sessions import SessionPolicy
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Input
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "-m", "http.server", "$(GPUORCH_PORT)"])


def session(park_after_s: float | None = 20.0) -> JobSpec:
    return JobSpec(run=RUN, tier="interactive", resources=GpuRequest(gpus=1),
                   session=SessionSpec(idle_park_after_s=park_after_s))


def beats(h: Harness, until: float, *, util: float = 0.0, idle_s: float | None = None, every: float = 5.0) -> None:
    """Node and executor heartbeats of node n0 every ``every`` s up to ``until``: GPU utilisation ``util``; each
    running session reports ``idle_s`` (None: the time since its start, as an executor with no traffic does)."""
    t = h.now

    def beat() -> None:
        h.scheduler.node_heartbeat("n0", h.now, [GpuLive(index=0, utilization_pct=util),
                                                 GpuLive(index=1, utilization_pct=util)])
        running = [RunningPlacement(placement_id=j.placement_id, job_id=j.job_id,
                                    idle_s=idle_s if idle_s is not None else h.now - (
                                        h.now if j.started_at is None else j.started_at))
                   for j in h.state.active.values() if j.placement_id is not None]
        h.scheduler.executor_heartbeat(ExecutorHeartbeat(node_id="n0", sequence=1, fencing_deadline_s=60,
                                                         interval_s=every, running=running), h.now)

    while t <= until:
        h.at(t, beat)
        t += every


def started(h: Harness) -> Harness:
    h.add_node(registered_node("n0", gpus=2).inventory)
    return h


def test_an_idle_session_is_parked_its_gpu_freed_and_resumed_on_request() -> None:
    h = started(Harness(keep_steps=True))
    job = h.submit(session(20.0))
    beats(h, 60.0)
    h.run(until=60.0)
    record = h.state.jobs[job.job_id]
    assert record.state == "parked", record
    assert not h.state.active and not h.state.queued
    assert h.state.capacity_violations() == []
    parked = [e for e in h.logged() if isinstance(e, SessionParked)]
    assert len(parked) == 1 and parked[0].gpus == 1.0 and parked[0].node_id == "n0"
    assert "idle for" in parked[0].reason
    h.change_session(job.job_id, "resume", at=61.0)
    h.run(until=62.0)
    assert h.state.jobs[job.job_id].state == "running"
    assert [e for e in h.logged() if isinstance(e, JobRequeued)][-1].reason == "resumed"
    (park,) = h.state.jobs[job.job_id].parks  # [parked at, resumed at, GPUs]: the report's GPU-hours given back
    assert park[1] == 61.0 and park[2] == 1.0 and park[0] is not None and 20.0 < park[0] < 61.0


def test_traffic_or_a_busy_gpu_keeps_a_session_running() -> None:
    h = started(Harness(keep_steps=True))
    busy_gpu = h.submit(session(10.0))
    beats(h, 60.0, util=35.0)
    h.run(until=60.0)
    assert h.state.jobs[busy_gpu.job_id].state == "running"
    h2 = started(Harness(keep_steps=True))
    used = h2.submit(session(10.0))
    beats(h2, 60.0, idle_s=2.0)  # a request every few seconds through the proxy
    h2.run(until=60.0)
    assert h2.state.jobs[used.job_id].state == "running"


def test_without_heartbeats_nothing_is_parked_and_the_tenant_default_applies() -> None:
    h = started(Harness(keep_steps=True))
    job = h.submit(session(10.0))
    h.run(until=120.0)  # no evidence of idleness: no park
    assert h.state.jobs[job.job_id].state == "running"
    policy = SessionPolicy(idle_park_after_s=1800.0, by_tenant={"*": 15.0})
    h2 = started(Harness(SchedulerConfig(sessions=policy), keep_steps=True))
    default = h2.submit(session(None))
    beats(h2, 40.0)
    h2.run(until=40.0)
    assert h2.state.jobs[default.job_id].state == "parked"


def test_a_parked_session_survives_failover_and_resumes_on_the_new_leader() -> None:
    h = started(Harness(keep_steps=True))
    job = h.submit(session(20.0))
    beats(h, 60.0)
    h.run(until=60.0)
    assert h.state.jobs[job.job_id].state == "parked"
    # the standby rebuilds its state from the log alone (and from a snapshot of it), then takes over
    rebuilt = SchedulerState()
    for position, event in enumerate(h.logged(), 1):
        rebuilt.position = position
        rebuilt.apply(event)
    assert rebuilt.jobs[job.job_id].state == "parked"
    from_snapshot = SchedulerState.from_snapshot(rebuilt.to_snapshot())
    assert from_snapshot.jobs[job.job_id].state == "parked"
    assert not from_snapshot.active and not from_snapshot.queued
    assert from_snapshot.gpu_usage() == {}
    leader = Scheduler(SchedulerConfig(), from_snapshot)
    leader.recovered(from_snapshot, lease_now=61.0)
    leader.node_heartbeat("n0", 61.0)
    step = leader.step([Input(ChangeSession(job_id=job.job_id, action="resume"))], 62.0, tick=True)
    assert any(isinstance(e, JobRequeued) and e.reason == "resumed" for e, _ in step.events)
    assert leader.state.jobs[job.job_id].state == "placed"


def test_park_and_resume_are_the_owners_or_an_operators() -> None:
    h = started(Harness(keep_steps=True))
    job = h.submit(session(None))
    h.run(until=5.0)
    h.change_session(job.job_id, "park", at=6.0)
    h.run(until=10.0)
    assert h.state.jobs[job.job_id].state == "parked"
    h.change_session(job.job_id, "park", at=11.0)  # parking a parked session changes nothing
    h.change_session(job.job_id, "resume", at=12.0)
    h.change_session(job.job_id, "resume", at=12.5)  # nor resuming a queued one
    h.run(until=15.0)
    assert h.state.jobs[job.job_id].state == "running"
    assert sum(isinstance(e, JobRequeued) for e in h.logged()) == 1


def test_a_session_preempts_preemptible_batch_work_of_its_own_priority_after_its_grace() -> None:
    h = started(Harness(keep_steps=True))
    batch = [h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=1), preemptible=True,
                              checkpoint=Checkpoint(grace_s=5))) for _ in range(2)]
    training = h.submit(JobSpec(run=RUN, tier="training", resources=GpuRequest(gpus=1), preemptible=True), at=30.0)
    h.run(until=10.0)
    assert all(h.state.jobs[j.job_id].state == "running" for j in batch)
    nb = h.submit(session(None), at=11.0)
    h.run(until=11.5)
    assert sum(h.state.jobs[j.job_id].state == "preempting" for j in batch) == 1
    assert h.state.jobs[nb.job_id].state == "queued"  # waits for the victim's checkpoint
    h.run(until=20.0)
    assert h.state.jobs[nb.job_id].state == "running"
    h.run(until=40.0)  # a training job of the same priority may not take the session's GPU
    assert h.state.jobs[training.job_id].state == "queued" and h.state.jobs[nb.job_id].state == "running"


def test_per_user_caps_from_the_identity_map() -> None:
    identities = IdentityMap(identities={
        "alice": Identity(role="submitter", tenants=["lab"], default_tenant="lab", max_sessions=2,
                          max_session_gpus=1.5)})
    h = started(Harness(SchedulerConfig(identity=identities), keep_steps=True))
    first = h.submit(session(None), sender="alice")
    h.run(until=2.0)
    assert h.state.jobs[first.job_id].spec.session.owner == "alice"  # type: ignore[union-attr]
    over_gpus = h.submit(session(None), sender="alice", at=3.0)
    share = h.submit(session(None).model_copy(update={"resources": GpuRequest(gpu_milli=500)}), sender="alice",
                     at=3.0)
    h.run(until=5.0)
    assert over_gpus.state == "rejected" and "cap of 1.5" in (over_gpus.reason or "")
    assert h.state.jobs[share.job_id].state == "running"
    third = h.submit(JobSpec(run=RUN, tier="interactive", resources=GpuRequest(gpu_milli=100)), sender="alice",
                     at=6.0)
    h.run(until=7.0)
    assert third.state == "rejected" and "2 live session(s)" in (third.reason or "")
    h.change_session(first.job_id, "park", at=8.0, sender="alice")  # a parked session does not count
    h.run(until=12.0)
    fourth = h.submit(session(None), sender="alice", at=13.0)
    h.run(until=14.0)
    assert h.state.jobs[fourth.job_id].state == "running"
    h.change_session(first.job_id, "resume", at=15.0, sender="alice")  # over the caps again: refused
    h.run(until=16.0)
    assert h.state.jobs[first.job_id].state == "parked"


def test_the_journal_keeps_what_idleness_is_judged_by() -> None:
    beat = NodeHeartbeat(node_id="n0", inventory_hash="h", sequence=1,
                         gpus=[GpuLive(index=0, utilization_pct=0.0), GpuLive(index=1, utilization_pct=50.0)])
    replayed = Scheduler()
    journal.play(replayed, [journal.renewed_entry(beat, 7.0)])
    assert replayed.idle_sessions.gpu_idle_from == {("n0", 0): 7.0}
