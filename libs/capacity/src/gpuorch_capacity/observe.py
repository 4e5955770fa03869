"""Rows of the read models in, a ``FleetObservation`` out (pure: the SQL lives with the caller, telemetry).

    pools_from_json(GPUORCH_CAPACITY_POOLS)             -> the PoolSpecs
    observation(now, pools, node_rows, running_rows, queued_rows, pressure_rows, history_rows, draining)
        node_rows     nodes: node_id, liveness, inventory (NodeInventory as JSON), last_job_end (when it last
                      ran something, or registered; None: unknown)
        running_rows  jobs placed or running: job_id, node_ids, assignments, preemptible
        queued_rows   jobs queued: tier, spec, submitted_at, pending_reason
        pressure_rows open memory_pressure alerts: job_id, tier, node_id, gpus
        history_rows  per pool: last_scale_out_at, last_scale_in_at (datetimes)
        asked         per pool: nodes the autoscaler asked for lately; those not registered yet are booting

A node belongs to the pool named by its label ``gpuorch.io/pool``, else to the first pool whose node type has its
GPU model and GPU count, else to the first with its GPU model; a node of no pool is not the autoscaler's. Jobs
waiting because of a quota are not demand (more nodes would not start them), nor are MIG jobs whose pending reason
says the MIG plan hosts them by repartitioning a GPU the fleet already has (``MIG_PLAN_NOTE``: cheaper than a node).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from gpuorch_policy.mig_planner import MIG_PLAN_NOTE

from gpuorch_capacity.model import (
    SIM_NODE_TYPES,
    FleetObservation,
    MemoryPressure,
    NodeState,
    NodeType,
    PendingDemand,
    PoolHistory,
    PoolSpec,
)

POOL_LABEL = "gpuorch.io/pool"
IDLE_HORIZON_S = 86400.0
"""A node that ran nothing we know of counts as idle since this long ago at most."""


def pools_from_json(text: str) -> tuple[PoolSpec, ...]:
    """``[{"name": "h100", "node_type": "h100x8", "floor": 1, "ceiling": 8, ...}]``; ``node_type`` names one of
    ``SIM_NODE_TYPES`` or is an object of ``NodeType`` fields; ``min_wait_s`` is an object ``{tier: seconds}``.
    Raises ``ValueError`` with the reason."""
    raw = json.loads(text) if text.strip() else []
    if not isinstance(raw, list):
        raise ValueError("GPUORCH_CAPACITY_POOLS must be a JSON list of pools")
    pools = []
    for item in raw:
        fields = dict(item)
        node_type = fields.pop("node_type")
        if isinstance(node_type, str):
            if node_type not in SIM_NODE_TYPES:
                raise ValueError(f"unknown node type {node_type!r}; known: {', '.join(SIM_NODE_TYPES)}")
            resolved = SIM_NODE_TYPES[node_type]
        else:
            nt = dict(node_type)
            nt["mig_profiles"] = tuple(nt.get("mig_profiles", ()))
            resolved = NodeType(**nt)
        if isinstance(fields.get("min_wait_s"), Mapping):
            fields["min_wait_s"] = tuple(sorted(fields["min_wait_s"].items()))
        pools.append(PoolSpec(node_type=resolved, **fields))
    if len({p.name for p in pools}) != len(pools):
        raise ValueError("pool names must be unique")
    return tuple(pools)


def pool_of(inventory: Mapping[str, Any], pools: Iterable[PoolSpec]) -> str | None:
    pools = list(pools)
    label = (inventory.get("labels") or {}).get(POOL_LABEL)
    if label and any(p.name == label for p in pools):
        return str(label)
    gpus = inventory.get("gpus") or []
    if not gpus:
        return None
    model = gpus[0].get("model")
    for p in pools:
        if p.node_type.gpu_model == model and p.node_type.gpus == len(gpus):
            return p.name
    return next((p.name for p in pools if p.node_type.gpu_model == model), None)


def _seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _as_dict(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def observation(now: datetime, pools: tuple[PoolSpec, ...], node_rows: Iterable[Mapping[str, Any]],
                running_rows: Iterable[Mapping[str, Any]], queued_rows: Iterable[Mapping[str, Any]],
                pressure_rows: Iterable[Mapping[str, Any]] = (), history_rows: Iterable[Mapping[str, Any]] = (),
                draining: Iterable[str] = (), asked: Mapping[str, int] | None = None) -> FleetObservation:
    """``asked``: per pool, the node count the autoscaler recently asked for; what has not registered yet counts
    as booting (so a follower of the desired gauge is not told to shrink while new nodes boot)."""
    t = now.timestamp()
    running: dict[str, list[Mapping[str, Any]]] = {}
    used: dict[str, set[int]] = {}
    for job in running_rows:
        for assignment in _as_dict(job["assignments"]) or []:
            node_id = assignment["node_id"]
            running.setdefault(node_id, []).append(job)
            used.setdefault(node_id, set()).update(g["gpu_index"] for g in assignment.get("gpus") or [])
    draining = set(draining)
    nodes = []
    models: dict[str, str] = {}
    for row in node_rows:
        if row["liveness"] == "lost":
            continue
        inventory = _as_dict(row["inventory"])
        pool = pool_of(inventory, pools)
        if pool is None:
            continue
        node_id = row["node_id"]
        gpus = inventory.get("gpus") or []
        if gpus:
            models[node_id] = gpus[0].get("model", "")
        jobs = running.get(node_id, [])
        last_end = _seconds(row.get("last_job_end"))
        idle_since = None if jobs else max(last_end or 0.0, t - IDLE_HORIZON_S)
        nodes.append(NodeState(
            node_id, pool, "draining" if node_id in draining else "ready", len(jobs),
            any(not j.get("preemptible") for j in jobs), idle_since,
            sum(1 for g in gpus if g.get("index") not in used.get(node_id, set()) and g.get("health", "healthy") ==
                "healthy"),
        ))
    for pool, level in (asked or {}).items():
        present = sum(1 for n in nodes if n.pool == pool and n.phase != "draining")
        nodes += [NodeState(f"{pool}/requested-{i}", pool, "booting") for i in range(max(0, level - present))]
    pending: dict[tuple[Any, ...], PendingDemand] = {}
    for row in queued_rows:
        reason = row.get("pending_reason") or ""
        if "quota" in reason or f"; {MIG_PLAN_NOTE}" in reason:
            continue
        spec = _as_dict(row["spec"]) or {}
        res = spec.get("resources") or {}
        mig = res.get("mig_profiles") or []
        demand = PendingDemand(
            row["tier"], 1, max(0.0, t - row["submitted_at"].timestamp()), gpus=int(res.get("gpus") or 0),
            gpu_milli=0 if res.get("gpus") or mig else int(res.get("gpu_milli") or (1000 if res.get("gpu_memory_mib")
                                                                                    else 0)),
            mig_profile=mig[0] if mig else "", gpu_models=tuple(res.get("gpu_models") or ()),
            nodes=int((spec.get("gang") or {}).get("nodes") or 1),
        )
        key = (demand.tier, demand.shape)
        old = pending.get(key)
        if old is not None:
            demand = PendingDemand(demand.tier, old.count + 1, max(old.oldest_wait_s, demand.oldest_wait_s),
                                   demand.gpus, demand.gpu_milli, demand.mig_profile, demand.gpu_models, demand.nodes)
        pending[key] = demand
    pressure = tuple(
        MemoryPressure(str(r["job_id"]), r.get("tier") or "inference", models.get(r["node_id"], ""),
                       float(r.get("gpus") or 1.0))
        for r in pressure_rows if r.get("tier") in (None, "inference") and r["node_id"] in models
    )
    history = tuple(
        (r["pool"], PoolHistory(_seconds(r.get("last_scale_out_at")), _seconds(r.get("last_scale_in_at"))))
        for r in history_rows
    )
    return FleetObservation(now=t, pools=pools, nodes=tuple(nodes), pending=tuple(pending.values()),
                            pressure=pressure, history=history)
