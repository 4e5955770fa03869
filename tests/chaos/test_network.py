"""Broker-side faults, through a TCP proxy in front of RabbitMQ (the shared server itself is never restarted or
alarmed: other people's tests use it): a broker restart as clients see it, one node cut off past its grace, and a
memory alarm that blocks publishers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gpuorch_contracts import EVENTS_EXCHANGE, FleetAlert, Message
from gpuorch_messaging import Broker, PublishError, QueueSpec

from tests.chaos.faults import LOST_AFTER_S, BrokerProxy, ChaosStack, scale
from tests.chaos.invariants import check_invariants
from tests.chaos.scenario import (
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
from tests.e2e.harness import wait_rows

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def proxy() -> AsyncIterator[BrokerProxy]:
    broker_proxy = BrokerProxy()
    await broker_proxy.start()
    yield broker_proxy
    await broker_proxy.stop()


async def outage(proxy: BrokerProxy, seconds: float) -> None:
    """Every connection through the proxy drops and new ones are refused for ``seconds``: a broker restart."""
    proxy.refuse = True
    await proxy.cut()
    await asyncio.sleep(seconds)
    proxy.refuse = False


@pytest.mark.timeout(300)
async def test_broker_restart_during_confirmed_submissions(
    chaos_stack: ChaosStack, proxy: BrokerProxy, amqp_url: str, pg_dsn: str
) -> None:
    """The scheduler and the submitter reach RabbitMQ through the proxy; twice the proxy drops every connection and
    refuses new ones for 3 s. The submitter re-sends a submission until it is confirmed (same job id: admission is
    idempotent). Every submission must be accepted exactly once and placed."""
    count, outages = scale("broker_restart_jobs", 60), 2
    chaos_stack.amqp_url = proxy.url(amqp_url)
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    submits = [share_job() for _ in range(count)]
    outage_at = {count // 3, 2 * count // 3}
    resent = 0
    started = time.monotonic()
    async with fleet_without_executors(amqp_url, pg_dsn, nodes=nodes_for(count, 2)):
        client = Broker(proxy.url(amqp_url), producer="chaos-submitter", publish_timeout_s=10)
        await client.connect()
        try:
            for index, submit in enumerate(submits):
                if index in outage_at:
                    asyncio.get_running_loop().create_task(outage(proxy, 3.0))
                    await asyncio.sleep(0.05)
                while True:
                    try:
                        await client.publish(submit)
                        break
                    except PublishError:
                        resent += 1
                        await asyncio.sleep(0.5)
            await wait_states(pg_dsn, [s.job_id for s in submits], ("placed",), timeout_s=120)
        finally:
            await client.close()
    accepted = await query(pg_dsn, "SELECT payload->>'job_id' AS job_id, count(*) AS n FROM events "
                           "WHERE type = 'job.accepted' GROUP BY 1")
    verdict = await check_invariants(pg_dsn)
    report("broker-restart-proxy", f"{verdict.figures()}; outages {outages} x 3 s, re-sent {resent}, "
           f"all placed {time.monotonic() - started:.1f}s after the first submission")
    verdict.assert_holds()
    assert len(accepted) == count and all(r["n"] == 1 for r in accepted), "each submission accepted once"
    assert chaos_stack.dead() == []


@pytest.mark.timeout(300)
async def test_node_cut_off_past_the_grace_period(
    chaos_stack: ChaosStack, proxy: BrokerProxy, pg_dsn: str, tmp_path: Path
) -> None:
    """node-1's node-agent and executor reach RabbitMQ only through the proxy, which is cut (and refuses) for
    longer than the scheduler's lost-after. node-1's executor fences its job before the scheduler requeues it; the
    job runs again on node-2, never on both at once; node-1 comes back and reports the fenced run. The job runs
    until the test releases it once it runs on node-2 (a 10 s job could end on node-1 before the cut under load)."""
    run_log, release = tmp_path / "runs.txt", tmp_path / "release"
    node_1, node_2 = chaos_stack.nodes[:2]
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    chaos_stack.start_executor_for([node_1], proxy.url(chaos_stack.amqp_url))
    chaos_stack.start_node_agent_for(node_1, proxy.url(chaos_stack.amqp_url))
    await wait_nodes(pg_dsn, 1)
    job = recording_job(run_log, 280.0, release=release)
    async with submitter(chaos_stack.amqp_url) as submit:
        await submit(job)
        await wait_states(pg_dsn, [job.job_id], ("running",), what="job running on node-1")
        chaos_stack.start_executor_for([node_2])
        chaos_stack.start_node_agent_for(node_2)
        await wait_nodes(pg_dsn, 2)
        await chaos_stack.queues_declared(["executor.node-2"])
        proxy.refuse = True
        await proxy.cut()
        cut_at = time.monotonic()
        await wait_rows(pg_dsn, "SELECT state, node_ids FROM jobs WHERE job_id = $1", job.job_id,
                        until=lambda rs: rs[0]["state"] == "running" and rs[0]["node_ids"] == ["node-2"],
                        timeout_s=90, what="the job running again on node-2")
        moved_s = time.monotonic() - cut_at
        release.touch()  # node-2's run ends (node-1's, fenced, must be gone: the run log tells if it was not)
        proxy.refuse = False  # node-1 comes back
        states = await wait_states(pg_dsn, [job.job_id], ("succeeded", "failed"), timeout_s=90)
        await wait_rows(pg_dsn, "SELECT type FROM events WHERE type = 'job.lost' AND payload->>'node_id' = 'node-1'",
                        until=lambda rs: len(rs) >= 1, what="node-1's fenced run reported once it is back")
    verdict = await check_invariants(pg_dsn, run_log=run_log)
    report("node-cut-off", f"{verdict.figures()}; running again on node-2 {moved_s:.1f}s after the cut "
           f"(lost-after {LOST_AFTER_S:.0f}s)")
    verdict.assert_holds()
    assert states[job.job_id] == "succeeded"


@pytest.mark.timeout(300)
async def test_memory_alarm_blocks_publishers_without_nodes_declared_dead(
    chaos_stack: ChaosStack, proxy: BrokerProxy, amqp_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    """Every node-agent and executor publishes through the proxy, which holds everything they send (as a broker
    memory alarm blocks publishers) for longer than the scheduler's lost-after, while the scheduler's own
    connection flows. Every node goes silent at once: the scheduler must raise a fleet alert and declare no node
    lost; when the alarm clears, everything held is delivered and every job ends once."""
    run_log = tmp_path / "runs.txt"
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    chaos_stack.start_executor(GPUORCH_AMQP_URL=proxy.url(amqp_url))
    chaos_stack.start_node_agents(GPUORCH_AMQP_URL=proxy.url(amqp_url), GPUORCH_HEARTBEAT_S="1")
    await wait_nodes(pg_dsn, 3)
    alerts: list[Message] = []
    watcher = Broker(amqp_url, producer="chaos-watcher")
    await watcher.connect()

    async def on_alert(message: Message) -> None:
        alerts.append(message)

    await watcher.consume(QueueSpec("chaos.alerts", [(EVENTS_EXCHANGE, "alert.fleet")]), on_alert)
    submits = [recording_job(run_log, 1.0) for _ in range(scale("alarm_jobs", 4))]
    try:
        async with submitter(amqp_url) as submit:
            for job in submits:
                await submit(job)
            await wait_rows(pg_dsn, "SELECT count(*) AS n FROM jobs WHERE state IN ('running', 'succeeded')",
                            until=lambda rs: rs[0]["n"] >= 1, what="a job running")
            proxy.freeze()
            frozen_at = time.monotonic()
            await wait_rows(pg_dsn, "SELECT count(*) AS n FROM events WHERE type = 'node.liveness_changed'",
                            until=lambda rs: rs[0]["n"] >= 3, what="every node suspect")
            while time.monotonic() - frozen_at < LOST_AFTER_S + 3:
                await asyncio.sleep(0.5)
            proxy.thaw()
            states = await wait_states(pg_dsn, [s.job_id for s in submits], ("succeeded", "failed"), timeout_s=120)
            await wait_rows(pg_dsn, "SELECT node_id FROM nodes WHERE liveness = 'alive'",
                            until=lambda rs: len(rs) == 3, what="every node alive again")
    finally:
        await watcher.close()
    lost = await query(pg_dsn, "SELECT payload->>'node_id' AS node_id FROM events WHERE type = "
                       "'node.liveness_changed' AND payload->>'liveness' = 'lost'")
    verdict = await check_invariants(pg_dsn, run_log=run_log)
    report("memory-alarm-proxy", f"{verdict.figures()}; blocked {LOST_AFTER_S + 3:.0f}s, nodes declared lost "
           f"{len(lost)}, fleet alerts {len(alerts)}")
    verdict.assert_holds()
    assert lost == [], "no node is declared lost while every node is silent at once"
    assert any(isinstance(a, FleetAlert) and a.kind == "mass_silence" for a in alerts)
    assert set(states.values()) == {"succeeded"}
