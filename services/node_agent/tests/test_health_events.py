"""Injected faults reach the broker-facing publisher as GpuHealthChanged at once (functional deadline: 1 s)."""

from __future__ import annotations

import asyncio

import pytest
from gpuorch_contracts import GpuHealthChanged, NodeRegistered
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_node_agent.entrypoint import build_simulated_agents
from gpuorch_node_agent.fleet import FleetRunner
from gpuorch_node_agent.sim.processes import StaticProcessTable
from gpuorch_node_agent.sim.profiles import parse_profile_mix

HEALTH_DEADLINE_S = 1.0


async def _wait_for(publisher: RecordingPublisher, predicate, timeout_s: float):
    async def poll():
        while True:
            found = [m for m in publisher.of_type(GpuHealthChanged) if predicate(m)]
            if found:
                return found[0]
            await asyncio.sleep(0.005)

    return await asyncio.wait_for(poll(), timeout_s)


@pytest.fixture
async def fleet():
    agents = build_simulated_agents(parse_profile_mix("h100x8:2,l4x4:1", prefix="hx"), seed=3, inventory_s=60,
                                    processes=StaticProcessTable())
    publisher = RecordingPublisher()
    # heartbeats every 30 s: a health event seen in this test cannot have ridden on a heartbeat
    runner = FleetRunner(agents, publisher, heartbeat_s=30, usage_s=60, seed=3)
    await runner.start()
    yield runner, publisher
    await runner.stop()


async def test_injected_xid_is_published_within_one_second(fleet):
    runner, publisher = fleet
    node = runner.agents[1]
    node.nvml.inject_xid(5, 48)
    event = await _wait_for(publisher, lambda m: m.xid == 48, HEALTH_DEADLINE_S)
    assert event.node_id == node.node_id
    assert event.gpu_index == 5
    assert event.gpu_uuid == node.nvml.gpus[5].uuid
    assert (event.health, event.action) == ("unhealthy", "reset")
    assert "double-bit ECC" in event.reason


async def test_application_xid_fails_the_job_but_keeps_the_gpu_healthy(fleet):
    runner, publisher = fleet
    node = runner.agents[0]
    node.nvml.inject_xid(2, 31)
    event = await _wait_for(publisher, lambda m: m.xid == 31, HEALTH_DEADLINE_S)
    assert (event.health, event.action) == ("healthy", "fail_job")
    assert node.health.state(2).health == "healthy"


async def test_lost_gpu_is_unhealthy_and_the_inventory_follows(fleet):
    runner, publisher = fleet
    node = runner.agents[2]
    node.nvml.lose_gpu(1)
    event = await _wait_for(publisher, lambda m: m.xid == 79, HEALTH_DEADLINE_S)
    assert event.health == "unhealthy" and event.node_id == node.node_id
    messages = node.heartbeat_messages()
    registered = [m for m in messages if isinstance(m, NodeRegistered)]
    assert registered, "a health change changes the inventory hash"
    assert registered[0].inventory.gpus[1].health == "unhealthy"
    heartbeat = messages[-1]
    assert heartbeat.gpus[1].utilization_pct is None  # a lost GPU cannot be read
    assert heartbeat.gpus[1].health == "unhealthy"
    assert heartbeat.gpus[0].utilization_pct is not None


async def test_double_bit_ecc_event(fleet):
    runner, publisher = fleet
    runner.agents[0].nvml.inject_ecc(7, uncorrected=True)
    event = await _wait_for(publisher, lambda m: m.gpu_index == 7 and m.xid is None, HEALTH_DEADLINE_S)
    assert event.health == "unhealthy"


async def test_thermal_throttling_shows_in_samples(fleet):
    runner, _ = fleet
    node = runner.agents[0]
    node.nvml.throttle(3, "thermal")
    sample = node.usage_message()[-1].samples[3]
    assert "hw_thermal_slowdown" in sample.throttle_reasons
    assert sample.temperature_c >= 90
    assert sample.sm_clock_mhz < node.nvml.gpus[3].profile.sm_clock_max_mhz
    assert "hw_thermal_slowdown" not in node.usage_message()[-1].samples[2].throttle_reasons
