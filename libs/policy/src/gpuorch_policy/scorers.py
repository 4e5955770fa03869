"""Scorer plugins: how good is each feasible node for the request?

Every scorer returns, for the rows (node indexes) it is given, an integer score (higher is better) and, for a GPU
share, the GPU slot it would use on that node (-1: let the default GPU chooser decide). The framework takes the
highest score and breaks ties by node name (lowest first).

The five baselines and FGD follow the FGD simulator (hkust-adsl/kubernetes-scheduler-simulator,
pkg/simulator/plugin/*_score.go) to the integer: 0-100 scores with the same truncations, so that a replay lands on
the published numbers. `node_local` says the score of a node depends only on that node and the request, which lets a
caller cache scores per node version; Random is not node-local.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import numpy as np

from gpuorch_policy.cluster import Cluster, IntArray
from gpuorch_policy.fragmentation import (
    TaskMix,
    capacity_frag,
    capacity_frag_share,
    frag_after_share,
    frag_weighted,
    sigmoid_score,
    take_gpus_best_fit,
)
from gpuorch_policy.model import GPU_MILLI, Request

MAX_SPEC_CPU = 128_000  # the simulator's normalisers (MaxSpecCpu, MaxSpecGpu)
MAX_SPEC_GPU = 8_000
MAX_SCORE = 100


class Scorer(Protocol):
    name: str
    node_local: bool

    def cache_key(self, request: Request) -> Hashable: ...

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]: ...


def _scoring_key(request: Request) -> tuple[Hashable, ...]:
    return (request.cpu_milli, request.num_gpu, request.gpu_milli, request.gpu_models, request.gpu_memory_mib)


def _no_pick(rows: IntArray) -> IntArray:
    return np.full(len(rows), -1, dtype=np.int64)


def best_fit_share_slot(request: Request, cluster: Cluster, rows: IntArray) -> IntArray:
    """Per node, the eligible slot with the least free milli (first index on ties): the simulator's "best" GPU."""
    eligible = cluster.eligible_gpus(request, rows)
    key = np.where(eligible, cluster.gpu_usable[rows], np.iinfo(np.int64).max)
    return np.asarray(np.argmin(key, axis=1))


class RandomScore:
    """One feasible node drawn uniformly gets 100, all others 0; a share goes to a random fitting GPU."""

    name = "Random"
    node_local = False

    def cache_key(self, request: Request) -> Hashable:
        return None

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        gen = rng if rng is not None else np.random.default_rng()
        scores = np.zeros(len(rows), dtype=np.int64)
        picks = _no_pick(rows)
        if len(rows) == 0:
            return scores, picks
        chosen = int(gen.integers(len(rows)))
        scores[chosen] = MAX_SCORE
        if request.is_share:
            slots = np.flatnonzero(cluster.eligible_gpus(request, rows[chosen : chosen + 1])[0])
            picks[chosen] = int(slots[int(gen.integers(len(slots)))])
        return scores, picks


class DotProductScore:
    """Tetris-style alignment with merged GPU dimension, normalised by the largest node (simulator: merge/max)."""

    name = "DotProd"
    node_local = True

    def cache_key(self, request: Request) -> Hashable:
        return _scoring_key(request)

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        node_cpu = cluster.cpu_free[rows] / float(MAX_SPEC_CPU)
        node_gpu = cluster.gpu_usable[rows].sum(axis=1) / float(MAX_SPEC_GPU)
        pod_cpu = request.cpu_milli / float(MAX_SPEC_CPU)
        pod_gpu = request.gpu_milli_total / float(MAX_SPEC_GPU)
        dot = node_cpu * pod_cpu + node_gpu * pod_gpu
        scores = (float(MAX_SCORE) * (1.0 - dot / 2.0)).astype(np.int64)
        picks = best_fit_share_slot(request, cluster, rows) if request.is_share else _no_pick(rows)
        return scores, picks


class BestFitScore:
    """Least (CPU, GPU) left after placing, weighted half and half (simulator's BestFit; its min-max normalisation
    keeps the order, so it is left out)."""

    name = "BestFit"
    node_local = True

    def cache_key(self, request: Request) -> Hashable:
        return _scoring_key(request)

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        cpu_left = (cluster.cpu_free[rows] - request.cpu_milli) / float(MAX_SPEC_CPU) * 0.5
        gpu_left = (cluster.gpu_usable[rows].sum(axis=1) - request.gpu_milli_total) / float(MAX_SPEC_GPU) * 0.5
        raw = 0.0 + cpu_left + gpu_left
        scores = ((1.0 - raw) * float(MAX_SCORE)).astype(np.int64)
        picks = best_fit_share_slot(request, cluster, rows) if request.is_share else _no_pick(rows)
        return scores, picks


class GpuPackingScore:
    """Prefer shared GPUs, then free GPUs on used nodes, then empty nodes (simulator's GpuPacking)."""

    name = "GpuPacking"
    node_local = True

    def cache_key(self, request: Request) -> Hashable:
        return _scoring_key(request)

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        picks = best_fit_share_slot(request, cluster, rows) if request.is_share else _no_pick(rows)
        if request.gpu_milli_total <= 0:
            return np.zeros(len(rows), dtype=np.int64), picks
        free = cluster.gpu_usable[rows]
        present = cluster.gpu_present[rows]
        fully_free = ((free == GPU_MILLI) & present).sum(axis=1)
        gpu_number = cluster.gpu_count[rows]
        # GPUs used: eligible slots, least free first (stable), the first num_gpu of them.
        eligible = cluster.eligible_gpus(request, rows)
        key = np.where(eligible, free, np.iinfo(np.int64).max)
        order = np.argsort(key, axis=1, kind="stable")[:, : request.num_gpu]
        used_free = np.take_along_axis(free, order, axis=1)
        free_used = (used_free == GPU_MILLI).sum(axis=1)
        shared_ratio = (used_free * 100 // GPU_MILLI).sum(axis=1)
        case_shared = np.maximum(MAX_SCORE - shared_ratio // 10, MAX_SCORE // 2)
        case_free_on_used = np.maximum(MAX_SCORE // 2 - free_used, MAX_SCORE // 3)
        case_empty = np.maximum(MAX_SCORE // 3 - fully_free, fully_free)
        scores = np.where(
            fully_free == gpu_number, case_empty, np.where(free_used > 0, case_free_on_used, case_shared)
        )
        return scores.astype(np.int64), picks


class GpuClusteringScore:
    """Keep tasks of the same GPU shape together (simulator's GpuClustering)."""

    name = "GpuClustering"
    node_local = True

    def cache_key(self, request: Request) -> Hashable:
        return _scoring_key(request)

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        picks = best_fit_share_slot(request, cluster, rows) if request.is_share else _no_pick(rows)
        if request.num_gpu == 0:
            return np.zeros(len(rows), dtype=np.int64), picks
        tag = 0 if request.is_share else min(request.num_gpu, 9)
        counts = cluster.affinity_counts[rows]
        kinds = (counts > 0).sum(axis=1)
        same = counts[:, tag] > 0
        left = cluster.gpu_usable[rows].sum(axis=1)
        base = (MAX_SCORE // 4) * (MAX_SPEC_GPU - left) // MAX_SPEC_GPU
        bonus = np.where(
            same,
            np.where(kinds == 1, MAX_SCORE * 3 // 4, MAX_SCORE * 2 // 4),
            np.where(kinds == 0, MAX_SCORE // 4, 0),
        )
        return (base + bonus).astype(np.int64), picks


class FgdScore:
    """Fragmentation gradient descent: the node whose fragmentation (against the task mix) grows least.

    Score = int(100 * sigmoid(-(frag after - frag before) / 1000)); a share goes to the GPU with the best score
    (first index on ties), whole GPUs to the first free indexes, exactly as the simulator.
    """

    name = "FGD"
    node_local = True

    def __init__(self, mix: TaskMix) -> None:
        self.mix = mix

    def cache_key(self, request: Request) -> Hashable:
        return _scoring_key(request)

    def frag_change(self, request: Request, cluster: Cluster, rows: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(weighted frag before [n], weighted frag after [n, options], option valid [n, options])."""
        mix = self.mix
        free = cluster.gpu_usable[rows]
        cpu = cluster.cpu_free[rows]
        model = cluster.node_model[rows]
        before = frag_weighted(mix, free, cpu, model, cluster)
        cpu_after = cpu - request.cpu_milli
        if request.is_share:
            after = frag_after_share(mix, free, cpu_after, model, request.gpu_milli, cluster)
            valid = cluster.eligible_gpus(request, rows)
            return before, after, valid
        eligible = cluster.eligible_gpus(request, rows) if request.num_gpu else free >= 0
        left = take_gpus_best_fit(free, eligible, request.num_gpu, request.gpu_milli)
        after = frag_weighted(mix, left, cpu_after, model, cluster)[:, None]
        return before, after, np.ones_like(after, dtype=np.bool_)

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        before, after, valid = self.frag_change(request, cluster, rows)
        per_option = np.where(valid, sigmoid_score(before[:, None], after, self.mix.total_weight), -1)
        best = np.argmax(per_option, axis=1)
        scores = per_option[np.arange(len(rows)), best]
        picks = best if request.is_share else _no_pick(rows)
        return scores.astype(np.int64), np.asarray(picks, dtype=np.int64)


class GpuorchScore:
    """gpuorch's default: capacity-aware fragmentation gradient with coarse scores and name-order consolidation.

    Like FGD it scores the change of fragmentation against the task mix through a sigmoid, but fragmentation counts
    what tasks of each type could really take from the node (instances limited by GPU shares, host CPU and host
    memory), so it sees CPU- or memory-stranded GPUs and share leftovers that fit no typical share. `resolution`
    is the number of score levels: coarse levels make near-equal nodes tie (measured: finer scores do worse).
    Within a level: nodes that alone can host some rare type of the mix (`reserve_scarce`: fewer than that share
    of the GPU nodes could host it when empty, e.g. 8 GPUs with 120 cores and 720 GiB) come last; then CPU-only
    tasks go beside the busiest GPUs, GPU tasks where the most CPU per free GPU remains; then the first node by name.
    Type weights are the mix's counts, except that a starved share type (its leftover seldom fillable by the mix,
    `TaskMix.starvation`) weighs up to twice (`starved_shares`): it keeps GPUs that can still take one and fills
    partly used GPUs first. A per-mix choice: when multi-GPU tasks carry `multi_gpu_switch` or more of the mix's
    GPU request, FGD's own score (with the mix's plain counts) is used instead (measured: FGD is ahead there). The
    other switches exist for the measurements in docs/placement.md.
    """

    name = "gpuorch"
    node_local = True

    def __init__(
        self,
        mix: TaskMix,
        resolution: int = 30,
        use_memory: bool = True,
        exact_gpu_choice: bool = False,
        cpu_tasks_to_busy_gpus: bool = True,
        bucket_milli: int = 0,
        prefer_cpu_rich: bool = True,
        reserve_scarce: float = 0.1,
        multi_gpu_switch: float = 0.27,
        fgd_reserve: bool = False,
        starved_shares: bool = True,
    ) -> None:
        self.mix = mix.with_starved_shares() if starved_shares else mix
        self.fgd_reserve = fgd_reserve
        self.fgd = FgdScore(mix) if mix.multi_gpu_share >= multi_gpu_switch else None
        self.reserve_scarce = reserve_scarce
        self._reserved: dict[tuple[int, int], IntArray] = {}  # per (cluster, size): a pure cache
        self.prefer_cpu_rich = prefer_cpu_rich
        self.bucket_milli = bucket_milli
        self.cpu_tasks_to_busy_gpus = cpu_tasks_to_busy_gpus
        self.resolution = resolution
        self.use_memory = use_memory
        self.exact_gpu_choice = exact_gpu_choice
        # Memo of each node's fragmentation by node version (it does not depend on the request): a pure cache.
        self._memo_cluster: Cluster | None = None
        self._memo_frag = np.zeros(0, dtype=np.int64)
        self._memo_version = np.zeros(0, dtype=np.int64)

    def _frag_now(self, cluster: Cluster, rows: IntArray) -> IntArray:
        size = cluster.size
        if self._memo_cluster is not cluster or len(self._memo_version) != size:
            self._memo_cluster = cluster
            self._memo_frag = np.zeros(size, dtype=np.int64)
            self._memo_version = np.full(size, -1, dtype=np.int64)
        stale = rows[self._memo_version[rows] != cluster.version[rows]]
        if len(stale):
            mem = cluster.mem_free[stale] if self.use_memory else None
            self._memo_frag[stale] = capacity_frag(
                self.mix, cluster.gpu_usable[stale], cluster.cpu_free[stale], mem, cluster.node_model[stale], cluster
            )
            self._memo_version[stale] = cluster.version[stale]
        return self._memo_frag[rows]

    def cache_key(self, request: Request) -> Hashable:
        return (*_scoring_key(request), request.memory_mib if self.use_memory else 0)

    def reserved(self, cluster: Cluster) -> IntArray:
        """1 for the nodes that are among the few (< reserve_scarce of the GPU nodes) able to host, when empty,
        some GPU task type seen in the mix (say 8 GPUs with 120 cores and 720 GiB, or a rare model); 0 elsewhere.
        Depends on node totals only, so it is kept per cluster and size (a node whose totals change keeps its flag
        until the cluster grows: only a tie-break, never a capacity decision)."""
        key = (id(cluster), cluster.size)
        cached = self._reserved.get(key)
        if cached is not None:
            return cached
        reserved = np.zeros(cluster.size, dtype=np.bool_)
        gpu_nodes = max(int((cluster.gpu_count > 0).sum()), 1)
        names = list(cluster.model_names)
        for task_type, _count, memory in self.mix.observed:
            if task_type.num_gpu == 0:
                continue
            hosts = (
                (cluster.gpu_count >= task_type.num_gpu)
                & (cluster.cpu_total >= task_type.cpu_milli)
                & (cluster.mem_total >= memory)
            )
            if task_type.gpu_models:
                ids = [names.index(m) for m in task_type.gpu_models if m in names]
                hosts &= np.isin(cluster.node_model, ids)
            found = int(hosts.sum())
            if 0 < found < self.reserve_scarce * gpu_nodes:
                reserved |= hosts
        if len(self._reserved) >= 8:  # a live fleet and its copies: a few clusters at most
            self._reserved.clear()
        self._reserved[key] = reserved.astype(np.int64)
        return self._reserved[key]

    def score(
        self, request: Request, cluster: Cluster, rows: IntArray, rng: np.random.Generator | None
    ) -> tuple[IntArray, IntArray]:
        if self.fgd is not None:
            scores, picks = self.fgd.score(request, cluster, rows, rng)
            if self.fgd_reserve:
                scores = scores * 2 + (1 - self.reserved(cluster)[rows])
            return scores, picks
        mix = self.mix
        free = cluster.gpu_usable[rows]
        cpu = cluster.cpu_free[rows]
        mem = cluster.mem_free[rows] if self.use_memory else None
        model = cluster.node_model[rows]
        cpu_after = cpu - request.cpu_milli
        mem_after = mem - request.memory_mib if mem is not None else None
        if request.is_share:
            before, after = capacity_frag_share(
                mix, free, cpu, mem, model, request.cpu_milli, request.memory_mib, request.gpu_milli, cluster
            )
            valid = cluster.eligible_gpus(request, rows)
        else:
            before = self._frag_now(cluster, rows)
            eligible = cluster.eligible_gpus(request, rows) if request.num_gpu else free >= 0
            left = take_gpus_best_fit(free, eligible, request.num_gpu, request.gpu_milli)
            after = capacity_frag(mix, left, cpu_after, mem_after, model, cluster)[:, None]
            valid = np.ones_like(after, dtype=np.bool_)
        x = (before[:, None] - after) / mix.total_weight / 1000.0
        if self.bucket_milli > 0:
            gain = (before[:, None] - after) // mix.total_weight  # milli of fragmentation removed (floor)
            floor_level = -(3400 // self.bucket_milli)
            levels = np.maximum(np.floor_divide(gain, self.bucket_milli), floor_level) - floor_level
        else:
            levels = (1.0 / (1.0 + np.exp(-x)) * self.resolution).astype(np.int64)
        per_option = np.where(valid, levels, -1)
        if self.exact_gpu_choice and request.is_share:
            # the GPU inside the node: least fragmentation exactly (then tightest fit); the node keeps its level
            fine = np.where(valid, -after * 1024 - free, np.iinfo(np.int64).min)
            best = np.argmax(fine, axis=1)
        else:
            best = np.argmax(per_option, axis=1)
        scores = per_option[np.arange(len(rows)), best]
        if self.reserve_scarce > 0:
            # Among equal levels, keep off the few nodes that alone can host some rare big or constrained type.
            scores = scores * 2 + (1 - self.reserved(cluster)[rows])
        if self.cpu_tasks_to_busy_gpus and request.num_gpu == 0:
            # Among equal levels, a CPU-only task goes where the fewest GPU-milli are free: CPU next to busy GPUs
            # is CPU that GPU tasks could not have used anyway.
            scores = scores * 100_000 + (99_999 - np.minimum(free.sum(axis=1), 99_999))
        elif self.prefer_cpu_rich and request.num_gpu > 0:
            # Among equal levels, a GPU task goes where the most host CPU per free GPU remains (whole cores per
            # GPU; a node it fills completely counts as very rich): GPUs left behind stay usable by CPU-hungry
            # tasks instead of being stranded on CPU-poor nodes.
            gpu_left = np.maximum(free.sum(axis=1) - request.gpu_milli_total, 100)
            cores_per_gpu = np.clip((cpu - request.cpu_milli) // gpu_left, 0, 99_999)
            scores = scores * 100_000 + cores_per_gpu
        picks = best if request.is_share else _no_pick(rows)
        return scores.astype(np.int64), np.asarray(picks, dtype=np.int64)
