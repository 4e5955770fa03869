"""``gpu_memory_auto``: a share sized from use, resolved when the API publishes the submission.

    SubmitJob spec (resources.gpu_memory_auto) ──► peaks of the last RUNS ended runs with the same name and tenant
        (telemetry: each run's peak GPU memory, ``ReadModels.run_peaks``)
        ──► some history: gpu_memory_mib = p95 of those peaks (nearest rank), rounded up to ROUND_MIB
        ──► none: gpu_memory_mib as submitted (the contract's AUTO_SHARE_DEFAULT_MIB unless the spec set one)
    and the label ``gpuorch.io/share-sizing`` says which ("p95 of 3 runs: 30720 MiB", "default: no history").

The scheduler sees an ordinary share of that size; a submission that does not pass through the API (published on
the broker by another system) keeps its ``gpu_memory_mib``. Pure: peaks in, spec out.
"""

from __future__ import annotations

import math

from gpuorch_contracts import JobSpec

RUNS = 20
"""How many of the latest ended runs count."""
ROUND_MIB = 256
SIZING_LABEL = "gpuorch.io/share-sizing"


def p95(values: list[int]) -> int:
    """The 95th percentile, nearest rank (a value that was observed: with three runs, the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def sized_from_use(spec: JobSpec, peaks: list[int]) -> JobSpec:
    """``spec`` with its ``gpu_memory_auto`` share sized from ``peaks`` (module docstring); other specs as given."""
    resources = spec.resources
    if not resources.gpu_memory_auto:
        return spec
    peaks = [p for p in peaks if p > 0]
    if peaks:
        size = max(ROUND_MIB, math.ceil(p95(peaks) / ROUND_MIB) * ROUND_MIB)
        how = f"p95 of {len(peaks)} run{'s' if len(peaks) > 1 else ''}: {size} MiB"
        resources = resources.model_copy(update={"gpu_memory_mib": size})
    else:
        how = f"default: no history ({resources.gpu_memory_mib} MiB)"
    return spec.model_copy(update={"resources": resources, "labels": {**spec.labels, SIZING_LABEL: how}})
