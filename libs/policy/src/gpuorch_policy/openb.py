"""The openb trace format (Alibaba clusterdata, cluster-trace-gpu-v2023) and the FGD paper's workload protocol.

Parsing takes text (rows of CSV), never paths: reading files is the caller's job. Node rows:
`sn, cpu_milli, memory_mib, gpu, model`. Task rows: `name, cpu_milli, memory_mib, num_gpu, gpu_milli` and optionally
`gpu_spec, qos, pod_phase, creation_time, deletion_time, scheduled_time` (some published variants carry only the
first five columns).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gpuorch_policy.cluster import whole_gpu_nodes
from gpuorch_policy.model import GPU_MILLI, NodeView, Request


@dataclass(frozen=True, slots=True)
class Task:
    """One trace row: a name, what it asks for, and its times when the trace has them (seconds from start)."""

    name: str
    request: Request
    source: str = ""
    qos: str = ""
    creation_time: int | None = None
    deletion_time: int | None = None
    scheduled_time: int | None = None

    @property
    def gpu_request_milli(self) -> int:
        return self.request.gpu_milli_total


def _int_or_none(value: str | None) -> int | None:
    if value is None or value.strip() == "" or value.strip().lower() == "nan":
        return None
    return int(float(value))


def parse_nodes(lines: Iterable[str]) -> list[NodeView]:
    rows = []
    for row in csv.DictReader(lines):
        model = (row.get("model") or "").strip()
        count = int(float(row.get("gpu") or 0))
        rows.append(
            (row["sn"], int(float(row["cpu_milli"])), int(float(row["memory_mib"])), count, model if count else "")
        )
    return whole_gpu_nodes(rows)


def parse_tasks(lines: Iterable[str]) -> list[Task]:
    tasks = []
    for row in csv.DictReader(lines):
        num_gpu = int(float(row["num_gpu"]))
        raw_milli = row.get("gpu_milli")
        milli = int(float(raw_milli)) if raw_milli not in (None, "", "nan") else (GPU_MILLI if num_gpu else 0)
        if num_gpu == 0:
            milli = 0
        milli = min(milli, GPU_MILLI)
        spec = (row.get("gpu_spec") or "").strip()
        models = tuple(m for m in spec.split("|") if m and m.lower() != "nan")
        request = Request(
            cpu_milli=int(float(row["cpu_milli"])),
            memory_mib=int(float(row.get("memory_mib") or 0)),
            num_gpu=num_gpu,
            gpu_milli=milli,
            gpu_models=models,
        )
        tasks.append(
            Task(
                name=row["name"],
                request=request,
                source=row["name"],
                qos=(row.get("qos") or "").strip(),
                creation_time=_int_or_none(row.get("creation_time")),
                deletion_time=_int_or_none(row.get("deletion_time")),
                scheduled_time=_int_or_none(row.get("scheduled_time")),
            )
        )
    return tasks


def inflate(tasks: Sequence[Task], capacity_milli: int, ratio: float, rng: np.random.Generator) -> list[Task]:
    """The protocol's step 2: keep every task and append uniform random copies while the total GPU request stays
    at or below ratio x capacity; a list already above is cut down by removing random tasks until it is not."""
    target = ratio * capacity_milli
    total = sum(t.gpu_request_milli for t in tasks)
    out = list(tasks)
    if total > target:
        while total > target and out:
            victim = out.pop(int(rng.integers(len(out))))
            total -= victim.gpu_request_milli
        return out
    copy_number = 0
    while True:
        drawn = tasks[int(rng.integers(len(tasks)))]
        if total + drawn.gpu_request_milli > target:
            return out
        total += drawn.gpu_request_milli
        out.append(
            Task(
                name=f"{drawn.name}-tuned-{copy_number}",
                request=drawn.request,
                source=drawn.source or drawn.name,
                qos=drawn.qos,
                creation_time=drawn.creation_time,
                deletion_time=drawn.deletion_time,
                scheduled_time=drawn.scheduled_time,
            )
        )
        copy_number += 1


def inflate_seeded(tasks: Sequence[Task], capacity_milli: int, ratio: float, seed: int) -> list[Task]:
    """`inflate` driven by a generator seeded with `seed` (order kept: originals first, then the copies)."""
    return inflate(tasks, capacity_milli, ratio, np.random.default_rng(seed))


def protocol_workload(tasks: Sequence[Task], capacity_milli: int, ratio: float, seed: int) -> list[Task]:
    """Steps 2 and 3: inflate to `ratio` x capacity, then shuffle, both driven by one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    inflated = inflate(tasks, capacity_milli, ratio, rng)
    order = rng.permutation(len(inflated))
    return [inflated[i] for i in order]
