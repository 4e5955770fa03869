"""The placement pipeline: filters -> scorer -> select (ties by node name) -> GPUs within the node.

    request, cluster ──► filters (all nodes at once) ──► feasible rows ──► scorer (int score, GPU slot)
                                 │ none left                                   │
                                 ▼                                             ▼
                        Unfit(plain reasons)           highest score, lowest node name ──► Placement

`place` is pure: it reads the cluster and returns a decision. `gpuorch_policy.index.PlacementIndex` gives the same
decisions at a cost that grows with what changed (the live fleet's engine, and every replay's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpuorch_policy.cluster import BoolArray, Cluster, IntArray
from gpuorch_policy.filters import DEFAULT_FILTERS, Filter
from gpuorch_policy.model import Placement, Request, Unfit
from gpuorch_policy.scorers import Scorer, best_fit_share_slot


@dataclass(frozen=True)
class Policy:
    """A named plugin set: filters in order, one scorer."""

    name: str
    scorer: Scorer
    filters: tuple[Filter, ...] = field(default=DEFAULT_FILTERS)


def feasible_mask(request: Request, cluster: Cluster, filters: Sequence[Filter]) -> BoolArray:
    mask = np.array(filters[0].mask(request, cluster), dtype=np.bool_) if filters else np.ones(cluster.size, bool)
    for flt in filters[1:]:
        mask &= flt.mask(request, cluster)
    return mask


def unfit_reasons(request: Request, cluster: Cluster, filters: Sequence[Filter]) -> tuple[str, ...]:
    """Why no node fits: the filter that ruled out the last candidates first, then how many nodes each filter
    rejected on its own."""
    problem = request.invalid_reason()
    if problem is not None:
        return (f"invalid request: {problem}",)
    candidates = np.ones(cluster.size, dtype=np.bool_)
    first = ""
    for flt in filters:
        passed = candidates & flt.mask(request, cluster)
        if not passed.any():
            first = flt.explain(request, cluster, candidates)
            break
        candidates = passed
    counts = []
    for flt in filters:
        rejected = int((~flt.mask(request, cluster)).sum())
        if rejected:
            counts.append(f"{flt.name}: {rejected}")
    summary = f"{cluster.size} nodes; rejected by " + ", ".join(counts) if counts else f"{cluster.size} nodes"
    return (first, summary) if first else (summary,)


def choose_gpus(request: Request, cluster: Cluster, row: int, pick: int) -> tuple[tuple[int, int], ...]:
    """GPU slots for the request on node `row`: the scorer's slot for a share (or the tightest fit), else the
    first eligible slots by index (the simulator's AllocateExclusiveGpuId)."""
    if request.num_gpu == 0:
        return ()
    if request.is_share:
        slot = pick if pick >= 0 else int(best_fit_share_slot(request, cluster, np.array([row]))[0])
        return ((slot, request.gpu_milli),)
    eligible = [int(s) for s in np.flatnonzero(cluster.eligible_gpus(request, np.array([row]))[0])]
    chosen = eligible[: request.num_gpu]
    links = cluster.nvlink_pairs[row]
    if request.num_gpu == 2 and links:
        free = set(eligible)
        linked = sorted((min(a, b), max(a, b)) for a, b in links if a in free and b in free)
        if linked:
            chosen = list(linked[0])  # an NVLink-joined pair when the node has one free
    return tuple((s, request.gpu_milli) for s in chosen)


def _select(cluster: Cluster, rows: IntArray, scores: IntArray) -> int:
    """Index into rows of the best score, lowest node name on ties."""
    n = cluster.size
    combined = scores * (n + 1) + (n - cluster.name_rank[rows])
    return int(np.argmax(combined))


def place(
    request: Request, cluster: Cluster, policy: Policy, rng: np.random.Generator | None = None
) -> Placement | Unfit:
    """Decide where one request goes. Pure: reads `cluster`, never changes it. `rng` is used only by
    randomised scorers (Random)."""
    if request.invalid_reason() is not None:
        return Unfit(unfit_reasons(request, cluster, policy.filters))
    rows = np.flatnonzero(feasible_mask(request, cluster, policy.filters))
    if len(rows) == 0:
        return Unfit(unfit_reasons(request, cluster, policy.filters))
    scores, picks = policy.scorer.score(request, cluster, rows, rng)
    best = _select(cluster, rows, scores)
    row = int(rows[best])
    gpus = choose_gpus(request, cluster, row, int(picks[best]))
    return Placement(node_id=cluster.node_ids[row], gpus=gpus, score=int(scores[best]))


def place_gang(
    request: Request, members: int, cluster: Cluster, policy: Policy, rng: np.random.Generator | None = None
) -> list[Placement] | Unfit:
    """All or nothing: `members` copies of `request`, each on a different node. Pure: works on a copy of the
    cluster; returns every member's placement, or Unfit naming how many members fit."""
    trial = cluster.copy()
    placed: list[Placement] = []
    for member in range(members):
        trial.schedulable = trial.schedulable.copy()
        decision = place(request, trial, policy, rng)
        if not isinstance(decision, Placement):
            return Unfit((f"gang of {members}: only {member} members fit on distinct nodes", *decision.reasons))
        placed.append(decision)
        trial.assign(request, decision)
        trial.schedulable[trial.index_of[decision.node_id]] = False  # one member per node
    return placed
