"""The autoscaling decision: ``decide(observation) -> CapacityPlan``, pure (no clock, no I/O).

    pending demand (cannot fit now; waited >= the pool's min_wait for its tier)     memory pressure (inference)
          │ each shape to the cheapest pool whose node type can run it                │ replicas not covered by
          │ (GPU model, MIG profile, GPUs per node), spilling to the next at ceiling  │ free GPUs of the pool
          ▼                                                                           ▼
    per pool: first-fit-decreasing of the GPUs asked onto fresh nodes ─ nodes already booting ─► wanted
          │                                          + up to the floor when the pool is below it
          ▼
    scale-out = min(wanted, max_step, ceiling - current)  unless cooling down since the last scale-out
          │ nothing to add and nothing pending that this pool could serve
          ▼
    + enough nodes to keep headroom_gpus free (ready free GPUs and booting nodes not spoken for)
    scale-in: ready nodes idle for idle_before_drain_s, running no job (so never non-preemptible work),
              longest idle first, at most max_step, never below the floor nor the headroom, not within
              scale_in_cooldown_s of the pool's last scale-out or drain

Contract (property-tested in tests/test_autoscaler_properties.py):
- a drained node is ready, runs nothing and in particular nothing non-preemptible;
- ``desired`` never exceeds the ceiling through a scale-out, and never goes below the floor through a drain;
- no scale-out within ``scale_out_cooldown_s`` of the pool's last scale-out, no drain within
  ``scale_in_cooldown_s`` of its last scale-out or drain; at most ``max_step`` nodes either way;
- a pool is never grown and drained in the same plan.
What was wanted but held back (ceiling, cool-down) is said in ``PoolDecision.held_back``.
"""

from __future__ import annotations

from collections import defaultdict

from gpuorch_capacity.model import (
    CapacityPlan,
    Drain,
    FleetObservation,
    NodeState,
    PendingDemand,
    PoolDecision,
    PoolSpec,
    ScaleOut,
    nodes_for,
)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _cost_order(pools: tuple[PoolSpec, ...]) -> list[PoolSpec]:
    return sorted(pools, key=lambda p: (p.node_type.gpu_hour_cost, p.node_type.gpus, p.name))


def decide(observation: FleetObservation) -> CapacityPlan:
    """The plan for this moment: per pool how many nodes to add (and why), which idle nodes to drain, and what was
    held back. Pure: the same observation gives the same plan."""
    obs = observation
    members: dict[str, list[NodeState]] = defaultdict(list)
    for node in obs.nodes:
        members[node.pool].append(node)
    current = {p.name: sum(1 for n in members[p.name] if n.phase != "draining") for p in obs.pools}
    booting = {p.name: sum(1 for n in members[p.name] if n.phase == "booting") for p in obs.pools}

    # 1. route each pending shape to the cheapest pool that can run it, spilling over at the ceiling
    slots: dict[str, list[float]] = defaultdict(list)
    why: dict[str, list[PendingDemand]] = defaultdict(list)
    blocked_drain: set[str] = set()
    unservable: list[str] = []
    room = {p.name: p.ceiling - current[p.name] for p in obs.pools}
    for demand in sorted(obs.pending, key=lambda d: (-d.oldest_wait_s, d.tier, d.describe())):
        candidates = [p for p in _cost_order(obs.pools) if demand.fits(p.node_type)]
        if not candidates:
            if demand.gpus or demand.gpu_milli or demand.mig_profile:
                unservable.append(f"{demand.count} {demand.tier} job(s) asking {demand.describe()}: no pool's "
                                  "node type can run them")
            continue
        blocked_drain.update(p.name for p in candidates)
        target = candidates[0]
        for pool in candidates:
            needed = nodes_for(demand.gpu_slots(pool.node_type), pool.node_type.gpus)
            if needed <= room[pool.name]:
                target = pool
                break
        if demand.oldest_wait_s < target.wait_threshold_s(demand.tier):
            continue
        taken = demand.gpu_slots(target.node_type)
        slots[target.name].extend(taken)
        room[target.name] -= nodes_for(taken, target.node_type.gpus)
        why[target.name].append(demand)

    # 2. memory pressure: replicas that the pool's free GPUs do not already cover
    pressure_gpus: dict[str, float] = defaultdict(float)
    pressure_jobs: dict[str, int] = defaultdict(int)
    for signal in obs.pressure:
        pools = [p for p in _cost_order(obs.pools) if p.node_type.gpu_model == signal.gpu_model]
        if pools:
            pressure_gpus[pools[0].name] += signal.gpus
            pressure_jobs[pools[0].name] += 1

    decisions = []
    for pool in sorted(obs.pools, key=lambda p: p.name):
        decisions.append(_decide_pool(obs, pool, members[pool.name], current[pool.name], booting[pool.name],
                                      slots[pool.name], why[pool.name], pressure_gpus[pool.name],
                                      pressure_jobs[pool.name], pool.name in blocked_drain))
    return CapacityPlan(now=obs.now, pools=tuple(decisions), unservable=tuple(unservable))


def _decide_pool(obs: FleetObservation, pool: PoolSpec, nodes: list[NodeState], current: int, booting: int,
                 slots: list[float], demands: list[PendingDemand], pressure_gpus: float, pressure_jobs: int,
                 demand_could_use_pool: bool) -> PoolDecision:
    history = obs.history_of(pool.name)
    node_type = pool.node_type
    reasons: list[str] = []
    held: list[str] = []

    free_gpus = sum(n.free_gpus for n in nodes if n.phase == "ready")
    if pressure_gpus > free_gpus:
        slots = [*slots, *([1.0] * int(pressure_gpus - free_gpus + 0.999))]
        reasons.append(f"{pressure_jobs} inference job(s) under memory pressure need about "
                       f"{pressure_gpus:.1f} more GPU(s), {free_gpus} free")
    for_pending = nodes_for(slots, node_type.gpus)
    wanted = max(0, for_pending - booting)
    spare = free_gpus + max(0, booting - for_pending) * node_type.gpus
    if spare < pool.headroom_gpus:
        extra = -(-(pool.headroom_gpus - spare) // node_type.gpus)
        wanted += extra
        reasons.append(f"keep {pool.headroom_gpus} GPU(s) free as headroom, {spare} free")
    if demands:
        jobs = sum(d.count for d in demands)
        shapes = ", ".join(sorted({f"{d.tier} {d.describe()}" for d in demands}))
        oldest = max(d.oldest_wait_s for d in demands)
        reasons.insert(0, f"{jobs} pending job(s) that fit nowhere now ({shapes}), oldest waiting "
                          f"{_minutes(oldest)}")
    if booting and wanted == 0 and slots:
        held.append(f"{booting} node(s) already booting cover the demand")
    if current + wanted < pool.floor:
        wanted = pool.floor - current
        reasons.append(f"below the floor of {pool.floor} node(s)")

    scale_out = None
    if wanted > 0:
        count = min(wanted, pool.max_step, pool.ceiling - current)
        since = None if history.last_scale_out_at is None else obs.now - history.last_scale_out_at
        if count <= 0:
            held.append(f"wanted {wanted} more {node_type.name} node(s) but the pool is at its ceiling of "
                        f"{pool.ceiling}")
        elif since is not None and since < pool.scale_out_cooldown_s:
            held.append(f"wanted {count} more {node_type.name} node(s); cooling down for another "
                        f"{_minutes(pool.scale_out_cooldown_s - since)} after the last scale-out")
        else:
            if count < wanted:
                held.append(f"wanted {wanted} node(s), capped at {count} (ceiling {pool.ceiling}, "
                            f"step {pool.max_step})")
            scale_out = ScaleOut(pool.name, count, f"add {count} {node_type.name} node(s) "
                                 f"({count * node_type.gpus} x {node_type.gpu_model}): " + "; ".join(reasons))
    if scale_out is not None or wanted > 0 or demand_could_use_pool:
        return PoolDecision(pool.name, current, current + (scale_out.count if scale_out else 0),
                            scale_out=scale_out, held_back=tuple(held))

    idle = sorted(
        (n for n in nodes if n.phase == "ready" and n.running_jobs == 0 and not n.runs_non_preemptible
         and n.idle_since is not None and obs.now - n.idle_since >= pool.idle_before_drain_s),
        key=lambda n: (n.idle_since, n.node_id),
    )
    count = min(len(idle), pool.max_step, current - pool.floor, (spare - pool.headroom_gpus) // node_type.gpus)
    drain = None
    if count > 0:
        last = max((t for t in (history.last_scale_in_at, history.last_scale_out_at) if t is not None), default=None)
        if last is not None and obs.now - last < pool.scale_in_cooldown_s:
            held.append(f"{count} idle node(s) could be drained; cooling down for another "
                        f"{_minutes(pool.scale_in_cooldown_s - (obs.now - last))}")
            count = 0
        else:
            chosen = idle[:count]
            longest = obs.now - (chosen[0].idle_since or obs.now)
            drain = Drain(pool.name, tuple(n.node_id for n in chosen),
                          f"drain {count} idle {node_type.name} node(s) (idle up to {_minutes(longest)}, nothing "
                          f"pending that they could run; floor {pool.floor})")
    elif idle and current <= pool.floor:
        held.append(f"{len(idle)} idle node(s) kept: the pool is at its floor of {pool.floor}")
    elif idle and pool.headroom_gpus:
        held.append(f"{len(idle)} idle node(s) kept as headroom ({pool.headroom_gpus} GPU(s))")
    return PoolDecision(pool.name, current, current - count, drain=drain, held_back=tuple(held))
