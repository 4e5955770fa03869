"""Job arrays: one submission, many tasks that differ only by their index (a sweep).

Indices are written as in Slurm's ``sbatch --array``: ``0-49``, ``1,3,5-9``, ``0-99:10`` (a step), and a CLI may add
``%8`` for the parallelism (``parse_array``). A task's job id is derived from the array's id and its index
(``array_task_id``): anyone can compute it, and it is the same in every replay. Every task runs with the array's
spec; its executor sets ``GPUORCH_ARRAY_JOB_ID``, ``GPUORCH_ARRAY_TASK_ID`` and ``GPUORCH_ARRAY_TASK_COUNT``
(``LaunchJob.array_task``).
"""

from __future__ import annotations

import re
import uuid
from itertools import pairwise
from typing import Annotated

from pydantic import Field, field_validator

from gpuorch_contracts.envelope import Strict

MAX_ARRAY_INDEX = 9_999_999
MAX_ARRAY_TASKS = 100_000
"""An array holds at most this many tasks (its pending tasks are kept as ranges, so the cost is in the running)."""
MAX_ARRAY_PARALLELISM = 100_000

IndexText = Annotated[str, Field(min_length=1, max_length=1000, pattern=r"^[0-9][0-9,:\-]*$", description=(
    "task indices as in Slurm's --array: 0-49, 1,3,5-9, 0-99:10 (a step)"))]
_PART = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")


def parse_indices(text: str) -> list[range]:
    """The ranges ``text`` names, sorted and without overlaps (``"5-9,1,3"`` -> range(1, 2), range(3, 4),
    range(5, 10); overlapping parts are merged into runs of equal steps). Raises ValueError with the reason for anything else, for more than ``MAX_ARRAY_TASKS`` tasks or
    an index above ``MAX_ARRAY_INDEX``."""
    indices: set[int] = set()
    ranges: list[range] = []
    for part in text.split(","):
        match = _PART.match(part.strip())
        if match is None:
            raise ValueError(f"array indices: {part!r} is not N, N-M or N-M:S")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        step = int(match.group(3)) if match.group(3) is not None else 1
        if last < first or step < 1:
            raise ValueError(f"array indices: {part!r} is empty (end before start, or a step below 1)")
        if last > MAX_ARRAY_INDEX:
            raise ValueError(f"array indices: {last} is above the largest index {MAX_ARRAY_INDEX}")
        ranges.append(range(first, last + 1, step))
        if sum(len(r) for r in ranges) > 4 * MAX_ARRAY_TASKS:
            raise ValueError(f"an array holds at most {MAX_ARRAY_TASKS} tasks")
    ranges.sort(key=lambda r: r.start)
    if all(later.start > earlier[-1] for earlier, later in pairwise(ranges)):
        count = sum(len(r) for r in ranges)  # disjoint spans (the usual case): no index is named twice
        if count > MAX_ARRAY_TASKS:
            raise ValueError(f"an array holds at most {MAX_ARRAY_TASKS} tasks; these indices name {count}")
        return ranges
    for r in ranges:
        indices.update(r)
    if len(indices) > MAX_ARRAY_TASKS:
        raise ValueError(f"an array holds at most {MAX_ARRAY_TASKS} tasks; these indices name {len(indices)}")
    return compact(sorted(indices))


def compact(indices: list[int]) -> list[range]:
    """Sorted distinct indices as runs of equal steps, greedily (``[0, 2, 4, 5]`` -> range(0, 5, 2), range(5, 6))."""
    runs: list[range] = []
    k = 0
    while k < len(indices):
        if k + 1 == len(indices):
            runs.append(range(indices[k], indices[k] + 1))
            break
        step = indices[k + 1] - indices[k]
        end = k + 1
        while end + 1 < len(indices) and indices[end + 1] - indices[end] == step:
            end += 1
        runs.append(range(indices[k], indices[end] + 1, step))
        k = end + 1
    return runs


def indices_text(ranges: list[range]) -> str:
    """``ranges`` in the Slurm syntax (``range(0, 100, 10)`` -> ``0-90:10``)."""
    parts = []
    for r in ranges:
        last = r[-1]
        parts.append(str(r.start) if len(r) == 1 else f"{r.start}-{last}" + (f":{r.step}" if r.step != 1 else ""))
    return ",".join(parts)


class ArraySpec(Strict):
    """The tasks of an array and how many of them may run at once."""

    indices: IndexText
    parallelism: int | None = Field(default=None, ge=1, le=MAX_ARRAY_PARALLELISM, description=(
        "at most this many tasks placed or running at once (Slurm's %N); None: as many as fit"))

    @field_validator("indices")
    @classmethod
    def _valid_indices(cls, text: str) -> str:
        parse_indices(text)
        return text

    @property
    def ranges(self) -> list[range]:
        return parse_indices(self.indices)

    @property
    def task_count(self) -> int:
        return sum(len(r) for r in self.ranges)


def parse_array(text: str) -> ArraySpec:
    """``0-11%3`` (Slurm's ``--array``) -> ArraySpec(indices="0-11", parallelism=3)."""
    indices, _, parallelism = text.partition("%")
    if parallelism and not parallelism.isdigit():
        raise ValueError(f"array parallelism: {parallelism!r} is not a number")
    return ArraySpec(indices=indices, parallelism=int(parallelism) if parallelism else None)


def array_task_id(array_id: uuid.UUID, index: int) -> uuid.UUID:
    """The job id of task ``index`` of array ``array_id`` (the same everywhere, every time)."""
    return uuid.uuid5(array_id, f"task:{index}")


class ArrayTask(Strict):
    """Which task of which array a launch runs (the executor exports it as ``GPUORCH_ARRAY_*``)."""

    array_job_id: uuid.UUID
    task_id: int = Field(ge=0, le=MAX_ARRAY_INDEX)
    task_count: int = Field(ge=1, le=MAX_ARRAY_TASKS)
