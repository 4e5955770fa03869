"""Interactive sessions: park when idle, resume on request (issue 27, docs/sessions.md).

    running session ──(idle: no proxied request and GPU util < 1 % for idle_park_after)──┐
                    ──(ChangeSession park)──────────────────────────────────────────────┤
                                                                                       ▼
        JobPreempting(park=True) + StopJob(reason "preempt", the spec's checkpoint grace)   [logged]
                    executor: checkpoint signal, grace, kill; the work directory stays
                                                                                       ▼
        every node confirmed the stop (``decisions.after_stop_confirmed``) ──► SessionParked   [logged]
                    state ``parked``: holds nothing, not queued, never forgotten at retention
                                                                                       ▼
        ChangeSession resume (gpuctl, or the API when someone opens the session's URL)
                    ──► JobRequeued(reason "resumed", preempted=True)   [logged]: queued, placed where room is

Parking is a preemption whose victim is parked instead of requeued, so its grace, its timeout and a node lost
meanwhile are handled by the preemption path unchanged. What is parked is state from the log (``JobRecord.parking``
and the state ``parked`` are folded from these events): a scheduler that takes over, or rebuilds its state from
the log, has the same parked sessions.

Idleness is memory, not log (``IdleSessions``, like the leases): per GPU, since when its utilisation has been
below 1 % (node heartbeats), per session, since when no request went through its proxy (executor heartbeats,
``RunningPlacement.idle_s``). Both are needed: with no evidence of idleness (no heartbeat yet, a utilisation the
node cannot read, or right after a restart) a session is not idle, so a failover delays a park and never causes
one. Times are on the lease clock (the clock heartbeats are dated with); the journal keeps the utilisation of each
node heartbeat, so a replay judges idleness as the live run did.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuorch_contracts import (
    PRIORITY_VALUE,
    TERMINAL_STATES,
    ChangeSession,
    ExecutorHeartbeat,
    GpuLive,
    JobPreempting,
    JobRequeued,
    JobSpec,
    SessionParked,
    SessionSpec,
)
from gpuorch_identity import Identity, IdentityMap

from gpuorch_scheduling.decisions import Decision, decision_id, stops
from gpuorch_scheduling.state import JobRecord, SchedulerState

IDLE_UTIL_PCT = 1.0
"""Below this GPU utilisation (percent) a session's GPU counts as idle."""
RESUMED = "resumed"


@dataclass(frozen=True)
class SessionPolicy:
    """When idle sessions are parked: ``idle_park_after_s`` by default, ``by_tenant`` per tenant; a session's own
    ``SessionSpec.idle_park_after_s`` wins over both."""

    idle_park_after_s: float = 1800.0
    by_tenant: Mapping[str, float] = field(default_factory=dict)

    def park_after(self, job: JobRecord) -> float:
        own = job.spec.session.idle_park_after_s if job.spec.session is not None else None
        if own is not None:
            return own
        return self.by_tenant.get(job.spec.tenant, self.by_tenant.get("*", self.idle_park_after_s))


def parse_park_by_tenant(text: str) -> dict[str, float]:
    """``{"research": 600, "*": 1800}`` (seconds, at least 10) from JSON; empty text: none. ValueError otherwise."""
    raw = json.loads(text) if text.strip() else {}
    if not isinstance(raw, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 10 for v in raw.values()):
        raise ValueError('expected a JSON object {"<tenant>": seconds (at least 10), "*": ...}')
    return {str(k): float(v) for k, v in raw.items()}


@dataclass
class IdleSessions:
    """Since when each GPU and each session has been idle (memory; see the module docstring)."""

    gpu_idle_from: dict[tuple[str, int], float] = field(default_factory=dict)
    """(node, GPU index) -> lease time since which its utilisation stayed below ``IDLE_UTIL_PCT``."""
    quiet_from: dict[uuid.UUID, float] = field(default_factory=dict)
    """Session (job id) -> lease time of its last proxied request (or its start), as its executor last said."""

    def reset(self) -> None:
        self.gpu_idle_from.clear()
        self.quiet_from.clear()

    def node_beat(self, node_id: str, gpus: Iterable[GpuLive], lease_now: float) -> None:
        for gpu in gpus:
            key = (node_id, gpu.index)
            if gpu.utilization_pct is None or gpu.utilization_pct >= IDLE_UTIL_PCT:
                self.gpu_idle_from.pop(key, None)
            else:
                self.gpu_idle_from.setdefault(key, lease_now)

    def executor_beat(self, beat: ExecutorHeartbeat, lease_now: float) -> None:
        for running in beat.running:
            if running.idle_s is not None:
                self.quiet_from[running.job_id] = lease_now - running.idle_s

    def idle_for(self, job: JobRecord, lease_now: float) -> float | None:
        """Seconds the session has been idle on both counts; None without evidence of idleness."""
        quiet = self.quiet_from.get(job.job_id)
        if quiet is None:
            return None
        since = quiet
        for assignment in job.assignments:
            for gpu in assignment.gpus:
                idle_from = self.gpu_idle_from.get((assignment.node_id, gpu.gpu_index))
                if idle_from is None:
                    return None
                since = max(since, idle_from)
        return max(0.0, lease_now - since)

    def due(self, state: SchedulerState, policy: SessionPolicy, lease_now: float) -> Decision:
        """Park every running session idle for at least its ``park_after``; forget sessions no longer running."""
        decision = Decision()
        running: set[uuid.UUID] = set()
        for job in list(state.active.values()):
            if job.spec.tier != "interactive" or job.state != "running":
                continue
            running.add(job.job_id)
            idle = self.idle_for(job, lease_now)
            after = policy.park_after(job)
            if idle is not None and idle >= after:
                decision.extend(park(job, f"idle for {idle:.0f} s (no request, GPU below {IDLE_UTIL_PCT:g} %; "
                                          f"parks after {after:g} s)"))
        for job_id in set(self.quiet_from) - running:
            del self.quiet_from[job_id]
        return decision


def outranks(job: JobRecord, victim: JobRecord) -> bool:
    """May ``job`` preempt (preemptible) ``victim`` on rank alone? A strictly higher priority class may; and an
    interactive session may preempt batch work of a class no higher than its own (a quick start for people
    waiting at a screen; the victim's checkpoint grace is respected as for every preemption)."""
    mine, theirs = PRIORITY_VALUE[job.spec.priority_class], PRIORITY_VALUE[victim.spec.priority_class]
    return theirs < mine or (job.spec.tier == "interactive" and victim.spec.tier == "batch" and theirs <= mine)


def owned(spec: JobSpec, owner: str) -> JobSpec:
    """An interactive spec with its verified owner (``SessionSpec.owner``); other specs as they are."""
    if spec.tier != "interactive":
        return spec
    session = (spec.session or SessionSpec()).model_copy(update={"owner": owner})
    return spec.model_copy(update={"session": session})


def _gpus(spec: JobSpec) -> float:
    resources = spec.resources
    if resources.kind == "whole":
        return float(resources.gpus)
    if resources.kind == "mig":
        return 1 / 7
    return (resources.gpu_milli or 1000) / 1000.0 if resources.kind == "share" else 0.0


class OverCap(str):
    """Why a session would exceed its owner's caps (``over_cap``): unlike a refusal of who asked, its owner is
    shown it (the scheduler writes a refused resume's reason as the parked session's pending reason)."""


def over_cap(state: SchedulerState, identity: Identity | None, owner: str, spec: JobSpec,
             resuming: uuid.UUID | None = None) -> OverCap | None:
    """Why one more live session of ``owner`` (``spec``) would exceed its identity's caps (``max_sessions``,
    ``max_session_gpus``), or None. Live: not ended and not parked (``resuming``: the parked one about to be)."""
    if spec.tier != "interactive" or identity is None or (
            identity.max_sessions is None and identity.max_session_gpus is None):
        return None
    live = [j for j in state.jobs.values() if j.spec.tier == "interactive" and j.spec.session is not None
            and j.spec.session.owner == owner and j.job_id != resuming
            and j.state not in TERMINAL_STATES and j.state != "parked"]
    if identity.max_sessions is not None and len(live) + 1 > identity.max_sessions:
        return OverCap(f"{owner} already has {len(live)} live session(s), its cap (park or stop one first)")
    gpus = sum(_gpus(j.spec) for j in live)
    if identity.max_session_gpus is not None and gpus + _gpus(spec) > identity.max_session_gpus + 1e-9:
        return OverCap(f"{owner}'s live sessions hold {gpus:g} GPU(s); {_gpus(spec):g} more would exceed its cap "
                       f"of {identity.max_session_gpus:g}")
    return None


def park(job: JobRecord, reason: str) -> Decision:
    """Stop a running session to park it (its checkpoint grace applies); nothing if it is not running."""
    if job.spec.tier != "interactive" or job.state != "running" or job.placement_id is None:
        return Decision()
    return Decision(
        logged=[JobPreempting(message_id=decision_id("parking", job.job_id, job.placement_id),
                              job_id=job.job_id, placement_id=job.placement_id, reason=f"parked: {reason}"[:1000],
                              park=True)],
        published=stops(job, "preempt"),
    )


def parked(job: JobRecord, reason: str) -> Decision:
    """The session's stop was confirmed on every node: it is parked (``decisions.requeued_after_preemption``)."""
    gpus = sum(g.milli for a in job.assignments for g in a.gpus) / 1000.0
    node = job.assignments[0].node_id if job.assignments else None
    return Decision(logged=[SessionParked(
        message_id=decision_id("parked", job.job_id, job.placement_id), job_id=job.job_id,
        reason=(job.reason or reason)[:1000], node_id=node, gpus=gpus)])


def resume(job: JobRecord) -> Decision:
    """Queue a parked session again (it starts wherever room is); nothing if it is not parked."""
    if job.state != "parked":
        return Decision()
    return Decision(logged=[JobRequeued(
        message_id=decision_id(RESUMED, job.job_id, job.preemptions), job_id=job.job_id, reason=RESUMED,
        requeues=job.requeues, preempted=True)])


def change(state: SchedulerState, request: ChangeSession, identities: IdentityMap | None = None) -> Decision | str:
    """A ``ChangeSession`` (already authorized): park a running session, or resume a parked one unless its owner's
    caps refuse it (then the reason, and nothing changes)."""
    job = state.jobs.get(request.job_id)
    if job is None or job.spec.tier != "interactive":
        return Decision()
    if request.action == "park":
        return park(job, request.reason)
    owner = job.spec.session.owner if job.spec.session is not None else None
    if identities is not None and owner is not None and job.state == "parked":
        refused = over_cap(state, identities.identity_of(owner), owner, job.spec, resuming=job.job_id)
        if refused is not None:
            return refused
    return resume(job)
