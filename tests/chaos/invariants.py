"""The invariant checker: reads the event log (``events``) and the jobs read model (``jobs``) after a fault.

Three invariants (shared/DESIGN.md §4), each recomputed here from the log, independently of the scheduler's fold:

- **no accepted job lost**: every job with a ``job.accepted`` event is in the read model, in a state that is either
  still queued or placed/running/preempting, or ended (succeeded, failed, cancelled);
- **no job running in two places at once**: each placement of a job lives from its ``job.placed`` (or the run's own
  start, when a run log is given, whichever is earlier) to the latest event that ended it (``job.finished``,
  ``job.failed``, ``job.lost`` naming the placement; or the run's own end); a placement with no end yet lives on.
  Two placements of one job whose lives overlap, or one placement that started twice, are a duplicate run;
- **no GPU, MIG instance or share over-allocated**: replaying ``job.placed`` against the GPUs each node registered
  (``node.registered``), releasing a placement when the log says it ended or its job was requeued, cancelled or
  ended, no GPU holds more than 1000 milli or more memory than it has, and no MIG instance is given twice at once.
  The scheduler's own re-derivation (``SchedulerState.capacity_violations`` after recovery) is checked as well.

A *run log* is what the jobs themselves wrote (``RUN_RECORDER``): ``start <job_id> <placement_id> <epoch>`` when
they start and ``end ...`` when they end by themselves: the ground truth of where something really ran, which a
lost event cannot hide.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

NOT_LOST = frozenset({"queued", "placed", "running", "preempting", "succeeded", "failed", "cancelled"})
PLACEMENT_ENDS = ("job.finished", "job.failed", "job.lost")
JOB_RELEASES = ("job.requeued", "job.cancelled", "job.finished", "job.failed", "job.lost")

RUN_RECORDER = (
    "import os, sys, time\n"
    "log = sys.argv[1]; seconds = float(sys.argv[2]); release = sys.argv[3] if len(sys.argv) > 3 else None\n"
    "ids = os.environ['GPUORCH_JOB_ID'] + ' ' + os.environ['GPUORCH_PLACEMENT_ID']\n"
    "open(log, 'a').write(f'start {ids} {time.time()}\\n')\n"
    "deadline = time.monotonic() + seconds\n"
    "while release and not os.path.exists(release) and time.monotonic() < deadline:\n"
    "    time.sleep(0.1)\n"
    "time.sleep(0 if release else seconds)\n"
    "open(log, 'a').write(f'end {ids} {time.time()}\\n')\n"
)
"""A job (``python -c RUN_RECORDER <run log> <seconds> [<release file>]``) that records where and when it really
ran: it runs ``seconds``, or, given a release file, until that file exists (at most ``seconds``)."""


@dataclass
class Verdict:
    accepted: int = 0
    states: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    over_allocations: list[str] = field(default_factory=list)
    placements: int = 0
    requeues: int = 0

    def problems(self) -> list[str]:
        return [*(f"lost: {x}" for x in self.lost), *(f"ran twice: {x}" for x in self.duplicates),
                *(f"over-allocated: {x}" for x in self.over_allocations)]

    def assert_holds(self) -> None:
        assert not self.problems(), "invariants broken:\n" + "\n".join(self.problems()[:40])

    def figures(self) -> str:
        """One line for docs/RELIABILITY.md and the test output."""
        return (f"jobs {self.accepted}, lost {len(self.lost)}, duplicates {len(self.duplicates)}, "
                f"over-allocations {len(self.over_allocations)}, placements {self.placements}, "
                f"requeues {self.requeues}, states {dict(sorted(self.states.items()))}")


@dataclass
class _Life:
    job_id: str
    start: float = math.inf
    end: float = -math.inf
    ended: bool = False
    starts_in_run_log: int = 0


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


async def check_invariants(dsn: str, *, run_log: Path | None = None, with_scheduler_fold: bool = True) -> Verdict:
    conn = await asyncpg.connect(dsn)
    try:
        events = [(r["type"], json.loads(r["payload"])) for r in await conn.fetch(
            "SELECT type, payload::text AS payload FROM events ORDER BY position")]
        states = {str(r["job_id"]): r["state"] for r in await conn.fetch("SELECT job_id, state FROM jobs")}
        verdict = Verdict()
        _check_lost(events, states, verdict)
        _check_duplicates(events, run_log, verdict)
        _check_allocation(events, verdict)
        if with_scheduler_fold:
            from gpuorch_scheduler.handlers import SchedulerService

            rebuilt = SchedulerService(conn)
            await rebuilt.recover()
            verdict.over_allocations += [f"scheduler fold: {v}" for v in rebuilt.state.capacity_violations()]
        return verdict
    finally:
        await conn.close()


def _check_lost(events: list[tuple[str, dict[str, Any]]], states: dict[str, str], verdict: Verdict) -> None:
    accepted = [p["job_id"] for kind, p in events if kind == "job.accepted"]
    verdict.accepted = len(accepted)
    for job_id in accepted:
        state = states.get(job_id)
        verdict.states[state or "missing"] += 1
        if state not in NOT_LOST:
            verdict.lost.append(f"job {job_id} accepted, now {state or 'missing from the read model'}")


def _check_duplicates(events: list[tuple[str, dict[str, Any]]], run_log: Path | None, verdict: Verdict) -> None:
    lives: dict[str, _Life] = {}
    for kind, p in events:
        if kind == "job.placed":
            verdict.placements += 1
            life = lives.setdefault(p["placement_id"], _Life(p["job_id"]))
            life.start = min(life.start, _epoch(p["occurred_at"]))
        elif kind == "job.requeued":
            verdict.requeues += 1
        elif kind in PLACEMENT_ENDS and p.get("placement_id") in lives:
            life = lives[p["placement_id"]]
            life.end, life.ended = max(life.end, _epoch(p["occurred_at"])), True
    if run_log is not None and run_log.exists():
        for line in run_log.read_text().splitlines():
            what, job_id, placement_id, at = line.split()
            life = lives.setdefault(placement_id, _Life(job_id))
            if what == "start":
                life.start = min(life.start, float(at))
                life.starts_in_run_log += 1
            else:
                life.end, life.ended = max(life.end, float(at)), True
    by_job: dict[str, list[tuple[str, _Life]]] = defaultdict(list)
    for placement_id, life in lives.items():
        by_job[life.job_id].append((placement_id, life))
        if life.starts_in_run_log > 1:
            verdict.duplicates.append(f"job {life.job_id}: placement {placement_id} started "
                                      f"{life.starts_in_run_log} times")
    for job_id, placements in by_job.items():
        placements.sort(key=lambda item: item[1].start)
        latest_id, latest_end = "", -math.inf  # the placement living longest among those begun so far
        for placement_id, life in placements:
            if life.start < latest_end:
                verdict.duplicates.append(
                    f"job {job_id}: placement {placement_id} began {life.start:.3f} while {latest_id} lived until "
                    f"{'the end of the run' if math.isinf(latest_end) else f'{latest_end:.3f}'}")
            end = life.end if life.ended else math.inf
            if end > latest_end:
                latest_id, latest_end = placement_id, end


def _check_allocation(events: list[tuple[str, dict[str, Any]]], verdict: Verdict) -> None:
    gpu_memory: dict[tuple[str, str], int] = {}
    held: dict[str, tuple[str, list[tuple[str, str, int, int, bool]]]] = {}  # placement -> (job, allocations)
    current: dict[str, str] = {}  # job -> its live placement
    for kind, p in events:
        if kind == "node.registered":
            inventory = p["inventory"]
            for gpu in inventory["gpus"]:
                gpu_memory[(inventory["node_id"], gpu["uuid"])] = gpu["memory_total_mib"]
                for mig in gpu.get("mig_instances", []):
                    gpu_memory[(inventory["node_id"], mig["uuid"])] = mig["memory_mib"]
        elif kind == "job.placed":
            allocations = [(a["node_id"], g["gpu_uuid"], g.get("milli", 1000), g.get("memory_mib") or 0,
                            g.get("mig_profile") is not None)
                           for a in p["assignments"] for g in a.get("gpus", [])]
            held[p["placement_id"]] = (p["job_id"], allocations)
            current[p["job_id"]] = p["placement_id"]
            verdict.over_allocations += _overcommitted(held, gpu_memory, p["job_id"])
        elif kind in PLACEMENT_ENDS and p.get("placement_id"):
            if held.pop(p["placement_id"], None) is not None and current.get(p["job_id"]) == p["placement_id"]:
                del current[p["job_id"]]
        elif kind in JOB_RELEASES and p["job_id"] in current:
            held.pop(current.pop(p["job_id"]), None)


def _overcommitted(held: dict[str, tuple[str, list[tuple[str, str, int, int, bool]]]],
                   gpu_memory: dict[tuple[str, str], int], placed_job: str) -> list[str]:
    milli: Counter[tuple[str, str]] = Counter()
    memory: Counter[tuple[str, str]] = Counter()
    mig_holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    for job_id, allocations in held.values():
        for node_id, gpu_uuid, share, memory_mib, is_mig in allocations:
            key = (node_id, gpu_uuid)
            milli[key] += share
            memory[key] += memory_mib
            if is_mig:
                mig_holders[key].append(job_id)
    problems = [f"after placing {placed_job}: {key} holds {value} milli" for key, value in milli.items()
                if value > 1000]
    problems += [f"after placing {placed_job}: {key} holds {value} MiB of {gpu_memory[key]}"
                 for key, value in memory.items() if key in gpu_memory and value > gpu_memory[key]]
    problems += [f"after placing {placed_job}: MIG instance {key} given to {holders}"
                 for key, holders in mig_holders.items() if len(holders) > 1]
    return problems

