"""The simulation's only clock and only source of randomness.

    SimLoop(seed)
      rng     one ``random.Random(seed)``: every delay, fault, workload and interleaving is drawn from it
      now     simulated seconds (true time; processes see it through their own skewed clocks)
      at()    an action at a simulated time; equal times run in the order they were scheduled

Deterministic: the same seed gives the same sequence of actions, so a failing seed replays exactly.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

_Action = tuple[float, int, Callable[[], None], str]
"""(when, order of scheduling, what to run, its label): a tuple, so the heap compares two numbers."""


class SimLoop:
    """A heap of timed actions on one simulated clock, drawn from one seeded random source. Not thread-safe."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.steps = 0
        """Actions run so far (an invariant failure names the step it happened at)."""
        self._heap: list[_Action] = []
        self._order = itertools.count()
        self.label = ""
        """The label of the action running now (for failure reports)."""

    def at(self, when: float, run: Callable[[], None], label: str = "") -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), run, label))

    def after(self, delay: float, run: Callable[[], None], label: str = "") -> None:
        self.at(self.now + delay, run, label)

    def jitter(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def run_until(self, until: float, after_each: Callable[[], None] | None = None) -> None:
        """Run every action due up to ``until``; ``after_each`` (the invariants) after each one."""
        while self._heap and self._heap[0][0] <= until:
            self.now, _, run, self.label = heapq.heappop(self._heap)
            self.steps += 1
            run()
            if after_each is not None:
                after_each()
        self.now = max(self.now, until)
