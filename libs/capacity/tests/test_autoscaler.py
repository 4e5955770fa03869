"""Table-driven decisions of the autoscaler core (pure: no servers)."""

from __future__ import annotations

import pytest
from gpuorch_capacity import (
    SIM_NODE_TYPES,
    FleetObservation,
    MemoryPressure,
    NodeState,
    PendingDemand,
    PoolHistory,
    PoolSpec,
    decide,
    nodes_for,
)

H100 = PoolSpec("h100", SIM_NODE_TYPES["h100x8"], floor=1, ceiling=6, scale_out_cooldown_s=300,
                scale_in_cooldown_s=600, idle_before_drain_s=900, max_step=4)
L4 = PoolSpec("l4", SIM_NODE_TYPES["l4x4"], floor=0, ceiling=10, idle_before_drain_s=900)
POOLS = (H100, L4)


def ready(node_id: str, pool: str = "h100", jobs: int = 0, pinned: bool = False, idle_since: float | None = None,
          free: int | None = None) -> NodeState:
    """A ready node; an idle one has all its GPUs free unless ``free`` says otherwise."""
    gpus = {"h100": 8, "l4": 4}[pool]
    return NodeState(node_id, pool, "ready", jobs, pinned, idle_since, (0 if jobs else gpus) if free is None else free)


@pytest.mark.parametrize(("slots", "per_node", "nodes"), [
    ([], 8, 0), ([8.0], 8, 1), ([4.0, 4.0, 4.0], 8, 2), ([0.25] * 9, 4, 1), ([3.0, 6.0, 2.0, 5.0], 8, 2),
])
def test_first_fit_decreasing_packs_onto_fresh_nodes(slots: list[float], per_node: int, nodes: int) -> None:
    assert nodes_for(slots, per_node) == nodes


def test_waiting_whole_gpu_training_grows_the_cheapest_pool_that_can_run_it() -> None:
    pending = (PendingDemand("training", count=3, oldest_wait_s=600, gpus=4, gpu_models=("H100-80GB",)),)
    plan = decide(FleetObservation(now=10_000, pools=POOLS, nodes=(ready("h100-1", jobs=2),), pending=pending))
    (out,) = plan.scale_outs
    assert out.pool == "h100" and out.count == 2  # 3 x 4 GPUs on 8-GPU nodes
    assert "3 pending job(s)" in out.reason and "training 4 GPUs (H100-80GB)" in out.reason
    assert plan.desired() == {"h100": 3, "l4": 0}
    assert not plan.drains


def test_any_model_goes_to_the_cheaper_pool_and_spills_over_at_its_ceiling() -> None:
    small = PoolSpec("l4", SIM_NODE_TYPES["l4x4"], ceiling=1)
    pending = (PendingDemand("inference", count=20, oldest_wait_s=60, gpu_milli=500),)
    plan = decide(FleetObservation(now=0, pools=(H100, small), pending=pending))
    assert [(o.pool, o.count) for o in plan.scale_outs] == [("h100", 2)]  # 10 GPUs: no room on one L4 node


def test_shares_pack_per_gpu_and_mig_by_compute_slices() -> None:
    pending = (PendingDemand("inference", count=8, oldest_wait_s=60, gpu_milli=250),
               PendingDemand("inference", count=14, oldest_wait_s=60, mig_profile="1g.10gb"))
    plan = decide(FleetObservation(now=0, pools=POOLS, pending=pending))
    outs = {o.pool: o.count for o in plan.scale_outs}
    assert outs == {"l4": 1, "h100": 1}  # 2 GPUs of shares on one L4 node; 14 slices = 2 GPUs of MIG on an H100


def test_work_that_waited_less_than_the_tier_threshold_buys_nothing_but_blocks_drains() -> None:
    pool = PoolSpec("h100", SIM_NODE_TYPES["h100x8"], min_wait_s=(("batch", 900.0),), idle_before_drain_s=0)
    pending = (PendingDemand("batch", count=1, oldest_wait_s=300, gpus=8),)
    plan = decide(FleetObservation(now=5000, pools=(pool,), nodes=(ready("a", idle_since=0),), pending=pending))
    assert not plan.changes


def test_no_pool_can_run_it_is_said_not_bought() -> None:
    pending = (PendingDemand("training", count=1, oldest_wait_s=60, gpus=16),
               PendingDemand("training", count=1, oldest_wait_s=60, gpus=1, gpu_models=("B200",)))
    plan = decide(FleetObservation(now=0, pools=(L4,), pending=pending))
    assert not plan.scale_outs and len(plan.unservable) == 2, plan
    assert any("16 GPUs" in line for line in plan.unservable)


def test_booting_nodes_count_as_supply() -> None:
    pending = (PendingDemand("training", count=2, oldest_wait_s=600, gpus=8),)
    nodes = (NodeState("h100-9", "h100", "booting"),)
    plan = decide(FleetObservation(now=0, pools=POOLS, nodes=nodes, pending=pending))
    assert [(o.pool, o.count) for o in plan.scale_outs] == [("h100", 1)]


def test_cool_down_and_ceiling_hold_back_with_a_reason() -> None:
    pending = (PendingDemand("training", count=10, oldest_wait_s=600, gpus=8),)
    history = (("h100", PoolHistory(last_scale_out_at=900.0)),)
    cooling = decide(FleetObservation(now=1000, pools=POOLS, nodes=(ready("a", jobs=1),), pending=pending,
                                      history=history))
    assert not cooling.scale_outs and "cooling down" in cooling.pools[0].held_back[0]
    later = decide(FleetObservation(now=1200, pools=POOLS, nodes=(ready("a", jobs=1),), pending=pending,
                                    history=history))
    (out,) = later.scale_outs
    assert out.count == 4  # max_step
    full = tuple(ready(f"n{i}", jobs=1) for i in range(6))
    at_ceiling = decide(FleetObservation(now=1200, pools=POOLS, nodes=full, pending=pending))
    assert not at_ceiling.scale_outs and "ceiling of 6" in at_ceiling.pools[0].held_back[0]


def test_memory_pressure_adds_a_replica_only_when_no_gpu_is_free() -> None:
    pressure = (MemoryPressure("j1", "inference", "L4", 1.0), MemoryPressure("j2", "inference", "L4", 1.0))
    busy = decide(FleetObservation(now=0, pools=(L4,), nodes=(ready("l4-1", "l4", jobs=4),), pressure=pressure))
    assert [(o.pool, o.count) for o in busy.scale_outs] == [("l4", 1)]
    assert "memory pressure" in busy.scale_outs[0].reason
    room = decide(FleetObservation(now=0, pools=(L4,), nodes=(ready("l4-1", "l4", jobs=1, free=3),),
                                   pressure=pressure))
    assert not room.scale_outs


def test_floor_is_restored() -> None:
    plan = decide(FleetObservation(now=0, pools=POOLS))
    assert [(o.pool, o.count) for o in plan.scale_outs] == [("h100", 1)]
    assert "below the floor" in plan.scale_outs[0].reason


def test_drains_the_longest_idle_nodes_only_down_to_the_floor_and_never_busy_ones() -> None:
    nodes = (ready("a", idle_since=0), ready("b", idle_since=100), ready("c", idle_since=9500),
             ready("d", jobs=1, pinned=True), ready("e", jobs=2), NodeState("f", "h100", "booting"))
    plan = decide(FleetObservation(now=10_000, pools=(H100,), nodes=nodes))
    (drain,) = plan.drains
    assert drain.node_ids == ("a", "b")  # c idle too briefly; d, e run work; f boots
    assert plan.desired() == {"h100": 4}
    only_idle = decide(FleetObservation(now=10_000, pools=(H100,), nodes=nodes[:2]))
    assert only_idle.drains[0].node_ids == ("a",)  # the floor keeps one
    assert "floor" in only_idle.drains[0].reason


def test_no_drain_soon_after_a_scale_out() -> None:
    nodes = (ready("a", idle_since=0), ready("b", idle_since=0))
    history = (("h100", PoolHistory(last_scale_out_at=9_700.0)),)
    plan = decide(FleetObservation(now=10_000, pools=(H100,), nodes=nodes, history=history))
    assert not plan.drains and "cooling down" in plan.pools[0].held_back[0]


def test_the_same_observation_gives_the_same_plan() -> None:
    obs = FleetObservation(now=10_000, pools=POOLS, nodes=(ready("a", idle_since=0), ready("b", idle_since=5)),
                           pending=(PendingDemand("inference", 3, 100, gpu_milli=500),))
    assert decide(obs) == decide(obs)


def test_headroom_is_kept_free_and_never_drained() -> None:
    pool = PoolSpec("l4", SIM_NODE_TYPES["l4x4"], headroom_gpus=6, idle_before_drain_s=0)
    short = decide(FleetObservation(now=0, pools=(pool,), nodes=(ready("a", "l4", jobs=3, free=1),)))
    assert [(o.pool, o.count) for o in short.scale_outs] == [("l4", 2)]
    assert "headroom" in short.scale_outs[0].reason
    idle = tuple(ready(f"n{i}", "l4", idle_since=0, free=4) for i in range(3))
    plan = decide(FleetObservation(now=100, pools=(pool,), nodes=idle))
    assert len(plan.drains[0].node_ids) == 1  # 12 free, 6 kept: one 4-GPU node may go
