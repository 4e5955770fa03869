"""What the API shows, computed from read-model rows: pure functions, no I/O, ``now`` passed in.

    node_view(node row, active allocations, now)   -> GPUs and MIG slices, free/allocated, health, last seen
    queue_views(queued rows, now)                 -> per tier: depth, oldest wait, pending reasons, next starts
    tenant_views(use rows, quotas)                -> per tenant: allocated GPUs against quota and use
    job_view(job row, caller may see spec)        -> the public shape of a job

A GPU is free when nothing is allocated on it (no milli, no MIG instance in use); a MIG instance is free when no
active job holds it. Allocations come from the ``jobs`` read model (placed, running, preempting).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from typing import Any

from gpuorch_contracts.jobs import gpu_equivalents

TIERS = ("training", "inference", "batch", "interactive")


def _gpu_allocations(node_id: str, allocations: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """GPU uuid (or MIG instance uuid) -> the allocations on it: ``{"job_id", "tenant", "milli", "mig_profile",
    "memory_mib", "used"}`` (``used``: the job's newest telemetry sample on that device, or {})."""
    out: dict[str, list[dict[str, Any]]] = {}
    for allocation in allocations:
        for assignment in allocation["assignments"]:
            if assignment.get("node_id") != node_id:
                continue
            for gpu in assignment.get("gpus", []):
                out.setdefault(gpu["gpu_uuid"], []).append({
                    "job_id": str(allocation["job_id"]), "tenant": allocation["tenant"],
                    "milli": gpu.get("milli", 1000), "mig_profile": gpu.get("mig_profile"),
                    "gpu_index": gpu.get("gpu_index"), "memory_mib": gpu.get("memory_mib"),
                    "used": (allocation.get("usage") or {}).get(gpu["gpu_uuid"], {})})
    return out


def node_view(node: dict[str, Any], allocations: list[dict[str, Any]], now: datetime,
              visible: frozenset[str] | None = None) -> dict[str, Any]:
    """One node for people: its GPUs (with MIG slices) free or allocated, live usage, health and last seen.

    ``visible``: tenants whose job ids may be shown (None: all); other jobs on a GPU show as ``"other tenant"``.
    """
    inventory = node["inventory"]
    held = _gpu_allocations(node["node_id"], allocations)
    gpus = []
    for gpu in inventory.get("gpus", []):
        on_gpu = list(held.get(gpu["uuid"], []))
        slices = []
        for instance in gpu.get("mig_instances", []):
            users = held.get(instance["uuid"], [])
            on_gpu += users
            used = node.get("slice_samples", {}).get(instance["uuid"], {}) if users else {}
            slices.append({"uuid": instance["uuid"], "profile": instance["profile"],
                           "memory_mib": instance["memory_mib"], "allocated": bool(users),
                           "jobs": [_job_ref(u, visible) for u in users],
                           "utilization_pct": used.get("util_pct"), "memory_used_mib": used.get("memory_used_mib")})
        # shares are recorded against the GPU; a MIG allocation by index, under the instance's uuid or the GPU's
        milli = min(1000, sum(a["milli"] for a in held.get(gpu["uuid"], []) if not a["mig_profile"]))
        sample = node.get("samples", {}).get(gpu["uuid"], {})
        gpus.append({
            "index": gpu["index"], "uuid": gpu["uuid"], "model": gpu["model"],
            "memory_total_mib": gpu["memory_total_mib"], "health": gpu.get("health", "healthy"),
            "health_reason": gpu.get("health_reason"), "mig_enabled": gpu.get("mig_enabled", False),
            "allocated_milli": milli, "free": not on_gpu, "mig_slices": slices,
            "jobs": [_job_ref(a, visible) for a in on_gpu],
            "utilization_pct": sample.get("util_pct"), "memory_used_mib": sample.get("memory_used_mib"),
            "temperature_c": sample.get("temperature_c"), "power_w": sample.get("power_w"),
        })
    last_seen = node.get("last_seen")
    return {
        "node_id": node["node_id"], "liveness": node["liveness"], "hostname": inventory.get("hostname", ""),
        "last_seen": last_seen, "last_seen_s": round((now - last_seen).total_seconds(), 1) if last_seen else None,
        "gpus_total": len(gpus), "gpus_free": sum(1 for g in gpus if g["free"]),
        "gpus_allocated": sum(1 for g in gpus if not g["free"]),
        "mig_slices_total": sum(len(g["mig_slices"]) for g in gpus),
        "mig_slices_free": sum(1 for g in gpus for s in g["mig_slices"] if not s["allocated"]),
        "cpu_milli": inventory.get("cpu_milli"), "memory_mib": inventory.get("memory_mib"),
        "isolation": node.get("isolation"), "gpus": gpus,
    }


def _job_ref(allocation: dict[str, Any], visible: frozenset[str] | None) -> dict[str, Any]:
    if visible is not None and allocation["tenant"] not in visible:
        return {"job_id": None, "tenant": "other tenant", "milli": allocation["milli"]}
    used = allocation.get("used") or {}
    return {"job_id": allocation["job_id"], "tenant": allocation["tenant"], "milli": allocation["milli"],
            "mig_profile": allocation["mig_profile"], "memory_mib": allocation.get("memory_mib"),
            "memory_used_mib": used.get("memory_used_mib"), "utilization_pct": used.get("util_pct")}


def queue_views(queued: list[dict[str, Any]], now: datetime, *, next_starts: int = 5) -> list[dict[str, Any]]:
    """Per tier: how many wait, the oldest wait, why they wait (most common reasons first) and the next
    estimated starts (the scheduler's estimates; a job without one has none)."""
    out = []
    for tier in TIERS:
        rows = [r for r in queued if r["tier"] == tier]
        oldest = min((r["submitted_at"] for r in rows), default=None)
        reasons = Counter(r["pending_reason"] or "not yet considered" for r in rows)
        estimated = sorted((r for r in rows if r.get("estimated_start")), key=lambda r: r["estimated_start"])
        out.append({
            "tier": tier, "depth": len(rows),
            "oldest_wait_s": round((now - oldest).total_seconds(), 1) if oldest else None,
            "pending_reasons": [{"reason": reason, "jobs": n} for reason, n in reasons.most_common(5)],
            "estimated_starts": [{"job_id": str(r["job_id"]), "name": r["name"], "tenant": r["tenant"],
                                  "estimated_start": r["estimated_start"],
                                  "in_s": round(max(0.0, (r["estimated_start"] - now).total_seconds()), 1)}
                                 for r in estimated[:next_starts]],
        })
    return out


def tenant_views(use: list[dict[str, Any]], quotas: dict[str, dict[str, Any]],
                 also: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Per tenant: GPUs allocated, its GPU quota (``quotas[tenant]["gpus"]``, else the ``"*"`` entry, else none),
    and use: the allocated GPUs times their mean utilisation over the last minutes (None before any sample).
    ``also``: tenants to show even with nothing allocated or waiting (the caller's own, the quotas')."""
    idle = {"allocated_gpus": 0.0, "queued": 0, "running": 0, "mean_util_pct": None}
    shown = {row["tenant"] for row in use}
    rows = sorted([*use, *({"tenant": t, **idle} for t in also - shown - {"*"})], key=lambda r: r["tenant"])
    out = []
    for row in rows:
        quota = (quotas.get(row["tenant"]) or quotas.get("*") or {}).get("gpus")
        util = row.get("mean_util_pct")
        allocated = float(row["allocated_gpus"])
        out.append({"tenant": row["tenant"], "allocated_gpus": round(allocated, 3), "quota_gpus": quota,
                    "used_gpus": round(allocated * util / 100.0, 3) if util is not None else None,
                    "mean_util_pct": round(util, 1) if util is not None else None,
                    "queued": row["queued"], "running": row["running"]})
    return out


def gpu_text(assignments: list[dict[str, Any]]) -> str:
    """``0,1`` for whole GPUs, ``2:250m/4096MiB`` for a share (its memory when it has one), ``3:1g.10gb`` for a MIG
    instance."""
    parts = []
    for assignment in assignments:
        for gpu in assignment.get("gpus", []):
            label = gpu.get("mig_profile") or ("" if gpu.get("milli", 1000) == 1000 else f"{gpu['milli']}m" + (
                f"/{gpu['memory_mib']}MiB" if gpu.get("memory_mib") else ""))
            parts.append(f"{gpu['gpu_index']}{':' + label if label else ''}")
    return ",".join(parts)


def allocated_gpus(assignments: list[dict[str, Any]]) -> float:
    """GPUs held, in GPU equivalents (``gpu_equivalents``): a whole GPU 1, a share its milli / 1000, a MIG instance
    its compute slices / 7 (``3g.40gb``: 0.429). Rounded to 3 decimals."""
    return round(sum(gpu_equivalents(g.get("milli", 1000), g.get("mig_profile"))
                     for a in assignments for g in a.get("gpus", [])), 3)


def _counts(raw: Any) -> dict[str, int] | None:
    """An array row's tasks by state (``queued``, ``running``, ``succeeded``, ``failed``, ``cancelled``)."""
    if raw is None:
        return None
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def job_view(row: dict[str, Any], *, full: bool = False) -> dict[str, Any]:
    """The public shape of a job (the same keys ``gpuctl jobs --json`` printed from the database)."""
    out: dict[str, Any] = {
        "id": str(row["job_id"]), "name": row["name"], "tenant": row["tenant"], "tier": row["tier"],
        "priority_class": row["priority_class"], "state": row["state"],
        "node": (row["node_ids"] or [None])[0], "nodes": row["node_ids"] or [],
        "gpus": gpu_text(row["assignments"]) or "-", "allocated_gpus": allocated_gpus(row["assignments"]),
        "exit_code": row["exit_code"], "reason": row["reason"],
        "pending_reason": row["pending_reason"], "submitted_at": row["submitted_at"],
        "started_at": row["started_at"], "ended_at": row["ended_at"], "requeues": row["requeues"],
        "estimated_start": row["estimated_start"], "updated_at": row.get("updated_at"),
        "array_id": str(row["array_id"]) if row.get("array_id") else None, "array_index": row.get("array_index"),
        "array_counts": _counts(row.get("array_counts")),
    }
    if full:
        out.update({"spec": row["spec"], "placement_id": str(row["placement_id"]) if row["placement_id"] else None,
                    "placed_at": row["placed_at"], "assignments": row["assignments"]})
    return out


def reservation_view(row: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A reservation row as shown: its phase (refused, deleted, pending, active, ended) from the clock, and the
    problems that keep it from being honoured (nodes not alive or gone), from the nodes' liveness."""
    start, end = row["start_at"], row["end_at"]
    if row["outcome"] != "created":
        phase = row["outcome"]
    elif now >= end:
        phase = "ended"
    elif now >= start:
        phase = "active"
    else:
        phase = "pending"
    liveness = dict(row.get("node_liveness") or [])
    problems = [f"node {n} is {liveness.get(n, 'gone')}" for n in row["nodes"] if liveness.get(n) != "alive"]
    if problems and phase in ("pending", "active"):
        problems.insert(0, "cannot be honoured: some of its nodes are not alive")
    return {"reservation_id": row["reservation_id"], "tenant": row["tenant"], "gpus": row["gpus"],
            "gpu_model": row["gpu_model"], "nodes": list(row["nodes"]), "start_at": start, "end_at": end,
            "created_by": row["created_by"], "state": phase, "reason": row["reason"], "problems": problems}

