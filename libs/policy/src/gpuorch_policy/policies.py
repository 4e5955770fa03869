"""The policy registry: name -> Policy, built for a task mix (needed by fragmentation-aware scorers)."""

from __future__ import annotations

from collections.abc import Callable

from gpuorch_policy.fragmentation import TaskMix
from gpuorch_policy.framework import Policy
from gpuorch_policy.scorers import (
    BestFitScore,
    DotProductScore,
    FgdScore,
    GpuClusteringScore,
    GpuorchScore,
    GpuPackingScore,
    RandomScore,
)

PUBLISHED = {
    # policy: (GPU allocated % at 100 % arrived, unallocated GPU % at 130 % arrived), FGD paper, openb default
    "FGD": (95.23, 4.61),
    "BestFit": (92.86, 6.92),
    "GpuPacking": (91.78, 8.00),
    "GpuClustering": (91.65, 8.12),
    "DotProd": (90.62, 9.15),
    "Random": (86.30, 12.53),
}

_BUILDERS: dict[str, Callable[[TaskMix], Policy]] = {
    "Random": lambda mix: Policy("Random", RandomScore()),
    "DotProd": lambda mix: Policy("DotProd", DotProductScore()),
    "GpuClustering": lambda mix: Policy("GpuClustering", GpuClusteringScore()),
    "GpuPacking": lambda mix: Policy("GpuPacking", GpuPackingScore()),
    "BestFit": lambda mix: Policy("BestFit", BestFitScore()),
    "FGD": lambda mix: Policy("FGD", FgdScore(mix)),
    "gpuorch": lambda mix: Policy("gpuorch", GpuorchScore(mix)),
}

DEFAULT_POLICY = "gpuorch"


def policy_names() -> list[str]:
    return list(_BUILDERS)


def build_policy(name: str, mix: TaskMix) -> Policy:
    """The named policy; names are matched without regard to case. Raises KeyError for an unknown name."""
    for known, builder in _BUILDERS.items():
        if known.lower() == name.lower():
            return builder(mix)
    raise KeyError(f"unknown policy {name!r}; known: {', '.join(_BUILDERS)}")
