"""The two providers: the simulated cloud (boot delay, drains, GPU-hours paid) and the event provider (the
``fleet.scale_requested`` event and the gauges an external autoscaler follows)."""

from __future__ import annotations

from gpuorch_capacity import SIM_NODE_TYPES, FleetObservation, Mode, PendingDemand, PoolSpec, decide
from gpuorch_capacity.providers import EventProvider, SimulatedCloud
from gpuorch_contracts.capacity import FleetScaleRequested
from gpuorch_messaging.testing import RecordingPublisher
from prometheus_client import REGISTRY

POOL = PoolSpec("h100", SIM_NODE_TYPES["h100x8"], floor=0, ceiling=4, idle_before_drain_s=0)
DEMAND = (PendingDemand("training", count=2, oldest_wait_s=600, gpus=8),)


async def test_simulated_cloud_boots_after_its_delay_and_bills_from_the_request() -> None:
    cloud = SimulatedCloud([POOL], boot_s=120)
    plan = decide(FleetObservation(now=1000, pools=(POOL,), pending=DEMAND))
    await cloud.apply(plan, [POOL], Mode.ADVISE)
    assert not cloud.nodes  # advice changes nothing
    await cloud.apply(plan, [POOL], Mode.AUTO)
    assert [n.phase for n in cloud.nodes.values()] == ["booting", "booting"]
    assert cloud.boot_due(1119) == [] and cloud.next_boot_at() == 1120
    ready = cloud.boot_due(1120)
    assert len(ready) == 2 and all(n.phase == "ready" for n in cloud.nodes.values())
    view = cloud.node_view(ready[0].node_id)
    assert len(view.gpus) == 8 and view.gpus[0].model == "H100-80GB" and view.gpus[0].memory_mib_total == 81559
    states = cloud.states({})
    assert all(s.phase == "ready" and s.running_jobs == 0 and s.idle_since == 1120 for s in states)
    # nothing pending any more: both idle nodes are drained, released, and stop costing
    again = decide(FleetObservation(now=2000, pools=(POOL,), nodes=states, history=tuple(cloud.history.items())))
    cloud.carry_out(again)
    assert {n.phase for n in cloud.nodes.values()} == {"draining"}
    for node_id in list(cloud.nodes):
        cloud.release(node_id, 4600)
    assert cloud.gpu_hours_paid(9999) == 2 * 8 * (4600 - 1000) / 3600
    assert cloud.cost(9999) == cloud.gpu_hours_paid(9999) * SIM_NODE_TYPES["h100x8"].gpu_hour_cost


async def test_event_provider_publishes_one_event_per_changed_pool_and_sets_the_gauges() -> None:
    publisher = RecordingPublisher()
    provider = EventProvider(publisher, producer="telemetry/test")
    idle_pool = PoolSpec("l4-events", SIM_NODE_TYPES["l4x4"])
    pool = PoolSpec("h100-events", SIM_NODE_TYPES["h100x8"], ceiling=4)
    plan = decide(FleetObservation(now=0, pools=(pool, idle_pool), pending=DEMAND))
    await provider.apply(plan, [pool, idle_pool], Mode.ADVISE)
    (advice,) = publisher.of_type(FleetScaleRequested)
    assert publisher.published[0][:2] == ("gpuorch.events", "fleet.scale_requested")
    assert (advice.mode, advice.pool, advice.current_nodes, advice.desired_nodes, advice.add_nodes) == (
        "advise", "h100-events", 0, 2, 2)
    assert "2 pending job(s)" in advice.reason
    value = REGISTRY.get_sample_value
    assert value("gpuorch_capacity_desired_nodes", {"pool": "h100-events"}) == 0  # advice moves no follower
    assert value("gpuorch_capacity_advised_nodes", {"pool": "h100-events"}) == 2
    await provider.apply(plan, [pool, idle_pool], Mode.AUTO)
    assert publisher.of_type(FleetScaleRequested)[-1].mode == "auto"
    assert value("gpuorch_capacity_desired_nodes", {"pool": "h100-events"}) == 2
    assert value("gpuorch_capacity_desired_nodes", {"pool": "l4-events"}) == 0
    await provider.apply(plan, [pool, idle_pool], Mode.OFF)
    assert len(publisher.of_type(FleetScaleRequested)) == 2
    assert FleetScaleRequested.model_validate_json(advice.model_dump_json()) == advice

