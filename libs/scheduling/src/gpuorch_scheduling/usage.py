"""Decayed usage: GPU-seconds per tenant and GPU model, halved every ``half_life_s`` (Slurm's PriorityDecayHalfLife).

    the fold: a job starts holding GPUs (JobPlaced)      ──► change(tenant, model, +gpus, log time)
              a job stops holding them (ended, requeued) ──► change(tenant, model, -gpus, log time)
    the cycle / the read model: value(tenant, model, now) ──► decayed GPU-seconds up to ``now``

Each (tenant, model) keeps the decayed total up to ``as_of`` and the GPUs held since then (a rate). Between two
changes the rate is constant, so the total is advanced exactly:
``total(t) = total(as_of) * d + rate * (1 - d) * half_life / ln 2`` with ``d = 2 ** (-(t - as_of) / half_life)``.
O(1) per change; no job list is scanned, no clock is read (the fold gives log time, the cycle gives ``now``), so a
replay of the log rebuilds the same ledger and a restart loses nothing. Weights per GPU model are applied when the
ledger is read (``weighted``), so changing them needs no replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HALF_LIFE_S = 7 * 86400.0


@dataclass
class DecayedUsage:
    """(tenant, GPU model) -> [decayed GPU-seconds at ``as_of``, GPUs held, ``as_of``] (see the module docstring)."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    rows: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def change(self, tenant: str, model: str, gpus: float, at: float) -> None:
        """From log time ``at`` on, ``tenant`` holds ``gpus`` more (or fewer) GPUs of ``model``."""
        row = self.rows.get((tenant, model))
        if row is None:
            row = self.rows[(tenant, model)] = [0.0, 0.0, at]
        row[0] = self._advanced(row, at)
        row[1] = max(0.0, row[1] + gpus) if abs(row[1] + gpus) > 1e-9 else 0.0
        row[2] = max(row[2], at)

    def _advanced(self, row: list[float], now: float) -> float:
        total, rate, as_of = row
        elapsed = now - as_of
        if elapsed <= 0:
            return total
        if math.isinf(self.half_life_s):
            return total + rate * elapsed
        decay = 2.0 ** (-elapsed / self.half_life_s)
        return total * decay + rate * (1.0 - decay) * self.half_life_s / math.log(2)

    def value(self, tenant: str, model: str, now: float) -> float:
        """Decayed GPU-seconds of ``tenant`` on ``model`` up to ``now``."""
        row = self.rows.get((tenant, model))
        return 0.0 if row is None else self._advanced(row, now)

    def weighted(self, now: float, weight_of: Any = None) -> dict[str, float]:
        """Tenant -> decayed GPU-seconds up to ``now``, each model's weighted by ``weight_of(model)`` (1 without)."""
        totals: dict[str, float] = {}
        for (tenant, model), row in self.rows.items():
            weight = 1.0 if weight_of is None else weight_of(model)
            totals[tenant] = totals.get(tenant, 0.0) + weight * self._advanced(row, now)
        return totals

    def held(self) -> dict[str, float]:
        """Tenant -> GPUs it holds now (all models), as the ledger counts them."""
        held: dict[str, float] = {}
        for (tenant, _model), row in self.rows.items():
            held[tenant] = held.get(tenant, 0.0) + row[1]
        return held

    def to_list(self) -> list[list[Any]]:
        return [[tenant, model, *row] for (tenant, model), row in self.rows.items()]

    @classmethod
    def from_list(cls, raw: list[list[Any]], half_life_s: float = DEFAULT_HALF_LIFE_S) -> DecayedUsage:
        return cls(half_life_s, {(t, m): [float(total), float(rate), float(as_of)]
                                 for t, m, total, rate, as_of in raw})
