"""Properties of every plan, over generated fleets, queues, pressure and histories (hypothesis).

Never drains a node that runs work (so never non-preemptible work); never grows past a ceiling nor drains below a
floor; never acts inside a cool-down; at most max_step nodes either way; never grows and drains one pool at once.
"""

from __future__ import annotations

from gpuorch_capacity import (
    SIM_NODE_TYPES,
    FleetObservation,
    MemoryPressure,
    NodeState,
    PendingDemand,
    PoolHistory,
    PoolSpec,
    decide,
)
from hypothesis import given, settings
from hypothesis import strategies as st

TYPES = list(SIM_NODE_TYPES.values())
NOW = 100_000.0


@st.composite
def pools(draw: st.DrawFn) -> tuple[PoolSpec, ...]:
    chosen = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique_by=lambda t: t.name))
    out = []
    for t in chosen:
        floor = draw(st.integers(0, 3))
        out.append(PoolSpec(
            t.name, t, floor=floor, ceiling=draw(st.integers(floor, 8)),
            scale_out_cooldown_s=draw(st.sampled_from([0.0, 60.0, 300.0, 3600.0])),
            scale_in_cooldown_s=draw(st.sampled_from([0.0, 120.0, 600.0, 7200.0])),
            idle_before_drain_s=draw(st.sampled_from([0.0, 300.0, 900.0])),
            max_step=draw(st.integers(1, 5)),
            min_wait_s=(("batch", draw(st.sampled_from([0.0, 600.0]))),),
            headroom_gpus=draw(st.sampled_from([0, 0, 2, 8])),
        ))
    return tuple(out)


@st.composite
def observations(draw: st.DrawFn) -> FleetObservation:
    ps = draw(pools())
    nodes = []
    for i in range(draw(st.integers(0, 14))):
        pool = draw(st.sampled_from(ps))
        phase = draw(st.sampled_from(["booting", "ready", "ready", "ready", "draining"]))
        jobs = draw(st.integers(0, 3))
        pinned = jobs > 0 and draw(st.booleans())
        # idle_since may even be set on a node that runs work (a stale read): the core must still not drain it
        idle_since = draw(st.one_of(st.none(), st.floats(NOW - 20_000, NOW)))
        nodes.append(NodeState(f"n{i}", pool.name, phase, jobs, pinned, idle_since,
                               draw(st.integers(0, pool.node_type.gpus))))
    demand = st.builds(
        PendingDemand, tier=st.sampled_from(["training", "inference", "batch"]), count=st.integers(1, 12),
        oldest_wait_s=st.floats(0, 7200), gpus=st.sampled_from([0, 1, 2, 4, 8, 16]),
        gpu_milli=st.sampled_from([0, 250, 500]), mig_profile=st.sampled_from(["", "", "1g.10gb", "3g.40gb"]),
        gpu_models=st.sampled_from([(), ("H100-80GB",), ("L4",), ("A100-80GB", "H100-80GB")]),
        nodes=st.integers(1, 3),
    )
    pressure = st.builds(MemoryPressure, job_id=st.text(min_size=1, max_size=4), tier=st.just("inference"),
                         gpu_model=st.sampled_from(["L4", "H100-80GB"]), gpus=st.sampled_from([0.25, 1.0, 2.0]))
    history = tuple(
        (p.name, PoolHistory(draw(st.one_of(st.none(), st.floats(NOW - 8000, NOW))),
                             draw(st.one_of(st.none(), st.floats(NOW - 8000, NOW)))))
        for p in ps
    )
    return FleetObservation(now=NOW, pools=ps, nodes=tuple(nodes), pending=tuple(draw(st.lists(demand, max_size=6))),
                            pressure=tuple(draw(st.lists(pressure, max_size=4))), history=history)


@settings(max_examples=200, deadline=None)
@given(observations())
def test_every_plan_keeps_the_rules(obs: FleetObservation) -> None:
    plan = decide(obs)
    by_id = {n.node_id: n for n in obs.nodes}
    specs = {p.name: p for p in obs.pools}
    assert {d.pool for d in plan.pools} == set(specs)
    for decision in plan.pools:
        pool = specs[decision.pool]
        history = obs.history_of(pool.name)
        current = sum(1 for n in obs.nodes if n.pool == pool.name and n.phase != "draining")
        assert decision.current == current
        assert not (decision.scale_out and decision.drain), "grown and drained at once"
        if decision.scale_out is not None:
            count = decision.scale_out.count
            assert 1 <= count <= pool.max_step
            assert current + count <= pool.ceiling, "grown past the ceiling"
            assert decision.desired == current + count
            last = history.last_scale_out_at
            assert last is None or obs.now - last >= pool.scale_out_cooldown_s, "grown inside the cool-down"
        if decision.drain is not None:
            ids = decision.drain.node_ids
            assert 1 <= len(ids) <= pool.max_step and len(set(ids)) == len(ids)
            assert current - len(ids) >= pool.floor, "drained below the floor"
            assert decision.desired == current - len(ids)
            free_after = sum(n.free_gpus for n in obs.nodes if n.pool == pool.name and n.phase == "ready"
                             and n.node_id not in ids)
            booting = sum(1 for n in obs.nodes if n.pool == pool.name and n.phase == "booting")
            assert free_after + booting * pool.node_type.gpus >= pool.headroom_gpus, "drained into the headroom"
            for node_id in ids:
                node = by_id[node_id]
                assert node.pool == pool.name and node.phase == "ready"
                assert not node.runs_non_preemptible, "drained a node running non-preemptible work"
                assert node.running_jobs == 0, "drained a busy node"
                assert node.idle_since is not None and obs.now - node.idle_since >= pool.idle_before_drain_s
            for last in (history.last_scale_in_at, history.last_scale_out_at):
                assert last is None or obs.now - last >= pool.scale_in_cooldown_s, "drained inside the cool-down"
        if decision.scale_out is None and decision.drain is None:
            assert decision.desired == current


@settings(max_examples=100, deadline=None)
@given(observations())
def test_a_pool_below_its_floor_is_grown_unless_held_back(obs: FleetObservation) -> None:
    plan = decide(obs)
    for decision in plan.pools:
        pool = next(p for p in obs.pools if p.name == decision.pool)
        if decision.current < pool.floor:
            assert decision.scale_out is not None or decision.held_back, decision
            assert decision.drain is None
