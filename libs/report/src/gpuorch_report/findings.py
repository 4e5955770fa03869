"""The weekly review's conclusions, computed from the rows ``reading`` fetched (pure: rows in, sentences out).

    jobs (allocated vs used, idle GPU-h) ──► idle_tenants        who holds idle GPUs, and what that cost
    oversized advice (evidence)          ──► right_sizing        which jobs to move to a MIG profile or a share,
                                                                 and how many GPUs that frees
    shares (peak vs share memory)        ──► share_sizing        shares oversized or undersized, and the size
                                                                 that fits
    scheduler jobs (shape, wait, state)  ──► short_of            request shapes that waited or can never run:
                                                                 is the fleet short of a GPU model or profile?
    GPU rollups (throttled_s, temp)      ──► throttling          nodes whose GPUs throttle (hot-spots)
    nodes, allocations, queue            ──► autoscaler          what gpuorch_capacity.decide would have done
                                                                 (or did: its recorded decisions)

Each conclusion names its subject and carries the figure behind it, so a script can act on the JSON. ``tenants``
are objects with ``tenant``, ``allocated_gpu_hours`` and ``idle_gpu_hours`` (``document.TenantUse``).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

IDLE_SHARE = 0.10
"""A tenant is said to hold idle GPUs when idle GPU-hours are at least this share of its allocation."""
SHORT_WAIT_S = 60.0
"""A request shape whose mean wait is at least this long (or that can never run) is a shortage."""
THROTTLE_SHARE = 0.10
"""A node is a hot-spot when its GPUs reported thermal/power throttling in at least this share of the time."""


@dataclass(frozen=True)
class Conclusion:
    kind: str
    """idle_gpus | idle_reservation | right_size | share_size | short_of | throttling | autoscaler | parked_sessions"""
    subject: str
    text: str
    gpu_hours: float | None = None
    gpus_freed: float | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def parked_sessions(tenants: list[Any]) -> list[Conclusion]:
    """Tenants whose idle interactive sessions were parked: the GPU-hours that went back to the queue."""
    out = [Conclusion("parked_sessions", t.tenant,
                      f"Parking idle sessions of tenant {t.tenant} gave back {_gpu_hours(t.parked_gpu_hours)} to the "
                      f"queue ({t.parks} park(s)).", gpu_hours=t.parked_gpu_hours)
           for t in tenants if getattr(t, "parked_gpu_hours", 0.0) > 0]
    return sorted(out, key=lambda c: -(c.gpu_hours or 0))


def idle_tenants(tenants: list[Any], jobs: list[dict[str, Any]]) -> list[Conclusion]:
    """Tenants whose allocations sat idle: GPU-hours, share of their allocation, and the idlest jobs named."""
    idlest: dict[str, list[str]] = defaultdict(list)
    for job in sorted(jobs, key=lambda j: -(j.get("idle_gpu_hours") or 0)):
        if (job.get("idle_gpu_hours") or 0) > 0 and len(idlest[job["tenant"]]) < 3:
            idlest[job["tenant"]].append(job.get("name") or job["job_id"][:8])
    out = []
    for t in tenants:
        if t.allocated_gpu_hours <= 0 or t.idle_gpu_hours <= 0:
            continue
        share = t.idle_gpu_hours / t.allocated_gpu_hours
        if share < IDLE_SHARE:
            continue
        out.append(Conclusion(
            "idle_gpus", t.tenant,
            f"Tenant {t.tenant} held {_gpu_hours(t.idle_gpu_hours)} of GPUs idle ({share * 100:.0f} % of the "
            f"{_gpu_hours(t.allocated_gpu_hours)} it was allocated), most in {', '.join(idlest[t.tenant]) or '-'}: "
            "stop idle jobs or ask for less.",
            gpu_hours=t.idle_gpu_hours,
        ))
    return sorted(out, key=lambda c: -(c.gpu_hours or 0))


def idle_reservations(rows: list[dict[str, Any]]) -> list[Conclusion]:
    """Advance reservations whose GPUs sat idle in the period: GPU-hours reserved (window within the period) minus
    those its tenant's jobs used on its nodes; largest first. A row: ``reservation_id``, ``tenant``, ``gpus``,
    ``nodes``, ``reserved_gpu_hours``, ``used_gpu_hours``."""
    out = []
    for row in rows:
        reserved = float(row["reserved_gpu_hours"] or 0.0)
        used = min(reserved, float(row["used_gpu_hours"] or 0.0))
        idle = reserved - used
        if idle <= 0:
            continue
        out.append(Conclusion(
            "idle_reservation", row["tenant"],
            f"Reservation {row['reservation_id'][:8]} of tenant {row['tenant']} ({row['gpus']} GPUs on "
            f"{', '.join(row['nodes'])}) sat idle for {_gpu_hours(idle)} of the {_gpu_hours(reserved)} reserved in "
            "the period: reserve less, or later, or delete it when plans change.",
            gpu_hours=idle,
        ))
    return sorted(out, key=lambda c: -(c.gpu_hours or 0))


_MIG = re.compile(r"the MIG profile (\S+)")


def right_sizing(jobs: list[dict[str, Any]], oversized: list[dict[str, Any]]) -> list[Conclusion]:
    """Jobs telemetry found oversized: the MIG profile or share that holds their peak, and the GPUs moving frees.

    ``oversized``: rows with ``job_id``, ``advice``, ``evidence`` (the recommendation's numbers). A job on ``g``
    whole GPUs moved to a share of ``m`` milli frees ``g - m/1000`` GPUs (per GPU; a MIG profile frees as much or
    more, the share is the conservative figure)."""
    by_id = {j["job_id"]: j for j in jobs}
    out = []
    for rec in oversized:
        evidence = rec.get("evidence") or {}
        job = by_id.get(rec["job_id"], {})
        gpus = float(job.get("gpus") or rec.get("gpus") or 1.0)
        milli = float(evidence.get("recommended_share_milli") or 1000)
        freed = max(0.0, gpus - gpus * milli / 1000)
        if freed <= 0:
            continue
        name = job.get("name") or rec.get("name") or rec["job_id"][:8]
        peak = evidence.get("peak_memory_mib")
        mig = _MIG.search(rec.get("advice") or "")
        target = f"MIG {mig.group(1).rstrip(',')} or a {milli:.0f}-milli share" if mig else f"a {milli:.0f}-milli share"
        peak_text = f" (peak {peak / 1024:.1f} GiB of GPU memory)" if peak else ""
        out.append(Conclusion(
            "right_size", name,
            f"Move job {name} of tenant {job.get('tenant') or rec.get('tenant') or '?'} from {gpus:g} whole GPU(s) to "
            f"{target}{peak_text}: frees {freed:.2f} GPU(s) while it runs.",
            gpus_freed=freed,
        ))
    return sorted(out, key=lambda c: -(c.gpus_freed or 0))


SHARE_OVERSIZED = 0.5
"""A share whose peak GPU memory stayed below this fraction of its memory is oversized."""
SHARE_HEADROOM = 0.2


def share_sizing(jobs: list[dict[str, Any]]) -> list[Conclusion]:
    """Shares (less than one GPU, with a memory size) whose peak GPU memory was above their share (undersized: the
    watchdog stops them, docs/sharing.md) or below ``SHARE_OVERSIZED`` of it (oversized), with the size that holds
    the peak plus ``SHARE_HEADROOM`` (``--share auto`` asks for it from the runs' p95)."""
    out = []
    for job in jobs:
        alloc, peak = job.get("alloc_memory_mib_per_gpu"), job.get("peak_memory_mib_per_gpu")
        gpus = job.get("gpus")
        if not alloc or peak is None or gpus is None or gpus >= (job.get("devices") or 1):
            continue
        if peak > alloc:
            verdict = "undersized"
        elif peak < SHARE_OVERSIZED * alloc:
            verdict = "oversized"
        else:
            continue
        fits = int(-(-peak * (1 + SHARE_HEADROOM) // 256) * 256)
        name = job.get("name") or job["job_id"][:8]
        out.append(Conclusion(
            "share_size", name,
            f"Job {name} of tenant {job.get('tenant') or '?'} has an {verdict} share: its GPU memory peaked at "
            f"{peak} MiB of the {alloc} MiB share; a share of {fits} MiB holds the peak plus "
            f"{SHARE_HEADROOM:.0%} (or --share auto).",
        ))
    return sorted(out, key=lambda c: c.subject)


def shape_of(spec: dict[str, Any]) -> str:
    """A request shape in words: ``4 GPUs (H100-80GB)``, ``share 250m``, ``MIG 1g.10gb``, ``2 nodes x 8 GPUs``."""
    res = spec.get("resources") or {}
    nodes = int((spec.get("gang") or {}).get("nodes") or 1)
    if res.get("mig_profiles"):
        what = "MIG " + "/".join(res["mig_profiles"])
    elif res.get("gpus"):
        what = f"{res['gpus']} GPU{'s' if res['gpus'] > 1 else ''}"
        if nodes > 1:
            what = f"{nodes} nodes x {what}"
    elif res.get("gpu_milli") or res.get("gpu_memory_mib"):
        what = f"share {res.get('gpu_milli') or '-'}m" + (f"/{res['gpu_memory_mib']} MiB" if res.get("gpu_memory_mib")
                                                          else "")
    else:
        what = "CPU only"
    if res.get("gpu_models"):
        what += f" ({'/'.join(res['gpu_models'])})"
    return what


_NEEDS = re.compile(r"needs ([^;:]+?)(?:;|$)")


@dataclass
class ShapeWait:
    shape: str
    tier: str
    resources: dict[str, Any] = field(default_factory=dict)
    """The shape's ``spec.resources`` and ``gang_nodes``: what a pending job of this shape asks."""
    jobs: int = 0
    waits: list[float] | None = None
    queued_now: int = 0
    never_fits: int = 0
    reason: str = ""

    @property
    def mean_wait_s(self) -> float:
        return statistics.fmean(self.waits) if self.waits else 0.0

    @property
    def max_wait_s(self) -> float:
        return max(self.waits) if self.waits else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "tier": self.tier, "jobs": self.jobs, "mean_wait_s": round(self.mean_wait_s, 1),
                "max_wait_s": round(self.max_wait_s, 1), "queued_now": self.queued_now,
                "never_fits": self.never_fits, "reason": self.reason}


def queue_waits(rows: list[dict[str, Any]], now: datetime) -> list[ShapeWait]:
    """Wait by request shape and tier from the scheduler's ``jobs`` rows (``spec``, ``tier``, ``state``,
    ``submitted_at``, ``placed_at``, ``reason``, ``pending_reason``): placed jobs waited until placed, queued ones
    are still waiting; jobs rejected because they can never fit are counted apart."""
    groups: dict[tuple[str, str], ShapeWait] = {}
    for r in rows:
        spec = r["spec"] if isinstance(r["spec"], dict) else {}
        reason = r.get("reason") or r.get("pending_reason") or ""
        shape = shape_of(spec)
        if not spec and r["state"] == "rejected":  # rejected before the read model kept its spec: the reason says
            shape = _NEEDS.search(reason).group(1) if _NEEDS.search(reason) else "unknown shape"  # type: ignore[union-attr]
        key = (shape, r["tier"] or "any tier")
        asked = {**(spec.get("resources") or {}), "gang_nodes": int((spec.get("gang") or {}).get("nodes") or 1)}
        group = groups.setdefault(key, ShapeWait(key[0], key[1], asked, waits=[]))
        group.jobs += 1
        if r["state"] == "rejected":
            if "never" in reason or "no node" in reason:
                group.never_fits += 1
                group.reason = reason
            continue
        until = r.get("placed_at") or (now if r["state"] == "queued" else None)
        if until is None:
            continue
        assert group.waits is not None
        group.waits.append(max(0.0, (until - r["submitted_at"]).total_seconds()))
        if r["state"] == "queued":
            group.queued_now += 1
            group.reason = r.get("pending_reason") or group.reason
    return sorted(groups.values(), key=lambda g: (-g.never_fits, -g.mean_wait_s, g.shape))


def short_of(waits: list[ShapeWait]) -> list[Conclusion]:
    out = []
    for g in waits:
        if g.never_fits:
            out.append(Conclusion(
                "short_of", g.shape,
                f"{g.never_fits} {'' if g.tier == 'any tier' else g.tier + ' '}job(s) asked {g.shape}, which no node "
                "can ever run"
                + (f" ({g.reason})" if g.reason else "") + ": add nodes of that shape or split the job.",
            ))
        elif g.mean_wait_s >= SHORT_WAIT_S or g.queued_now:
            out.append(Conclusion(
                "short_of", g.shape,
                f"The fleet is short of {g.shape} for {g.tier}: {g.jobs} job(s) waited {_duration(g.mean_wait_s)} on "
                f"average (longest {_duration(g.max_wait_s)})"
                + (f"; {g.queued_now} still waiting ({g.reason})" if g.queued_now else "") + ".",
                gpu_hours=None,
            ))
    return out


def throttling(nodes: list[dict[str, Any]]) -> list[Conclusion]:
    """``nodes``: rows with ``node_id``, ``throttled_s``, ``observed_s``, ``temperature_max``, ``gpus``."""
    out = []
    for n in nodes:
        observed = float(n.get("observed_s") or 0)
        if observed <= 0:
            continue
        share = float(n.get("throttled_s") or 0) / observed
        if share < THROTTLE_SHARE:
            continue
        temp = n.get("temperature_max")
        out.append(Conclusion(
            "throttling", n["node_id"],
            f"Node {n['node_id']} is a throttling hot-spot: its GPUs slowed for thermal or power reasons "
            f"{share * 100:.0f} % of the time" + (f" (up to {float(temp):.0f} °C)" if temp is not None else "")
            + ": check cooling and power caps, or move long training off it.",
            gpu_hours=float(n.get("throttled_s") or 0) / 3600,
        ))
    return sorted(out, key=lambda c: -(c.gpu_hours or 0))


def autoscaler(plan: Any | None, recorded: list[dict[str, Any]]) -> list[Conclusion]:
    """What the autoscaler did (``recorded``: rows of ``capacity_decisions``) or would have done (``plan``: a
    ``gpuorch_capacity.CapacityPlan`` over the period's queue and nodes)."""
    if recorded:
        by_pool: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in recorded:
            by_pool[row["pool"]].append(row)
        out = []
        for pool, rows in sorted(by_pool.items()):
            added = sum(int(r["add_nodes"]) for r in rows)
            drained = sum(len(r["drain_node_ids"] or []) for r in rows)
            mode = rows[-1]["mode"]
            verb = "asked for" if mode == "auto" else "advised"
            out.append(Conclusion(
                "autoscaler", pool,
                f"Autoscaler ({mode}) {verb} +{added} / -{drained} node(s) in pool {pool} over {len(rows)} "
                f"decision(s); the last: {rows[-1]['reason']}",
            ))
        return out
    if plan is None:
        return []
    out = [Conclusion("autoscaler", o.pool, f"The autoscaler would have: {o.reason}.") for o in plan.scale_outs]
    out += [Conclusion("autoscaler", d.pool, f"The autoscaler would have: {d.reason}: {', '.join(d.node_ids)}.")
            for d in plan.drains]
    out += [Conclusion("autoscaler", "-", f"The autoscaler could not help: {line}.") for line in plan.unservable]
    if not out:
        out.append(Conclusion("autoscaler", "-", "The autoscaler would have changed nothing: no job waited for "
                                                  "capacity long enough to buy a node, and no node stayed idle "
                                                  "long enough to drain."))
    return out


def _gpu_hours(value: float) -> str:
    if value < 0.1:
        return f"{value * 60:.1f} GPU-minutes"
    return f"{value:.2f} GPU-hours" if value < 10 else f"{value:.0f} GPU-hours"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
