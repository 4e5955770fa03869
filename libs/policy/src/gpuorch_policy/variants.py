"""Workload variants of a task list, after the FGD paper's families (USENIX ATC'23, "Beware of Fragmentation", §6).

Each variant is a new task list drawn from the default one with a seeded generator, so anyone can rebuild it:

    multi_gpu-P   multi-GPU tasks (num_gpu >= 2) carry P % of the GPU request (default openb: 7.3 %); the other
                  P is filled by the trace's other GPU tasks (shares and one-GPU tasks, drawn uniformly); the
                  total GPU request and the CPU-only tasks stay those of the source.
    gpu_share-P   GPU shares (gpu_milli < 1000) carry P % of the GPU request (default: 28.5 %); the same way.
    gpu_spec-P    P % of the GPU tasks (chosen at random) accept only some GPU models of the fleet: one model
                  (drawn in proportion to the fleet's GPUs among the models that can host the task), plus a second
                  one half of the time; everything else unchanged.
    cpu_only-P    the CPU-only tasks ask P % of the CPU they ask in the source (drawn with replacement from the
                  source's CPU-only tasks); GPU tasks unchanged.

Drawing is uniform with replacement from the source's tasks of the class, stopping at the last task that keeps the
class at or below its target. Task names are `<source name>-<variant>-<n>` (unique: `gpuctl replay --verify` maps
placements to requests by name). Pure: no files, no clock.

`TUNED` are the levels the default policy may be tuned on; `HELD_OUT` are never used for tuning (nor seeds 52+).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from gpuorch_policy.model import NodeView, Request
from gpuorch_policy.openb import Task

FAMILIES: dict[str, tuple[int, ...]] = {
    "multi_gpu": (20, 30, 40, 50),
    "gpu_share": (40, 60, 80, 100),
    "gpu_spec": (10, 20, 25, 33),
    "cpu_only": (50, 150, 200, 250),
}
TUNED: dict[str, tuple[int, ...]] = {
    "multi_gpu": (20, 40),
    "gpu_share": (40, 80),
    "gpu_spec": (10, 25),
    "cpu_only": (50, 200),
}
HELD_OUT: dict[str, tuple[int, ...]] = {f: tuple(x for x in levels if x not in TUNED[f]) for f, levels in FAMILIES.items()}
DEFAULT_VARIANT_SEED = 2023


def variant_names(levels: dict[str, tuple[int, ...]] = FAMILIES) -> list[str]:
    return [f"{family}-{level}" for family, values in levels.items() for level in values]


def parse_variant(name: str) -> tuple[str, int]:
    """'multi_gpu-40' -> ('multi_gpu', 40); raises ValueError for an unknown family or a bad level."""
    family, _, level = name.rpartition("-")
    if family not in FAMILIES:
        raise ValueError(f"unknown variant family {family!r}; known: {', '.join(FAMILIES)}")
    try:
        value = int(level)
    except ValueError as exc:
        raise ValueError(f"variant level must be an integer percent, got {level!r}") from exc
    if not 0 <= value <= (100 if family != "cpu_only" else 10_000):
        raise ValueError(f"variant level {value} out of range for {family}")
    return family, value


def is_multi_gpu(r: Request) -> bool:
    return r.num_gpu >= 2


def is_share(r: Request) -> bool:
    return r.is_share


def is_gpu(r: Request) -> bool:
    return r.num_gpu > 0


def _draw(pool: Sequence[Task], amount: int, weight: str, rng: np.random.Generator) -> list[Task]:
    """Uniform draws with replacement from `pool` while the sum of `weight` stays at or below `amount`."""
    out: list[Task] = []
    total = 0
    if not pool or amount <= 0:
        return out
    sizes = [t.request.gpu_milli_total if weight == "gpu" else t.request.cpu_milli for t in pool]
    smallest = min(sizes)
    misses = 0
    while total + smallest <= amount and misses < 64:
        k = int(rng.integers(len(pool)))
        if total + sizes[k] > amount:
            misses += 1  # a large task would overshoot: try a few smaller ones before stopping
            continue
        misses = 0
        out.append(pool[k])
        total += sizes[k]
    return out


def _renamed(tasks: Sequence[Task], variant: str) -> list[Task]:
    return [
        replace(t, name=f"{t.name}-{variant}-{n}", source=f"{t.name}-{variant}-{n}") for n, t in enumerate(tasks)
    ]


def _class_mix(
    tasks: Sequence[Task], share_pct: int, select: Callable[[Request], bool], rng: np.random.Generator
) -> list[Task]:
    gpu_total = sum(t.request.gpu_milli_total for t in tasks)
    inside = [t for t in tasks if select(t.request)]
    outside = [t for t in tasks if is_gpu(t.request) and not select(t.request)]
    cpu_only = [t for t in tasks if not is_gpu(t.request)]
    target = gpu_total * share_pct // 100
    drawn = _draw(inside, target, "gpu", rng) + _draw(outside, gpu_total - target, "gpu", rng)
    return cpu_only + drawn


def _hostable_models(request: Request, nodes: Sequence[NodeView]) -> dict[str, int]:
    """GPU model -> GPUs in the fleet, for the models with a node that could host the request when empty."""
    out: dict[str, int] = {}
    for node in nodes:
        if not node.gpus:
            continue
        model = node.gpus[0].model
        out.setdefault(model, 0)
        out[model] += len(node.gpus)
    able = {
        n.gpus[0].model
        for n in nodes
        if n.gpus
        and len(n.gpus) >= request.num_gpu
        and n.cpu_milli_total >= request.cpu_milli
        and n.memory_mib_total >= request.memory_mib
    }
    return {m: c for m, c in sorted(out.items()) if m in able}


def _constrain(tasks: Sequence[Task], pct: int, nodes: Sequence[NodeView], rng: np.random.Generator) -> list[Task]:
    out = list(tasks)
    gpu_rows = [i for i, t in enumerate(out) if is_gpu(t.request)]
    count = round(len(gpu_rows) * pct / 100)
    chosen = rng.choice(len(gpu_rows), size=count, replace=False) if count else np.zeros(0, dtype=np.int64)
    memo: dict[tuple[int, int, int], dict[str, int]] = {}
    for c in sorted(int(x) for x in chosen):
        i = gpu_rows[c]
        r = out[i].request
        shape = (r.num_gpu, r.cpu_milli, r.memory_mib)
        if shape not in memo:
            memo[shape] = _hostable_models(r, nodes)
        models = memo[shape]
        if not models:
            continue
        names = list(models)
        weights = np.array([models[m] for m in names], dtype=np.float64)
        first = names[int(rng.choice(len(names), p=weights / weights.sum()))]
        accepted = [first]
        others = [m for m in names if m != first]
        if others and rng.random() < 0.5:
            w = np.array([models[m] for m in others], dtype=np.float64)
            accepted.append(others[int(rng.choice(len(others), p=w / w.sum()))])
        out[i] = replace(out[i], request=replace(out[i].request, gpu_models=tuple(sorted(accepted))))
    return out


def _cpu_only(tasks: Sequence[Task], pct: int, rng: np.random.Generator) -> list[Task]:
    cpu_only = [t for t in tasks if not is_gpu(t.request)]
    gpu_tasks = [t for t in tasks if is_gpu(t.request)]
    target = sum(t.request.cpu_milli for t in cpu_only) * pct // 100
    return gpu_tasks + _draw(cpu_only, target, "cpu", rng)


def make_variant(
    tasks: Sequence[Task], nodes: Sequence[NodeView], name: str, seed: int = DEFAULT_VARIANT_SEED
) -> list[Task]:
    """The variant `name` ('family-level', see the module text) of `tasks`, drawn with a generator seeded by
    (seed, family, level): the same inputs always give the same list."""
    family, level = parse_variant(name)
    family_id = list(FAMILIES).index(family)
    rng = np.random.default_rng([seed, family_id, level])
    if family == "multi_gpu":
        drawn = _class_mix(tasks, level, is_multi_gpu, rng)
    elif family == "gpu_share":
        drawn = _class_mix(tasks, level, is_share, rng)
    elif family == "gpu_spec":
        drawn = _constrain(tasks, level, nodes, rng)
    else:
        drawn = _cpu_only(tasks, level, rng)
    return _renamed(drawn, name)


def mix_shares(tasks: Sequence[Task]) -> dict[str, float]:
    """The proportions the families set, in % (for tests and reports)."""
    gpu = sum(t.request.gpu_milli_total for t in tasks) or 1
    gpu_tasks = [t for t in tasks if is_gpu(t.request)]
    return {
        "multi_gpu": 100.0 * sum(t.request.gpu_milli_total for t in tasks if is_multi_gpu(t.request)) / gpu,
        "gpu_share": 100.0 * sum(t.request.gpu_milli_total for t in tasks if is_share(t.request)) / gpu,
        "gpu_spec": 100.0 * sum(1 for t in gpu_tasks if t.request.gpu_models) / max(len(gpu_tasks), 1),
        "cpu_only_cpu": float(sum(t.request.cpu_milli for t in tasks if not is_gpu(t.request))),
    }


def to_csv_lines(tasks: Sequence[Task]) -> list[str]:
    """The tasks as openb-format CSV lines (header first), so that a variant can be written and replayed."""
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"]
    for t in tasks:
        r = t.request
        milli = r.gpu_milli if r.num_gpu else 0
        lines.append(f"{t.name},{r.cpu_milli},{r.memory_mib},{r.num_gpu},{milli},{'|'.join(r.gpu_models)}")
    return lines


__all__ = [
    "DEFAULT_VARIANT_SEED",
    "FAMILIES",
    "HELD_OUT",
    "TUNED",
    "make_variant",
    "mix_shares",
    "parse_variant",
    "to_csv_lines",
    "variant_names",
]
