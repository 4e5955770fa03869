"""The FGD paper's replay metrics (see shared/traces/openb/README.md): what one arrival-only replay measured.

    after each task: arrived %, allocated %, fragmentation % ──► allocated % at 100 % arrived, unallocated % at
                                                                   130 % arrived, curves (the simulator's analysis)

The replay itself runs the scheduler through its Harness (``gpuorch_scheduling.trace_replay``): one engine for the
live fleet and every prediction. Pure: no files, no clock; ``ReplayResult.seconds`` is whatever the caller puts there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    task: str
    source: str
    node: str | None
    gpus: tuple[tuple[int, int], ...]


@dataclass
class ReplayResult:
    policy: str
    seed: int
    tasks: int
    failed: int
    arrived_pct: np.ndarray  # after each task
    allocated_pct: np.ndarray
    frag_pct: np.ndarray  # fragmented GPU-milli (FGD definition, against the mix) / capacity, sampled per 1 %
    outcomes: list[TaskOutcome] = field(default_factory=list)
    seconds: float = 0.0

    def allocated_at(self, arrived: int) -> float:
        return discrete_mean(self.arrived_pct, self.allocated_pct, arrived)

    @property
    def allocated_pct_at_100(self) -> float:
        return self.allocated_at(100)

    @property
    def unallocated_pct_at_130(self) -> float:
        return round(100.0 - self.allocated_at(130), 2)

    def curve(self, values: np.ndarray, points: Sequence[int] = tuple(range(0, 131, 10))) -> dict[int, float]:
        out = {}
        for p in points:
            v = discrete_mean(self.arrived_pct, values, p)
            if not np.isnan(v):
                out[p] = v
        return out


def discrete_mean(arrived_pct: np.ndarray, values: np.ndarray, point: int) -> float:
    """The simulator's analysis: mean of values (rounded to 0.01) over steps whose arrived % rounds to `point`,
    widened to +-1 when there is none; NaN when still nothing."""
    arrived = np.round(arrived_pct, 0)
    rounded = np.round(values, 2)
    hit = arrived == point
    if not hit.any():
        hit = (arrived >= point - 1) & (arrived <= point + 1)
        if not hit.any():
            return float("nan")
    return round(float(rounded[hit].mean()), 2)
