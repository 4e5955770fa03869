"""Leadership under faults (issue 30): a paused leader replaced within its lease and fenced when it wakes; every
database session terminated and every broker connection cut while every service runs, and none exits."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from gpuorch_contracts import LaunchJob, Message
from gpuorch_contracts.leader_epoch import judge_leader_epoch

from tests.chaos.faults import BrokerProxy, ChaosStack
from tests.chaos.invariants import check_invariants
from tests.chaos.scenario import (
    fleet_without_executors,
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

LEASE_S = float(os.environ.get("GPUORCH_CHAOS_LEADER_LEASE_S", "3"))
LEASE = {"GPUORCH_LEADER_LEASE_S": str(LEASE_S), "GPUORCH_LEADER_RENEW_S": str(min(0.5, LEASE_S / 4))}
PAUSE_CAP_S = float(os.environ.get("GPUORCH_CHAOS_LEADER_PAUSE_S", "20"))
"""The longest the leader stays paused: with the lease, the standby places long before; without it (the advisory
lock alone), nothing is placed until the pause ends, and the gap is this long."""


def log_count(stack: ChaosStack, name: str, text: str) -> int:
    path = stack.processes[name].log_path
    return path.read_text(errors="replace").count(text) if path.exists() else 0


async def wait_log(stack: ChaosStack, name: str, text: str, count: int = 1, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while log_count(stack, name, text) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} logged {text!r} fewer than {count} times: {stack.tail(name, 20)}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
async def test_a_paused_leader_is_replaced_within_its_lease_and_steps_down_when_it_wakes(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    """SIGSTOP of the leader's whole process group (a VM stall): the standby takes the lease once it expired and
    places the next submission; on SIGCONT the old leader commits nothing more, steps down and stands by, still
    running. Every command the nodes received carries its leader's epoch, and no command of the old epoch arrives
    after one of the new (the executor's rule, ``judge_leader_epoch``, would refuse it)."""
    chaos_stack.extra_env.update(LEASE)
    first = chaos_stack.start_scheduler("scheduler-1")
    await wait_log(chaos_stack, "scheduler-1", "scheduler.recovered")
    chaos_stack.start_scheduler("scheduler-2")
    await wait_log(chaos_stack, "scheduler-2", "scheduler.waiting_for_leadership")
    commands: list[Message] = []
    async with fleet_without_executors(amqp_url, pg_dsn, nodes=2, commands=commands) as broker:
        before = share_job()
        await publish_when_routable(broker, before)
        await wait_states(pg_dsn, [before.job_id], ("placed",), timeout_s=30)
        assert first.popen is not None
        os.killpg(first.popen.pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            during = share_job()
            await publish_when_routable(broker, during)
            try:
                await wait_states(pg_dsn, [during.job_id], ("placed",), timeout_s=PAUSE_CAP_S)
            except AssertionError:  # not placed while paused (the advisory lock alone): the gap is the pause
                pass
            gap_s = time.monotonic() - paused
        finally:
            os.killpg(first.popen.pid, signal.SIGCONT)
        resumed = time.monotonic()
        await wait_states(pg_dsn, [during.job_id], ("placed",), timeout_s=60)
        await wait_log(chaos_stack, "scheduler-1", "scheduler.stepped_down", timeout_s=30)
        await wait_log(chaos_stack, "scheduler-1", "scheduler.waiting_for_leadership", count=2, timeout_s=30)
        stepped_down_s = time.monotonic() - resumed
        after = share_job()
        await publish_when_routable(broker, after)
        await wait_states(pg_dsn, [after.job_id], ("placed",), timeout_s=30)
        deadline = time.monotonic() + 30
        while len({c.job_id for c in commands if isinstance(c, LaunchJob)}) < 3:  # the relay publishes after
            assert time.monotonic() < deadline, "a LaunchJob never reached its node"  # the commit
            await asyncio.sleep(0.05)
        [lease] = await query(pg_dsn, "SELECT epoch, holder FROM scheduler_leadership")
    verdict = await check_invariants(pg_dsn)
    launches = [c for c in commands if isinstance(c, LaunchJob)]
    epochs = {c.job_id: c.leader_epoch for c in launches}
    newest, refused = 0, 0
    for command in launches:
        judged = judge_leader_epoch(command.leader_epoch, newest)
        newest, refused = judged.newest_seen, refused + (not judged.admitted)
    report("paused-leader", f"lease {LEASE_S} s: placement gap {gap_s:.1f} s after SIGSTOP of the leader; "
           f"stepped down {stepped_down_s:.1f} s after SIGCONT; lease epoch {lease['epoch']} held by "
           f"{lease['holder']}; late commands of the old epoch {refused}; {verdict.figures()}")
    verdict.assert_holds()
    assert gap_s < LEASE_S + 6, f"no placement for {gap_s:.1f} s while the leader was paused"
    assert first.running and not chaos_stack.dead()
    assert str(lease["holder"]).startswith("scheduler-2")
    assert epochs[before.job_id] < epochs[during.job_id] == epochs[after.job_id] == lease["epoch"]
    assert refused == 0  # the paused leader published nothing once the new epoch had


@pytest.mark.timeout(240)
async def test_every_database_session_terminated_and_every_broker_connection_cut_leaves_every_service_running(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    """Every service of a stack (scheduler leader and standby, executor, node-agents, telemetry, API) behind a
    broker proxy: every database session terminated and every broker connection cut at once, twice. None exits
    (no supervisor restarts anything here); jobs submitted before, between and after all run once."""
    proxy = BrokerProxy()
    await proxy.start()
    chaos_stack.amqp_url = proxy.url(amqp_url)
    chaos_stack.extra_env.update(LEASE)
    run_log = tmp_path / "runs.log"
    try:
        chaos_stack.start_scheduler("scheduler-1")
        await wait_log(chaos_stack, "scheduler-1", "scheduler.recovered")
        chaos_stack.start_scheduler("scheduler-2")
        chaos_stack.start_executor()
        await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
        chaos_stack.start_telemetry()
        await chaos_stack.queues_declared(["telemetry.samples"])
        chaos_stack.start_node_agents()
        api_url = await asyncio.to_thread(chaos_stack.start_api)
        await wait_nodes(pg_dsn, len(chaos_stack.nodes))
        jobs = []
        async with submitter(amqp_url) as submit:
            for round_ in range(3):
                job = recording_job(run_log, 0.5)
                await submit(job)
                jobs.append(job.job_id)
                await wait_states(pg_dsn, [job.job_id], ("succeeded",), timeout_s=90, what=f"round {round_} jobs")
                if round_ == 2:
                    break
                await proxy.cut()
                terminated = await query(pg_dsn, "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity "
                                         "WHERE datname = current_database() AND pid <> pg_backend_pid()")
                assert terminated[0]["n"] > 0
        await wait_rows(pg_dsn, "SELECT count(*) AS n FROM jobs", until=lambda rs: rs[0]["n"] >= 3, timeout_s=30,
                        what="the API's read path")
        async with httpx.AsyncClient() as client:
            ready = await client.get(f"{api_url}/readyz", timeout=5)
        dead = chaos_stack.dead()
    finally:
        await proxy.stop()
    verdict = await check_invariants(pg_dsn)
    report("database-and-broker-lost", f"2 rounds of every session terminated + every broker connection cut; "
           f"services exited {dead}; API /readyz {ready.status_code}; {verdict.figures()}")
    verdict.assert_holds()
    assert dead == [], f"services exited: {dead}"
    assert ready.status_code == 200
