"""Processes killed at the worst moments: the scheduler (and with it the outbox relay), an executor, a node-agent
alone, the scheduler's database sessions. After each, the invariant checker reads the log and the read model."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from services.scheduler.tests.crash_drill import crash_drill
from tests.chaos.faults import LOST_AFTER_S, SEED, ChaosStack, scale
from tests.chaos.invariants import check_invariants
from tests.chaos.scenario import (
    dead_letter_count,
    fleet_without_executors,
    nodes_for,
    query,
    recording_job,
    report,
    share_job,
    submitter,
    wait_nodes,
    wait_states,
)
from tests.e2e.harness import publish_when_routable, wait_rows

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
async def test_scheduler_sigkilled_at_random_points_under_submissions(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    """SIGKILL of the scheduler process mid-batch, mid-commit, mid-relay or idle. The outbox relay runs inside the
    scheduler process, so these kills also kill the relay between reading rows, publishing and marking them sent:
    this scenario is the relay's as well."""
    jobs, kills = scale("scheduler_kill_jobs", 60), scale("scheduler_kills", 3)
    drill = await crash_drill(chaos_stack, amqp_url, pg_dsn, jobs=jobs, kills=kills, seed=SEED)
    verdict = await check_invariants(pg_dsn)
    report("scheduler-sigkill", f"{verdict.figures()}; kills {len(drill.recovery_s)}, recovery s "
           f"max {max(drill.recovery_s, default=0):.1f}")
    verdict.assert_holds()
    assert drill.unplaced == 0 and drill.duplicates == 0 and len(drill.recovery_s) == kills
    assert verdict.accepted == jobs and verdict.states["placed"] == jobs


@pytest.mark.timeout(300)
async def test_executor_sigkilled_while_jobs_run(chaos_stack: ChaosStack, pg_dsn: str, tmp_path: Path) -> None:
    """Jobs keep running under their supervisors; the restarted executor adopts them and reports each once."""
    run_log = tmp_path / "runs.txt"
    chaos_stack.start_scheduler()
    chaos_stack.start_executor()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    chaos_stack.start_node_agents(GPUORCH_HEARTBEAT_S="1")
    await wait_nodes(pg_dsn, 3)
    submits = [recording_job(run_log, 3.0) for _ in range(scale("executor_kill_jobs", 8))]
    async with submitter(chaos_stack.amqp_url) as submit:
        for job in submits:
            await submit(job)
        await wait_rows(pg_dsn, "SELECT count(*) AS n FROM jobs WHERE state = 'running'",
                        until=lambda rs: rs[0]["n"] >= 3, what="jobs running")
        killed_at = time.monotonic()
        chaos_stack.kill("executor")
        chaos_stack.start_executor()
        states = await wait_states(pg_dsn, [s.job_id for s in submits], ("succeeded", "failed"), timeout_s=120)
    verdict = await check_invariants(pg_dsn, run_log=run_log)
    starts = [line for line in run_log.read_text().splitlines() if line.startswith("start")]
    report("executor-sigkill", f"{verdict.figures()}; runs {len(starts)} for {len(submits)} jobs, all ended "
           f"{time.monotonic() - killed_at:.1f}s after the kill")
    verdict.assert_holds()
    assert set(states.values()) == {"succeeded"}
    # Each job ran once, unless the restarted executor took longer than the fence (deadline - grace) to renew
    # the lease: then supervisors stopped their jobs and they ran again, one copy after the other (checked above).
    assert len(starts) == len(submits) + verdict.requeues


@pytest.mark.timeout(300)
async def test_node_agent_dead_longer_than_the_lease_does_not_run_its_job_twice(
    chaos_stack: ChaosStack, pg_dsn: str, tmp_path: Path
) -> None:
    """Only the node-agent of the node running a job dies (its executor lives and keeps renewing its lease), for
    longer than the scheduler's lost-after. The job must not start a second copy elsewhere."""
    run_log = tmp_path / "runs.txt"
    node_1, node_2 = chaos_stack.nodes[:2]
    chaos_stack.start_scheduler()
    chaos_stack.start_executor_for([node_1, node_2])
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1", "executor.node-2"])
    chaos_stack.start_node_agent_for(node_1)
    await wait_nodes(pg_dsn, 1)
    job = recording_job(run_log, LOST_AFTER_S + 6)
    async with submitter(chaos_stack.amqp_url) as submit:
        await submit(job)
        await wait_states(pg_dsn, [job.job_id], ("running",), what="job running on node-1")
        chaos_stack.start_node_agent_for(node_2)
        await wait_nodes(pg_dsn, 2)
        chaos_stack.kill(f"node-agent-{node_1.node_id}")
        states = await wait_states(pg_dsn, [job.job_id], ("succeeded", "failed"), timeout_s=120)
    verdict = await check_invariants(pg_dsn, run_log=run_log)
    report("node-agent-alone", verdict.figures())
    verdict.assert_holds()
    assert states[job.job_id] == "succeeded"


@pytest.mark.timeout(300)
async def test_executor_dead_longer_than_the_lease_has_its_jobs_fenced_and_requeued(
    chaos_stack: ChaosStack, pg_dsn: str, tmp_path: Path
) -> None:
    """node-1's executor is SIGKILLed and stays dead (its node-agent lives). The job's supervisor stops the job by
    the executor's fencing deadline (lease.json is no longer renewed); the scheduler, hearing no executor
    heartbeat, declares the node lost after that deadline and the job runs again on node-2, never twice at once.
    When node-1's executor returns it reports the fenced run. The job runs until the test releases it once it runs
    on node-2 (a 10 s job could end on node-1 before the kill under load)."""
    run_log, release = tmp_path / "runs.txt", tmp_path / "release"
    node_1, node_2 = chaos_stack.nodes[:2]
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    chaos_stack.start_executor_for([node_1])
    chaos_stack.start_node_agent_for(node_1)
    await wait_nodes(pg_dsn, 1)
    job = recording_job(run_log, 280.0, release=release)
    async with submitter(chaos_stack.amqp_url) as submit:
        await submit(job)
        await wait_states(pg_dsn, [job.job_id], ("running",), what="job running on node-1")
        chaos_stack.start_executor_for([node_2])
        chaos_stack.start_node_agent_for(node_2)
        await wait_nodes(pg_dsn, 2)
        killed_at = time.monotonic()
        chaos_stack.kill(f"executor-{node_1.node_id}")
        await wait_rows(pg_dsn, "SELECT state, node_ids FROM jobs WHERE job_id = $1", job.job_id,
                        until=lambda rs: rs[0]["state"] == "running" and rs[0]["node_ids"] == ["node-2"],
                        timeout_s=4 * LOST_AFTER_S, what="the job running again on node-2")
        moved_s = time.monotonic() - killed_at
        release.touch()  # node-2's run ends (node-1's, fenced, must be gone: the run log tells if it was not)
        chaos_stack.start_executor_for([node_1])
        states = await wait_states(pg_dsn, [job.job_id], ("succeeded", "failed"), timeout_s=90)
        await wait_rows(pg_dsn, "SELECT type FROM events WHERE type IN ('job.finished', 'job.failed', 'job.lost') "
                        "AND payload->>'node_id' = 'node-1'", until=lambda rs: len(rs) >= 1,
                        what="node-1's fenced run reported once its executor is back")
    verdict = await check_invariants(pg_dsn, run_log=run_log)
    report("executor-dead-past-lease", f"{verdict.figures()}; running again on node-2 {moved_s:.1f}s after the kill")
    verdict.assert_holds()
    assert states[job.job_id] == "succeeded"


@pytest.mark.timeout(300)
async def test_postgres_sessions_terminated_mid_transaction(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    """``pg_terminate_backend`` on every session of the scheduler's database, repeatedly, while submissions flow
    (the shared PostgreSQL server is not restarted: other tests use it). The leader loses its sessions, steps down
    and leads again once the database answers (issue 30: a pause, not an exit), recovering from the log; the test
    would restart a scheduler that exited, and requires that it never had to."""
    rng = random.Random(SEED)
    count, terminations = scale("pg_jobs", 60), scale("pg_terminations", 3)
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    restarts = 0
    submits = [share_job() for _ in range(count)]
    terminate_at = set(rng.sample(range(1, count), terminations))
    terminated = 0
    async with fleet_without_executors(amqp_url, pg_dsn, nodes=nodes_for(count, 2)) as broker:
        for index, submit in enumerate(submits):
            await publish_when_routable(broker, submit)
            if index in terminate_at:
                if chaos_stack.dead():  # killed by the previous termination: a supervisor restarts it
                    chaos_stack.start_scheduler()
                    restarts += 1
                delay = rng.random() * 0.3
                for _ in range(300):  # until a session of the scheduler was terminated (it may still be starting,
                    if chaos_stack.dead():  # or exiting after the previous termination)
                        chaos_stack.start_scheduler()
                        restarts += 1
                    sessions = await query(pg_dsn, "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                                           "current_database() AND pid <> pg_backend_pid()")
                    if not sessions[0]["n"]:  # type: ignore[call-overload]
                        await asyncio.sleep(0.1)
                        continue
                    await asyncio.sleep(delay)
                    rows = await query(pg_dsn, "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity "
                                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
                    if rows[0]["n"]:  # type: ignore[call-overload]
                        terminated += int(rows[0]["n"])  # type: ignore[call-overload]
                        break
            if chaos_stack.dead():
                chaos_stack.start_scheduler()
                restarts += 1
        deadline = time.monotonic() + 120
        while True:
            if chaos_stack.dead():
                chaos_stack.start_scheduler()
                restarts += 1
            placed = await query(pg_dsn, "SELECT count(*) AS n FROM jobs WHERE job_id = ANY($1::uuid[]) AND "
                                 "state = 'placed'", [s.job_id for s in submits])
            if placed[0]["n"] == count or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
    verdict = await check_invariants(pg_dsn)
    dead = await dead_letter_count(amqp_url, "scheduler.submit.dlq")
    report("postgres-terminate", f"{verdict.figures()}; sessions terminated {terminated}, scheduler restarts "
           f"{restarts}, dead-lettered submissions {dead}")
    verdict.assert_holds()
    assert dead == 0 and verdict.accepted == count and verdict.states["placed"] == count
    assert terminated >= terminations
    assert restarts == 0, "the scheduler exited when its database sessions were terminated"

