"""A small simulated fleet against the real RabbitMQ: registrations, heartbeats, a MIG command, a health event."""

from __future__ import annotations

import asyncio

import pytest
from gpuorch_contracts import (
    EVENTS_EXCHANGE,
    ApplyMigLayout,
    GpuHealthChanged,
    Message,
    MigGpuLayout,
    MigLayoutApplied,
    NodeHeartbeat,
    NodeRegistered,
)
from gpuorch_messaging import Broker, QueueSpec, dispatch
from gpuorch_node_agent.entrypoint import build_simulated_agents, command_queue, parse_config
from gpuorch_node_agent.fleet import FleetRunner
from gpuorch_node_agent.handlers import handlers
from gpuorch_node_agent.sim.processes import StaticProcessTable
from gpuorch_node_agent.sim.profiles import parse_profile_mix

pytestmark = pytest.mark.integration


async def _until(predicate, timeout_s: float = 10.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def test_fleet_heartbeats_and_mig_command_through_rabbitmq(amqp_url, tmp_path):
    seen: list[Message] = []
    observer = Broker(amqp_url, producer="test-observer")
    await observer.connect()
    await observer.consume(
        QueueSpec(name="test.node-events", bindings=[(EVENTS_EXCHANGE, "node.#"), (EVENTS_EXCHANGE, "gpu.#")],
                  max_length=1000),
        lambda message: _append(seen, message),
    )
    config = parse_config(["--nvml", "sim", "--fleet-nodes", "h100x8:2,l4x4:1", "--fleet-name", "itest"], {})
    agents = build_simulated_agents(parse_profile_mix("h100x8:2,l4x4:1", prefix="itest"), seed=1,
                                    inventory_s=60, processes=StaticProcessTable())
    broker = Broker(amqp_url, producer="node-agent/itest", identity="trust_all")  # everyone is guest here
    await broker.connect()
    runner = FleetRunner(agents, broker, heartbeat_s=0.5, usage_s=1.0, seed=1)
    await runner.start()
    registry = handlers(runner.by_node_id, runner.publish_now, tmp_path)
    await broker.consume(command_queue(config, [a.node_id for a in agents]), lambda m: dispatch(registry, m, service="node-agent"))
    try:
        node_ids = {a.node_id for a in agents}
        await _until(lambda: {m.inventory.node_id for m in seen if isinstance(m, NodeRegistered)} == node_ids)
        await _until(lambda: len([m for m in seen if isinstance(m, NodeHeartbeat)]) >= 6)
        await _until(lambda: any(m.type == "gpu.usage_sampled" for m in seen))
        heartbeats = [m for m in seen if isinstance(m, NodeHeartbeat) and m.node_id == "itest-00000"]
        assert [h.sequence for h in heartbeats] == sorted(h.sequence for h in heartbeats)
        assert all(h.producer == "node-agent/itest-00000" for h in heartbeats)

        scheduler = Broker(amqp_url, producer="test-scheduler")
        await scheduler.connect()
        await scheduler.publish(ApplyMigLayout(node_id="itest-00001", layouts=[
            MigGpuLayout(gpu_index=2, profiles=["1g.10gb"] * 7)]))
        await scheduler.close()

        def mig_registered() -> bool:
            return any(isinstance(m, NodeRegistered) and m.inventory.node_id == "itest-00001"
                       and len(m.inventory.gpus[2].mig_instances) == 7 for m in seen)

        await _until(mig_registered)

        agents[2].nvml.inject_xid(3, 95)
        await _until(lambda: any(isinstance(m, GpuHealthChanged) and m.xid == 95 for m in seen))
        event = next(m for m in seen if isinstance(m, GpuHealthChanged) and m.xid == 95)
        assert (event.node_id, event.gpu_index, event.health) == ("itest-00002", 3, "unhealthy")
        assert runner.stats.publish_failures == 0
    finally:
        await runner.stop()
        await broker.close()
        await observer.close()


async def _append(seen: list[Message], message: Message) -> None:
    seen.append(message)


async def test_a_node_agent_started_while_the_broker_is_down_waits_and_then_registers(amqp_url, amqp_vhost, capsys):
    """The broker refuses every connection when the node-agent starts (a proxy): it retries instead of exiting
    (before: 30 s, then exit) and registers its node once the broker answers (decision 43)."""
    from gpuorch_messaging.testing import TcpProxy
    from gpuorch_node_agent.entrypoint import run

    seen: list[Message] = []
    observer = Broker(amqp_url, producer="test-observer")
    await observer.connect()
    await observer.consume(QueueSpec(name="test.late-broker", bindings=[(EVENTS_EXCHANGE, "node.registered")],
                                     max_length=100), lambda message: _append(seen, message))
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    proxy.refuse = True
    config = parse_config(["--nvml", "sim", "--node-id", "late-broker-1", "--heartbeat-s", "0.2", "--duration-s", "4",
                           "--amqp-url", f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}"],
                          {"GPUORCH_IDENTITY": "trust_all", "GPUORCH_BROKER_TOPOLOGY": "declare"})
    agent = asyncio.create_task(run(config))
    try:
        await _until(lambda: proxy.refused >= 2 and not agent.done())  # retried, still running
        logged = capsys.readouterr()  # stdout, or stderr where an earlier test in this process pointed logging
        assert "broker.unreachable" in logged.out + logged.err  # the unbounded wait, not a 30 s one
        proxy.refuse = False
        await _until(lambda: any(isinstance(m, NodeRegistered) and m.inventory.node_id == "late-broker-1" for m in seen))
    finally:
        agent.cancel()
        await asyncio.gather(agent, return_exceptions=True)
        await proxy.stop()
        await observer.close()


async def test_a_restarted_node_agent_still_refuses_a_superseded_leaders_command(amqp_url, amqp_vhost, tmp_path):
    """The node-agent keeps the newest leader epoch in its state directory: after a command of epoch 3, a restarted
    node-agent (a new process on the same ``GPUORCH_NODE_AGENT_STATE_DIR``) answers an epoch-2 ApplyMigLayout
    refused and changes nothing (before: kept in memory, the restarted one obeyed it)."""
    from gpuorch_node_agent.entrypoint import run

    seen: list[Message] = []
    observer = Broker(amqp_url, producer="test-observer")
    await observer.connect()
    await observer.consume(QueueSpec(name="test.epoch-answers", bindings=[(EVENTS_EXCHANGE, "#")], max_length=1000),
                           lambda message: _append(seen, message))
    config = parse_config(["--nvml", "sim", "--node-id", "epoch-restart-1", "--sim-profile", "h100x1",
                           "--heartbeat-s", "5", "--amqp-url", amqp_url],
                          {"GPUORCH_IDENTITY": "trust_all", "GPUORCH_BROKER_TOPOLOGY": "declare",
                           "GPUORCH_NODE_AGENT_STATE_DIR": str(tmp_path / "node-agent")})
    scheduler = Broker(amqp_url, producer="test-scheduler")
    await scheduler.connect()

    async def apply_and_answer(profiles: list[str], epoch: int) -> MigLayoutApplied:
        registrations = len([m for m in seen if isinstance(m, NodeRegistered)])
        agent = asyncio.create_task(run(config))
        try:  # registered: consuming (the queue is bound before heartbeats start)
            await _until(lambda: len([m for m in seen if isinstance(m, NodeRegistered)]) > registrations)
            command = ApplyMigLayout(node_id="epoch-restart-1", leader_epoch=epoch,
                                     layouts=[MigGpuLayout(gpu_index=0, profiles=profiles)])
            await scheduler.publish(command)
            await _until(lambda: any(isinstance(m, MigLayoutApplied) and m.command_id == str(command.message_id)
                                     for m in seen))
            return next(m for m in seen if isinstance(m, MigLayoutApplied) and m.command_id == str(command.message_id))
        finally:
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)

    try:
        first = await apply_and_answer(["7g.80gb"], 3)
        assert first.outcomes[0].applied, first.outcomes[0].reason
        after_restart = await apply_and_answer(["3g.40gb", "3g.40gb"], 2)
        assert not after_restart.outcomes[0].applied
        assert "epoch 2, older than epoch 3" in after_restart.outcomes[0].reason
        assert (tmp_path / "node-agent" / "epoch-restart-1" / "leader_epoch.json").exists()
    finally:
        await scheduler.close()
        await observer.close()
