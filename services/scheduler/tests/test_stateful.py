"""Hypothesis stateful test of SchedulerService against the real PostgreSQL.

Random submits (whole GPUs, shares, MIG, gangs; priorities, tenants with quotas, preemptible or not), node
registrations and heartbeats, clock jumps (nodes turn suspect and lost), starts, finishes, failures, preemption
confirmations, cancels and scheduler crash-restarts (a new service on a new connection that recovers from the log).
After every step: no capacity is exceeded, no accepted job is lost, and the state rebuilt from the log equals the
live state.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime

import asyncpg
import pytest
from gpuorch_contracts import (
    TERMINAL_STATES,
    CancelJob,
    GpuRequest,
    JobFailed,
    JobFinished,
    JobSpec,
    JobStarted,
    NodeHeartbeat,
    ProcessRun,
    SubmitJob,
)
from gpuorch_scheduler.handlers import Persistence, SchedulerService
from gpuorch_scheduling import LivenessPolicy
from gpuorch_scheduling.queueing import QueuePolicy, Quota
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.testing import registered_node
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytestmark = pytest.mark.integration

RUN = ProcessRun(argv=["python", "-c", "pass"])
NODE_IDS = ("n0", "n1", "n2", "n3")
RESOURCES = st.sampled_from([
    GpuRequest(gpus=1), GpuRequest(gpus=2), GpuRequest(gpus=4), GpuRequest(gpu_milli=300),
    GpuRequest(gpu_milli=700), GpuRequest(gpu_memory_mib=20000), GpuRequest(mig_profiles=["1g.10gb"]),
    GpuRequest(),
])
CONFIG = SchedulerConfig(
    liveness=LivenessPolicy(suspect_after_s=15, lost_after_s=90),
    queues=QueuePolicy({"capped": Quota(gpus=2)}),
    preemption_margin_s=60,
)
PERSISTENCE = Persistence(snapshot_every_events=7)
TABLES = "events, snapshots, outbox, jobs, nodes"


class SchedulerMachine(RuleBasedStateMachine):
    dsn: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 1_900_000_000.0
        self.submitted = 0
        self.conn: asyncpg.Connection | None = None
        self.service: SchedulerService | None = None
        self.accepted: set[uuid.UUID] = set()
        self.registered: set[str] = set()
        self.silent: set[str] = set()

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def clock(self) -> float:
        return self.now

    def at(self) -> datetime:
        return datetime.fromtimestamp(self.now, UTC)

    @initialize()
    def start(self) -> None:
        self.conn = self.run(asyncpg.connect(self.dsn))
        self.run(self.conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY"))
        self.service = SchedulerService(self.conn, CONFIG, clock=self.clock, persistence=PERSISTENCE)
        self.run(self.service.recover())
        for node_id in NODE_IDS[:2]:  # a small fleet from the start, so that most histories place jobs
            self.registered.add(node_id)
            self.run(self.svc.handle(registered_node(node_id, gpus=2, mig=node_id == "n1")))

    def teardown(self) -> None:
        if self.conn is not None:
            self.run(self.conn.close())
        self.loop.close()

    @property
    def svc(self) -> SchedulerService:
        assert self.service is not None
        return self.service

    # -- fleet ------------------------------------------------------------------------------------------------

    @rule(node_id=st.sampled_from(NODE_IDS), gpus=st.integers(1, 4), mig=st.booleans(), nvlink=st.booleans())
    def register(self, node_id: str, gpus: int, mig: bool, nvlink: bool) -> None:
        links = [(a, b) for a in range(gpus) for b in range(a + 1, gpus)] if nvlink else []
        if node_id in self.registered:  # a node keeps its hardware; re-registration renews it
            known = self.svc.state.nodes.get(node_id)
            if known is not None:
                self.run(self.svc.handle(registered_node(node_id, gpus=len(known.inventory.gpus),
                                                         mig=known.inventory.gpus[0].mig_enabled,
                                                         nvlink=[tuple(p) for p in known.inventory.nvlink_pairs])))  # type: ignore[misc]
                self.silent.discard(node_id)
                return
        self.registered.add(node_id)
        self.silent.discard(node_id)
        self.run(self.svc.handle(registered_node(node_id, gpus=gpus, mig=mig, nvlink=links)))

    @rule(node_id=st.sampled_from(NODE_IDS))
    def go_silent(self, node_id: str) -> None:
        self.silent.add(node_id)

    @rule(seconds=st.sampled_from([1.0, 20.0, 100.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        for node_id in self.registered - self.silent:
            self.svc.heartbeat(NodeHeartbeat(node_id=node_id, inventory_hash="x", sequence=1))
        self.run(self.svc.tick())

    # -- jobs -------------------------------------------------------------------------------------------------

    @rule(resources=RESOURCES, gang=st.sampled_from([1, 1, 1, 2]),
          priority=st.sampled_from(["low", "normal", "high", "critical"]),
          tenant=st.sampled_from(["default", "capped"]), preemptible=st.booleans(),
          estimate=st.sampled_from([None, 60.0, 3600.0]), max_requeues=st.sampled_from([0, 1, 3]))
    def submit(self, resources: GpuRequest, gang: int, priority: str, tenant: str, preemptible: bool,
               estimate: float | None, max_requeues: int) -> None:
        if gang > 1 and resources.kind == "share":
            gang = 1
        spec = JobSpec(run=RUN, resources=resources, gang={"nodes": gang}, priority_class=priority,  # type: ignore[arg-type]
                       tenant=tenant, preemptible=preemptible, runtime_estimate_s=estimate,
                       max_requeues=max_requeues, checkpoint={"grace_s": 10})  # type: ignore[arg-type]
        self.submitted += 1  # ids and times from the history alone, so that hypothesis can replay it
        message = SubmitJob(job_id=uuid.uuid5(uuid.NAMESPACE_OID, str(self.submitted)), spec=spec)
        self.run(self.svc.handle(message))
        if message.job_id in self.svc.state.jobs:
            self.accepted.add(message.job_id)

    def _jobs_in(self, *states: str) -> list[uuid.UUID]:
        return sorted((j.job_id for j in self.svc.state.jobs.values() if j.state in states), key=str)

    @precondition(lambda self: self.service is not None and self._jobs_in("placed"))
    @rule(pick=st.integers(0, 100))
    def executor_starts(self, pick: int) -> None:
        ids = self._jobs_in("placed")
        job = self.svc.state.jobs[ids[pick % len(ids)]]
        for a in job.assignments:
            self.run(self.svc.handle(JobStarted(job_id=job.job_id, placement_id=job.placement_id,  # type: ignore[arg-type]
                                                node_id=a.node_id, occurred_at=self.at())))

    def _ending(self) -> list[uuid.UUID]:
        """Jobs an executor may report ended: running, being preempted, or cancelled and still stopping."""
        return sorted((j.job_id for j in self.svc.state.jobs.values()
                       if j.state in ("running", "preempting") or j.stopping_nodes), key=str)

    @precondition(lambda self: self.service is not None and self._ending())
    @rule(pick=st.integers(0, 100), outcome=st.sampled_from(["finished", "failed", "stopped"]))
    def executor_reports_end(self, pick: int, outcome: str) -> None:
        ids = self._ending()
        job = self.svc.state.jobs[ids[pick % len(ids)]]
        node_id = job.assignments[0].node_id
        if outcome == "finished":
            event = JobFinished(job_id=job.job_id, placement_id=job.placement_id, node_id=node_id,  # type: ignore[arg-type]
                                exit_code=0, duration_s=1, occurred_at=self.at())
            self.run(self.svc.handle(event))
            return
        for a in job.assignments:
            stopped = outcome == "stopped"
            event = JobFailed(job_id=job.job_id, placement_id=job.placement_id, node_id=a.node_id,  # type: ignore[arg-type]
                              cause="killed" if stopped else "nonzero_exit", reason="test", exit_code=1,
                              stop_reason="preempt" if stopped else None, occurred_at=self.at())
            self.run(self.svc.handle(event))
            self.run(self.svc.handle(event))  # redelivered

    @precondition(lambda self: self.service is not None and bool(self.accepted))
    @rule(pick=st.integers(0, 100))
    def cancel(self, pick: int) -> None:
        ids = sorted(self.accepted, key=str)
        self.run(self.svc.handle(CancelJob(job_id=ids[pick % len(ids)])))

    @rule()
    def crash_and_restart(self) -> None:
        assert self.conn is not None
        self.conn.terminate()  # the old leader's session dies with it
        self.conn = self.run(asyncpg.connect(self.dsn))
        self.service = SchedulerService(self.conn, CONFIG, clock=self.clock, persistence=PERSISTENCE)
        self.run(self.service.recover())

    # -- invariants -------------------------------------------------------------------------------------------

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        if self.service is not None:
            assert self.svc.state.capacity_violations() == []

    @invariant()
    def no_accepted_job_is_lost(self) -> None:
        if self.service is None:
            return
        known = {"queued", "placed", "running", "preempting", *TERMINAL_STATES}
        for job_id in self.accepted:
            job = self.svc.state.jobs.get(job_id)
            assert job is not None, f"accepted job {job_id} vanished"
            assert job.state in known
            assert bool(job.assignments) == job.holds_capacity or job.state in TERMINAL_STATES

    @invariant()
    def state_rebuilt_from_the_log_equals_the_live_state(self) -> None:
        if self.service is None or self.conn is None:
            return
        rebuilt = SchedulerService(self.conn, CONFIG, clock=self.clock, persistence=PERSISTENCE)
        self.run(rebuilt.recover())
        assert rebuilt.state.to_snapshot() == self.svc.state.to_snapshot()
        assert json.loads(self.svc.state.snapshot_json()) == self.svc.state.to_snapshot()  # the cached JSON is fresh


@pytest.mark.timeout(600)  # 20 histories of 60 steps against PostgreSQL: about 40 s alone, minutes on a busy machine
def test_random_histories_keep_the_invariants(pg_dsn: str) -> None:
    from gpuorch_store import migrate

    asyncio.run(migrate(pg_dsn))
    SchedulerMachine.dsn = pg_dsn
    runner = SchedulerMachine.TestCase
    runner.settings = settings(max_examples=int(os.environ.get("GPUORCH_STATEFUL_EXAMPLES", "20")), stateful_step_count=60, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner("runTest").runTest()


def test_a_tick_that_loses_a_node_and_times_out_its_preemption_commits(pg_dsn: str) -> None:
    """The history the random ones found: a preempted job's node is declared lost by the tick that also finds its
    stop past the grace. Both parts requeue it (one decision id); the tick must log it once and commit."""
    from gpuorch_store import migrate

    asyncio.run(migrate(pg_dsn))
    SchedulerMachine.dsn = pg_dsn
    machine = SchedulerMachine()
    try:
        machine.start()
        machine.submit(GpuRequest(gpus=2), 1, "low", "default", True, None, 0)
        [victim] = machine._jobs_in("placed")
        node_id = machine.svc.state.jobs[victim].assignments[0].node_id
        machine.submit(GpuRequest(gpus=2), 1, "critical", "default", False, None, 0)
        assert machine.svc.state.jobs[victim].state == "preempting"
        machine.go_silent(node_id)
        machine.time_passes(100.0)  # past lost_after_s (90) and the grace + margin (10 + 60)
        assert machine.svc.state.nodes[node_id].liveness == "lost"
        assert machine.svc.state.jobs[victim].state in ("queued", "placed")
        assert machine.svc.state.jobs[victim].preemptions == 1
        machine.state_rebuilt_from_the_log_equals_the_live_state()
    finally:
        machine.teardown()
