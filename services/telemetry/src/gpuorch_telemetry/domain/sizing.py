"""What a job's observed peak memory would fit in: a MIG profile, a GPU share, and fp16/int8 weight sizes.

MIG profiles follow NVIDIA's MIG user guide ("Supported MIG Profiles"): each profile holds a fixed fraction of the
GPU's memory (eighths on A100/H100/H200, quarters on A30). A profile's usable memory is estimated as that fraction of
the memory total the GPU reports, which is what NVML shows inside the instance to within a few percent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuorch_policy.mig_profiles import mig_table_for

MIB = 1024 * 1024
GIB_MIB = 1024


@dataclass(frozen=True)
class MigProfile:
    name: str
    compute_slices: int
    memory_fraction: float

    def memory_mib(self, gpu_memory_total_mib: int) -> int:
        return int(gpu_memory_total_mib * self.memory_fraction)


def _eighths(*profiles: tuple[str, int, int]) -> tuple[MigProfile, ...]:
    return tuple(MigProfile(name, slices, eighths / 8) for name, slices, eighths in profiles)


MIG_PROFILES_BY_MEMORY_CLASS: dict[int, tuple[MigProfile, ...]] = {
    # A30 24GB: quarters.
    24: (MigProfile("1g.6gb", 1, 0.25), MigProfile("2g.12gb", 2, 0.5), MigProfile("4g.24gb", 4, 1.0)),
    # A100 40GB.
    40: _eighths(("1g.5gb", 1, 1), ("2g.10gb", 2, 2), ("3g.20gb", 3, 4), ("4g.20gb", 4, 4), ("7g.40gb", 7, 8)),
    # A100 80GB and H100 80GB share names and sizes.
    80: _eighths(("1g.10gb", 1, 1), ("1g.20gb", 1, 2), ("2g.20gb", 2, 2), ("3g.40gb", 3, 4), ("4g.40gb", 4, 4),
                 ("7g.80gb", 7, 8)),
    # H100 94GB (NVL / SXM5 94GB).
    94: _eighths(("1g.12gb", 1, 1), ("1g.24gb", 1, 2), ("2g.24gb", 2, 2), ("3g.47gb", 3, 4), ("4g.47gb", 4, 4),
                 ("7g.94gb", 7, 8)),
    # H200 141GB.
    141: _eighths(("1g.18gb", 1, 1), ("1g.35gb", 1, 2), ("2g.35gb", 2, 2), ("3g.71gb", 3, 4), ("4g.71gb", 4, 4),
                  ("7g.141gb", 7, 8)),
}
"""Profiles per GPU memory class (GB), smallest first. Classes are matched from the reported memory total. Only for
reading the memory of a profile a job already holds: advice names profiles from the GPU model's own table
(:func:`advisable_mig_profiles`), since a memory class does not say whether a model has MIG at all (an L4's 24 GB
matches the A30's class)."""


def memory_class_gb(gpu_memory_total_mib: int) -> int | None:
    """The MIG memory class of a GPU from its reported total (within 8 %), or None when it has no MIG."""
    total_gb = gpu_memory_total_mib * MIB / 1e9
    for klass in sorted(MIG_PROFILES_BY_MEMORY_CLASS):
        if abs(total_gb - klass) / klass <= 0.08:
            return klass
    return None


def mig_profiles_for(gpu_memory_total_mib: int) -> tuple[MigProfile, ...]:
    klass = memory_class_gb(gpu_memory_total_mib)
    return MIG_PROFILES_BY_MEMORY_CLASS.get(klass, ()) if klass is not None else ()


def advisable_mig_profiles(gpu_model: str | None) -> tuple[tuple[str, int], ...]:
    """``(name, memory MiB)`` of the MIG profiles advice may name for ``gpu_model``, smallest memory first: the
    model's table in ``gpuorch_policy.mig_profiles`` (the fleet's one copy, which the simulated NVML and the MIG
    planner read), media-extension profiles left out. ``()`` for a model without MIG (L4, T4, V100 ...) and for an
    unknown model: advice then names a share only."""
    if not gpu_model:
        return ()
    table = [p for p in mig_table_for(gpu_model) if not p.media_extensions]
    return tuple((p.name, p.memory_mib) for p in sorted(table, key=lambda p: (p.memory_mib, p.compute_slices)))


def mig_profile_memory_mib(profile_name: str, gpu_memory_total_mib: int | None) -> int | None:
    """Usable memory of ``profile_name``: from the GPU's class when known, else from the name (``3g.20gb``)."""
    if gpu_memory_total_mib:
        for profile in mig_profiles_for(gpu_memory_total_mib):
            if profile.name == profile_name:
                return profile.memory_mib(gpu_memory_total_mib)
    try:
        gb = float(profile_name.split(".", 1)[1].split("gb", 1)[0])
    except (IndexError, ValueError):
        return None
    return int(gb * 1e9 / MIB * 0.95)


def mig_profile_compute_fraction(profile_name: str) -> float | None:
    """Compute slices of a profile over the GPU's 7 (A30: 4), from the name's ``<n>g`` prefix."""
    try:
        slices = int(profile_name.split("g.", 1)[0])
    except ValueError:
        return None
    return min(1.0, slices / 7)


@dataclass(frozen=True)
class Fit:
    """The smallest allocation holding ``needed_memory_mib`` (peak plus headroom)."""

    needed_memory_mib: int
    mig_profile: str | None
    mig_profile_memory_mib: int | None
    share_memory_mib: int
    share_milli: int


def smallest_fit(
    peak_memory_mib: int, gpu_model: str | None, *, headroom: float, p95_util_of_gpu_pct: float | None
) -> Fit:
    """Smallest MIG profile (of ``gpu_model``'s own table, none for a model without MIG or unknown) and share that
    hold the peak with ``headroom`` (0.2 = +20 %).

    The share's memory rounds up to whole GiB; its compute (milli) is the p95 utilisation of the whole GPU plus the
    same headroom, rounded up to 50 milli, at least 50.
    """
    needed = math.ceil(peak_memory_mib * (1 + headroom))
    profile_name, profile_memory = next(((n, m) for n, m in advisable_mig_profiles(gpu_model) if m >= needed),
                                        (None, None))
    share_memory = max(GIB_MIB, math.ceil(needed / GIB_MIB) * GIB_MIB)
    util = p95_util_of_gpu_pct if p95_util_of_gpu_pct is not None else 100.0
    share_milli = min(1000, max(50, math.ceil(util * 10 * (1 + headroom) / 50) * 50))
    return Fit(needed, profile_name, profile_memory, share_memory, share_milli)


BYTES_PER_PARAMETER = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def weights_memory_mib(parameter_count: int, dtype: str) -> int:
    """Memory the weights alone take in ``dtype`` (activations, optimizer state and KV cache come on top)."""
    return math.ceil(parameter_count * BYTES_PER_PARAMETER[dtype] / MIB)
