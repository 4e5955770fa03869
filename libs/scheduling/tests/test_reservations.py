"""Advance reservations on the Harness: backfill uses the reserved GPUs until the start, the start is on time with
the GPUs free, only the tenant places there during the window, and a reservation that lost its nodes says so."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

from gpuorch_contracts import CreateReservation, DeleteReservation, GpuRequest, JobSpec, ProcessRun
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduling import LivenessPolicy
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.reservations import borrowed_gpus, status
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])
HOUR = 3600.0


def spec(tenant: str, gpus: int = 1, **fields: object) -> JobSpec:
    return JobSpec(run=RUN, tenant=tenant, resources=GpuRequest(gpus=gpus), **fields)  # type: ignore[arg-type]


def reservation(start: float, gpus: int = 16) -> CreateReservation:
    return CreateReservation(tenant="vip", gpus=gpus, gpu_model="h100", start_at=datetime.fromtimestamp(start, UTC),
                             duration_s=2 * HOUR)


def busy_fleet(h: Harness, seed: int = 4) -> None:
    """Six 8-GPU nodes; tenant ``lab`` keeps them busy: short jobs with runtime estimates, long preemptible
    checkpointing jobs, and long jobs with no estimate (which must stay off the reserved nodes)."""
    for k in range(6):
        h.add_node(registered_node(f"n{k}", gpus=8, model="H100").inventory)
    rnd = random.Random(seed)
    for _ in range(150):
        kind = rnd.random()
        arrival = rnd.uniform(0, 4 * HOUR)
        if kind < 0.6:
            runtime = rnd.uniform(600, 2400)
            h.submit(spec("lab", rnd.choice([1, 2, 4]), runtime_estimate_s=runtime * 1.2), at=arrival,
                     runtime_s=runtime)
        elif kind < 0.85:
            h.submit(spec("lab", rnd.choice([1, 2]), preemptible=True, priority_class="low",
                          checkpoint={"grace_s": 30}), at=arrival, runtime_s=rnd.uniform(2, 5) * HOUR)
        else:
            h.submit(spec("lab", 1), at=arrival, runtime_s=rnd.uniform(1, 3) * HOUR)


def test_a_reservation_starts_on_time_with_its_gpus_free_after_backfill_used_them() -> None:
    h = Harness(keep_steps=True, tick_s=30.0, heartbeat_s=30.0)
    busy_fleet(h)
    start = 3 * HOUR
    request = reservation(start)
    h.send(request, at=10.0)
    vip = h.submit(spec("vip", 8, gang={"nodes": 2}), at=start, runtime_s=HOUR)
    backfill = {"gpu_s": 0.0, "last": 0.0, "at_start": None}

    def measure(step: object, harness: Harness) -> None:
        found = harness.state.reservations.get(request.reservation_id)
        now = harness.now
        if found is not None and now <= start:
            backfill["gpu_s"] += borrowed_gpus(harness.state, found) * (now - backfill["last"])  # type: ignore[operator]
        if found is not None and backfill["at_start"] is None and now >= start:
            backfill["at_start"] = borrowed_gpus(harness.state, found)
        backfill["last"] = now

    h.observers.append(measure)
    h.run(until=start + HOUR)
    found = h.state.reservations[request.reservation_id]
    assert len(found.nodes) == 2
    assert backfill["at_start"] == 0.0  # nothing of another tenant held its GPUs at the start
    assert backfill["gpu_s"] > 4 * HOUR  # type: ignore[operator]  # backfill used them before (GPU-seconds)
    assert vip.started_at is not None and vip.started_at - start <= 10.0
    placed = {e.job_id: {a.node_id for a in e.assignments} for e in h.logged() if e.TYPE == "job.placed"}
    assert placed[vip.job_id] == set(found.nodes)
    # no job without a runtime estimate (which may not be stopped, nor ends in time) went to the reserved nodes
    for job in h.jobs.values():
        if job.spec.tenant == "lab" and not job.spec.preemptible and job.spec.runtime_estimate_s is None:
            assert not placed.get(job.job_id, set()) & found.nodes
    assert status(h.state, found, h.now)["state"] == "active"
    # the reservation is state from events: a replay of the log rebuilds it
    rebuilt = SchedulerState()
    for event in h.logged():
        rebuilt.apply(event)
    assert rebuilt.reservations[request.reservation_id] == found
    again = SchedulerState.from_snapshot(json.loads(rebuilt.snapshot_json()))
    assert again.reservations[request.reservation_id] == found


def test_during_the_window_only_its_tenant_places_there_and_after_a_delete_everyone() -> None:
    h = Harness(keep_steps=True, tick_s=5.0)
    for k in range(2):
        h.add_node(registered_node(f"n{k}", gpus=8, model="H100").inventory)
    request = CreateReservation(tenant="vip", gpus=8, start_at=datetime.fromtimestamp(100, UTC), duration_s=HOUR)
    h.send(request, at=1.0)
    others = [h.submit(spec("lab", 8, runtime_estimate_s=5000), at=200.0, runtime_s=5000) for _ in range(2)]
    h.run(until=1000.0)
    assert sorted(j.state for j in others) == ["queued", "running"]
    [waiting] = [j for j in others if j.state == "queued"]
    pending = h.scheduler.pending[waiting.job_id]
    assert "advance reservations" in pending.reason
    assert pending.estimated_start == 100 + HOUR  # the reservation ends before the running job does
    h.send(DeleteReservation(reservation_id=request.reservation_id), at=1100.0)
    h.run(until=1200.0)
    assert waiting.state in ("placed", "running")


def test_only_operators_reserve_and_a_reservation_that_lost_its_nodes_says_so() -> None:
    identity = IdentityMap(identities={
        "ops": Identity(role="operator", tenants=["*"]),
        "alice": Identity(role="submitter", tenants=["vip"], default_tenant="vip"),
    })
    config = SchedulerConfig(identity=identity, liveness=LivenessPolicy(suspect_after_s=10, lost_after_s=30))
    h = Harness(config, keep_steps=True, heartbeat_s=2.0)
    for k in range(2):
        h.add_node(registered_node(f"n{k}", gpus=8, model="H100").inventory)
    before = h.submit(spec("lab", 4), at=0.5, runtime_s=10_000, sender="ops")  # may not be stopped
    refused = reservation(5000.0, gpus=8)
    h.send(refused, at=1.0, sender="alice")
    accepted = reservation(5000.0, gpus=8)
    h.send(accepted, at=1.0, sender="ops")
    too_big = reservation(5000.0, gpus=64)
    h.send(too_big, at=2.0, sender="ops")
    h.run(until=5.0)
    reasons = {e.reservation_id: e.reason for e in h.logged() if e.TYPE == "reservation.refused"}
    assert "only operators" in reasons[refused.reservation_id] and "64 asked" in reasons[too_big.reservation_id]
    found = h.state.reservations[accepted.reservation_id]
    assert status(h.state, found, h.now) == {"state": "pending", "problems": []}
    assert not {a.node_id for a in h.state.jobs[before.job_id].assignments} & found.nodes  # the other node chosen
    [node] = found.nodes
    h.lose_node(node, at=10.0)
    h.run(until=100.0)
    problems = status(h.state, found, h.now)["problems"]
    assert problems[0] == "cannot be honoured: 0 of 8 GPUs available" and f"node {node} is lost" in problems
