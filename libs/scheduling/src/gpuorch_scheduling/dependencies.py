"""Dependencies between jobs and arrays (``JobSpec.depends_on``): refused at admission, held in the cycle, ended
when they can never be met.

    admission (decisions.admit)   refused(): unknown id, a cycle, another tenant's job (unless the submitter may act
                                  on that tenant's jobs: an operator), aftercorr not between two arrays
    the cycle (cycle.schedule)    unmet(): a queued job whose dependencies are not all met waits, its pending reason
                                  "waiting for <id> (<state>)", its estimate the latest expected end among them
    each step (Scheduler.step)    unmeetable(): a job (or array, or array task under aftercorr) one of whose
                                  dependencies can never be met is cancelled with the reason (JobCancelled: its
                                  submitter sees it), and so on down the chain

Everything here reads the state the fold keeps (``SchedulerState.dependents``, the jobs and arrays); a job with
dependents is kept in memory until they end, so its outcome is never lost to retention. Pure: no clock, no I/O.

A cycle can only be made by a job naming itself (or, for an array, one of its own tasks): every other dependency
must name a job already accepted, which cannot name a job submitted after it.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuorch_contracts import TERMINAL_STATES, CancelJob, Dependency, JobSpec, array_task_id

from gpuorch_scheduling.arrays import ArrayRecord
from gpuorch_scheduling.state import JobRecord, SchedulerState


@dataclass(frozen=True)
class Unmet:
    """Why a job may not start yet (``never``: it never will), and when its dependencies may be met (None:
    unknown)."""

    reason: str
    never: bool = False
    start: float | None = None


@dataclass(frozen=True)
class _Outcome:
    state: str
    ended: bool
    ok: bool
    end: float | None


def refused(state: SchedulerState, job_id: uuid.UUID, spec: JobSpec,
            may_use: Callable[[str], bool] | None = None) -> str | None:
    """Why ``spec``'s dependencies are refused at admission (None: they are fine). ``may_use(tenant)``: whether the
    submitter may depend on that tenant's jobs (None: any tenant)."""
    for dependency in spec.depends_on:
        target = dependency.job_id
        if target == job_id:
            return f"a dependency cycle: the job depends on itself ({dependency.condition}:{target})"
        job = state.jobs.get(target)
        array = state.arrays.get(target)
        if job is None and array is None:
            if spec.array is not None and any(array_task_id(job_id, i) == target for r in spec.array.ranges
                                              for i in r):  # only on this path: an unknown id is refused anyway
                return f"a dependency cycle: the array depends on its own task ({dependency.condition}:{target})"
            return (f"depends on unknown job {target} (never accepted, or ended longer ago than the scheduler "
                    "remembers: depend on jobs still queued, running or recently ended)")
        tenant = job.spec.tenant if job is not None else array.spec.tenant  # type: ignore[union-attr]
        if tenant != spec.tenant and may_use is not None and not may_use(tenant):
            return f"depends on job {target} of tenant {tenant}: only operators may depend on another tenant's jobs"
        if dependency.condition == "aftercorr" and (array is None or spec.array is None):
            return f"aftercorr pairs the tasks of two arrays: {'this job' if spec.array is None else target} " \
                   "is not an array"
    return None


def unmet(state: SchedulerState, job: JobRecord, now: float,
          estimates: Mapping[uuid.UUID, object] | None = None) -> Unmet | None:
    """None when every dependency of ``job`` is met. ``estimates``: waiting job -> its ``Waiting`` (the start
    estimates known so far), for the expected end of a dependency still queued."""
    return _unmet(state, job.spec.depends_on, job.array_index, now, estimates)


def _unmet(state: SchedulerState, dependencies: Iterable[Dependency], index: int | None, now: float,
           estimates: Mapping[uuid.UUID, object] | None = None) -> Unmet | None:
    waits: list[tuple[Dependency, _Outcome]] = []
    for dependency in dependencies:
        outcome = _outcome(state, dependency, index, now, estimates or {})
        met, possible = _judge(dependency.condition, outcome)
        if met:
            continue
        if not possible:
            return Unmet(f"dependency {dependency.condition}:{dependency.job_id} can never be met: "
                         f"{_named(dependency, index)} {outcome.state}", never=True)
        waits.append((dependency, outcome))
    if not waits:
        return None
    first, outcome = waits[0]
    more = f" and {len(waits) - 1} more" if len(waits) > 1 else ""
    ends = [o.end for _, o in waits]
    start = None if any(e is None for e in ends) else max(max(ends), now)  # type: ignore[type-var]
    return Unmet(f"waiting for {_named(first, index)} ({outcome.state}){more}", start=start)


def _named(dependency: Dependency, index: int | None) -> str:
    if dependency.condition == "aftercorr" and index is not None:
        return f"task {index} of {dependency.job_id}"
    return str(dependency.job_id)


def _judge(condition: str, outcome: _Outcome) -> tuple[bool, bool]:
    """(met now, can still be met)."""
    if condition == "afterany":
        return outcome.ended, True
    if condition == "afternotok":
        return outcome.ended and not outcome.ok, not (outcome.ended and outcome.ok)
    return outcome.ended and outcome.ok, not outcome.ended  # afterok, aftercorr


def _outcome(state: SchedulerState, dependency: Dependency, index: int | None, now: float,
             estimates: Mapping[uuid.UUID, object]) -> _Outcome:
    target = dependency.job_id
    array = state.arrays.get(target)
    if array is not None and dependency.condition == "aftercorr" and index is not None:
        task_state = array.task_state(index, state.jobs)
        if task_state is None:  # no counterpart: nothing to wait for
            return _Outcome("absent", True, True, now)
        task = state.jobs.get(array.task_id(index))
        end = _job_end(task, now, estimates) if task is not None and task_state not in TERMINAL_STATES else None
        return _Outcome(task_state, task_state in TERMINAL_STATES, task_state == "succeeded", end)
    if array is not None:
        return _Outcome(array.state, array.ended_at is not None, array.ok, _array_end(state, array, now, estimates))
    job = state.jobs.get(target)
    if job is None:
        return _Outcome("unknown to the scheduler", True, False, None)
    ended = job.state in TERMINAL_STATES
    return _Outcome(job.state, ended, job.state == "succeeded", now if ended else _job_end(job, now, estimates))


def _job_end(job: JobRecord, now: float, estimates: Mapping[uuid.UUID, object]) -> float | None:
    """When ``job`` is expected to end (None: unknown)."""
    length = job.spec.runtime_estimate_s or job.spec.max_runtime_s
    if length is None:
        return None
    if job.state == "queued":
        start = getattr(estimates.get(job.job_id), "estimated_start", None)
        return None if start is None else max(start, now) + length
    begun = job.started_at or job.placed_at or now
    return max(now, begun + length)


def _array_end(state: SchedulerState, array: ArrayRecord, now: float,
               estimates: Mapping[uuid.UUID, object]) -> float | None:
    """The end of the array's last task, if the tasks still pending run in waves of its parallelism."""
    if array.ended_at is not None:
        return array.ended_at
    length = array.spec.runtime_estimate_s or array.spec.max_runtime_s
    if length is None:
        return None
    ends = [_job_end(state.jobs[t], now, estimates) for t in array.live.values() if t in state.jobs]
    if any(e is None for e in ends):
        return None
    width = array.parallelism or max(1, len(array.live))
    waves = math.ceil(array.pending_count / width)
    return max([now, *ends]) + waves * length  # type: ignore[type-var]


def affected(state: SchedulerState, touched: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """The jobs and arrays whose dependencies may have changed after a step touched ``touched``: their dependents,
    and those among them (or their arrays) that have dependencies themselves; in a stable order."""
    found: set[uuid.UUID] = set()
    for job_id in touched:
        job = state.jobs.get(job_id)
        ids = [job_id] if job is None or job.array_id is None else [job_id, job.array_id]
        for target in ids:
            found.update(state.dependents.get(target, ()))
            spec = job.spec if job is not None else (state.arrays[target].spec if target in state.arrays else None)
            if spec is not None and spec.depends_on:
                found.add(target)
    return sorted(found, key=lambda u: u.int)


def unmeetable(state: SchedulerState, candidates: Iterable[uuid.UUID]) -> list[CancelJob]:
    """The cancels that end the candidates (jobs, arrays, and the queued tasks of arrays with ``aftercorr``)
    whose dependencies can never be met, each with its reason."""
    cancels: list[CancelJob] = []
    for job_id in candidates:
        array = state.arrays.get(job_id)
        if array is not None:
            cancels.extend(_array_cancels(state, array))
            continue
        job = state.jobs.get(job_id)
        if job is None or job.state != "queued" or job.array_id is not None:
            continue
        gate = _unmet(state, job.spec.depends_on, None, state.clock)
        if gate is not None and gate.never:
            cancels.append(CancelJob(job_id=job_id, reason=gate.reason[:1000]))
    return cancels


def _array_cancels(state: SchedulerState, array: ArrayRecord) -> list[CancelJob]:
    if array.ended_at is not None:
        return []
    whole = [d for d in array.spec.depends_on if d.condition != "aftercorr"]
    gate = _unmet(state, whole, None, state.clock)
    if gate is not None and gate.never:
        return [CancelJob(job_id=array.array_id, reason=gate.reason[:1000])]
    paired = [d for d in array.spec.depends_on if d.condition == "aftercorr"]
    cancels = []
    for index, task_id in sorted(array.live.items()) if paired else ():
        task = state.jobs.get(task_id)
        if task is None or task.state != "queued":
            continue
        gate = _unmet(state, paired, index, state.clock)
        if gate is not None and gate.never:
            cancels.append(CancelJob(job_id=task_id, reason=gate.reason[:1000]))
    return cancels
