"""Fair share over time: each tenant's decayed usage against its share, as Slurm's ``sshare`` shows it.

    state.usage (decayed GPU-seconds per tenant and model, kept by the fold)
        × model weights (``FairSharePolicy.model_weights``)           ──► usage U_t (weighted GPU-seconds)
    shares from the identity map (``FairSharePolicy.shares``)          ──► share S_t
    normalised over the tenants known (``u_t = U_t / ΣU``, ``s_t = S_t / ΣS``)
                                                                       ──► factor F_t = 2 ** (-u_t / s_t)

``F_t`` is 1 for a tenant that used nothing, 0.5 for one that used exactly its share, towards 0 beyond (Slurm's
classic fair-share factor). The queue (``queueing.fair_order``) takes tenants' turns by
``dominant share now + weight × (1 - F_t)``: today's DRF, plus a penalty for the past that decays with the
half-life. Pure: ``now`` is given; the ledger is state from events, so a restart rebuilds it from the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.usage import DEFAULT_HALF_LIFE_S

DEFAULT_SHARE = 1.0
"""The share of a tenant the identity map gives none (and no ``"*"`` entry)."""


@dataclass(frozen=True)
class FairSharePolicy:
    """How past usage weighs in the order between tenants."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    """Usage halves every this many seconds (7 days, as Slurm's PriorityDecayHalfLife); the fold decays with it."""
    model_weights: dict[str, float] = field(default_factory=dict)
    """GPU model -> weight of its GPU-seconds (``{"h100": 2.0, "a100": 1.0}``): a key matches a model whose name
    contains it, case-insensitively (the longest key wins); other models weigh 1."""
    weight: float = 1.0
    """How much the past counts against today's dominant share (0: plain DRF, the past is ignored)."""
    shares: dict[str, float] = field(default_factory=dict)
    """Tenant (or ``"*"``) -> its share (relative numbers; the identity map's ``shares``)."""

    def share_of(self, tenant: str) -> float:
        return self.shares.get(tenant, self.shares.get("*", DEFAULT_SHARE))

    def model_weight(self, model: str) -> float:
        name = model.lower()
        best: tuple[int, float] | None = None
        for key, weight in self.model_weights.items():
            if key.lower() in name and (best is None or len(key) > best[0]):
                best = (len(key), weight)
        return 1.0 if best is None else best[1]

    def with_shares(self, shares: dict[str, float]) -> FairSharePolicy:
        return FairSharePolicy(self.half_life_s, self.model_weights, self.weight, dict(shares))

    @classmethod
    def from_json(cls, text: str, shares: dict[str, float] | None = None) -> FairSharePolicy:
        """``{"half_life_s": 604800, "model_weights": {"h100": 2}, "weight": 1}``; every key optional. Raises
        ValueError on anything else."""
        raw: Any = json.loads(text) if text.strip() else {}
        if not isinstance(raw, dict) or set(raw) - {"half_life_s", "model_weights", "weight"}:
            raise ValueError("fair share settings: a JSON object of half_life_s, model_weights, weight")
        weights = raw.get("model_weights", {})
        if not isinstance(weights, dict):
            raise ValueError("fair share model_weights: a JSON object of GPU model -> weight")
        half_life = float(raw.get("half_life_s", DEFAULT_HALF_LIFE_S))
        if half_life <= 0:
            raise ValueError("fair share half_life_s must be positive")
        return cls(half_life, {str(k): float(v) for k, v in weights.items()}, float(raw.get("weight", 1.0)),
                   dict(shares or {}))


@dataclass(frozen=True)
class TenantShare:
    """One tenant's line of ``gpuctl share``."""

    tenant: str
    share: float
    """As configured (raw)."""
    normalized_share: float
    usage_gpu_s: float
    """Decayed, weighted GPU-seconds up to ``now``."""
    normalized_usage: float
    factor: float
    """2 ** (-normalized_usage / normalized_share): 1 unused, 0.5 at its share, towards 0 beyond."""
    gpus_held: float

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "share": self.share, "normalized_share": round(self.normalized_share, 6),
                "usage_gpu_hours": round(self.usage_gpu_s / 3600.0, 3),
                "normalized_usage": round(self.normalized_usage, 6), "factor": round(self.factor, 6),
                "gpus_held": round(self.gpus_held, 3)}


def fair_shares(state: SchedulerState, policy: FairSharePolicy, now: float) -> list[TenantShare]:
    """Every tenant with a share, usage, holdings or waiting jobs, by tenant name. O(tenants × models)."""
    usage = state.usage.weighted(now, policy.model_weight)
    tenants = sorted({t for t in policy.shares if t != "*"} | set(usage) | set(state.tenant_held)
                     | {t for t, n in state.queued_by_tenant.items() if n > 0})
    total_share = sum(policy.share_of(t) for t in tenants) or 1.0
    total_usage = sum(usage.values())
    lines = []
    for tenant in tenants:
        share = policy.share_of(tenant)
        normalized_share = share / total_share
        used = usage.get(tenant, 0.0)
        normalized_usage = used / total_usage if total_usage > 0 else 0.0
        if normalized_usage <= 0:
            factor = 1.0
        elif normalized_share <= 0:
            factor = 0.0
        else:
            factor = 2.0 ** (-normalized_usage / normalized_share)
        held = state.tenant_held.get(tenant)
        lines.append(TenantShare(tenant, share, normalized_share, used, normalized_usage, factor,
                                 held[0] if held else 0.0))
    return lines


def history_penalties(state: SchedulerState, policy: FairSharePolicy, now: float) -> dict[str, float]:
    """Tenant -> ``weight × (1 - factor)``: what the queue adds to its dominant share (empty when nothing was used
    or the weight is 0, so the order is plain DRF at no cost)."""
    if policy.weight == 0 or not state.usage.rows:
        return {}
    return {line.tenant: policy.weight * (1.0 - line.factor) for line in fair_shares(state, policy, now)
            if line.factor < 1.0}
