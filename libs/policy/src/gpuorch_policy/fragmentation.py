"""GPU fragmentation of nodes, measured against a task mix (the FGD definition, USENIX ATC'23).

A node's fragmentation is the expected amount of its free GPU-milli that the next task, drawn from the mix, could
not use: for a task type the node can host (GPU model, CPU, enough GPUs with the share free), only GPUs with less
free than the share count; for a type it cannot host, and for CPU-only types, all free GPU-milli counts.

    frag(node) = S - sum over hostable GPU types k of  f_k * U_k
    S   = free GPU-milli of the node,   U_k = free milli on GPUs with at least m_k free

Weights are kept as integer counts so that equal states give exactly equal values (the scores built on top truncate
to integers, and a one-ulp error would move them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gpuorch_policy.cluster import NO_MODEL, Cluster, IntArray
from gpuorch_policy.model import Request


@dataclass(frozen=True)
class TaskType:
    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    gpu_models: tuple[str, ...]


class TaskMix:
    """The typical task types of a workload with integer weights (counts).

    Built like the FGD simulator: types keyed by (CPU, per-GPU milli, GPU count, model constraint), most popular
    first (ties: larger type first), until `coverage` of all tasks is reached; CPU-only types included.
    """

    def __init__(
        self, types: Sequence[TaskType], weights: Sequence[int], memory_mib: Sequence[int] | None = None,
        observed: Sequence[tuple[TaskType, int, int]] | None = None,
    ) -> None:
        if len(types) != len(weights) or not types:
            raise ValueError("a task mix needs at least one type and one weight per type")
        self.types = tuple(types)
        self.weights = np.array(weights, dtype=np.int64)
        memory = np.zeros(len(types), dtype=np.int64) if memory_mib is None else np.array(memory_mib, np.int64)
        self.memory_mib = memory
        # Every type seen, rare ones included (type, count, mean memory): for reserving scarce nodes.
        self.observed = (
            tuple(observed)
            if observed is not None
            else tuple((t, int(w), int(m)) for t, w, m in zip(types, weights, memory, strict=True))
        )
        self.total_weight = int(self.weights.sum())
        gpu_demand = sum(c * t.num_gpu * t.gpu_milli for t, c, _ in self.observed)
        multi = sum(c * t.num_gpu * t.gpu_milli for t, c, _ in self.observed if t.num_gpu >= 2)
        self.multi_gpu_share = multi / gpu_demand if gpu_demand else 0.0  # of the GPU request, 0-1
        gpu = [k for k, t in enumerate(types) if t.num_gpu > 0 and t.gpu_milli > 0]
        self.gpu_cpu = np.array([types[k].cpu_milli for k in gpu], dtype=np.int64)
        self.gpu_milli = np.array([types[k].gpu_milli for k in gpu], dtype=np.int64)
        self.gpu_num = np.array([types[k].num_gpu for k in gpu], dtype=np.int64)
        self.gpu_weight = self.weights[gpu]
        self.gpu_memory = memory[gpu]
        self.gpu_whole = self.gpu_milli >= 1000
        # shares_per_gpu[free milli, k]: how many GPU-type-k pieces fit in a GPU with that much free.
        self.shares_per_gpu = (np.arange(1001)[:, None] // np.maximum(self.gpu_milli, 1)).astype(np.int64)
        self.gpu_models = [types[k].gpu_models for k in gpu]
        self._access: dict[tuple[str, ...], np.ndarray] = {}  # per model list: access and coefficient tables

    @classmethod
    def from_requests(cls, requests: Iterable[Request], coverage: float = 0.95) -> TaskMix:
        counts: Counter[TaskType] = Counter()
        memory: Counter[TaskType] = Counter()
        for r in requests:
            key = TaskType(r.cpu_milli, r.gpu_milli if r.num_gpu else 0, r.num_gpu, tuple(r.gpu_models))
            counts[key] += 1
            memory[key] += r.memory_mib
        if not counts:
            raise ValueError("empty workload")
        total = sum(counts.values())
        ordered = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpu, "|".join(kv[0].gpu_models)),
            reverse=True,
        )
        chosen: list[tuple[TaskType, int]] = []
        cumulative = 0
        for task_type, count in ordered:
            if cumulative >= coverage * total:
                break
            chosen.append((task_type, count))
            cumulative += count
        return cls(
            [t for t, _ in chosen], [c for _, c in chosen], [memory[t] // c for t, c in chosen],
            observed=[(t, c, memory[t] // c) for t, c in ordered],
        )

    def starvation(self) -> dict[int, float]:
        """Per one-GPU share size (milli) of the mix: how little of its leftover the mix can fill, 0-1.

        One share of m milli on a GPU leaves 1000 - m that only shares of at most that size can use. For every
        task of size m the mix offers `fillers / own` such tasks (all sizes <= 1000 - m, counted like the mix's
        weights); starvation is 1 - that ratio, floored at 0. openb: 810-milli shares (12.8 % of tasks) leave 190
        that only the rare 160-milli shares fit, so 810 is starved (0.93); every other size is 0."""
        shares = [(t.gpu_milli, int(w)) for t, w in zip(self.types, self.weights, strict=True)
                  if t.num_gpu == 1 and 0 < t.gpu_milli < 1000]
        own: Counter[int] = Counter()
        for milli, count in shares:
            own[milli] += count
        return {
            milli: max(0.0, 1.0 - sum(c for m, c in shares if m <= 1000 - milli) / count)
            for milli, count in own.items()
        }

    def with_starved_shares(self) -> TaskMix:
        """This mix with each one-GPU share type weighted `1 + starvation` times (at most twice).

        A starved share (its leftover is seldom filled) in practice needs a GPU of its own, and every GPU that can
        still take one (at least m free) is one it may need: weighting it up makes the fragmentation measure keep
        such GPUs and fill partly used ones first. Weights stay integers (all scaled by 100); types and rare types
        (`observed`) are unchanged, so the multi-GPU share and the scarce-node reservation do not move."""
        starved = self.starvation()
        weights = [
            round(int(w) * 100 * (1.0 + (starved.get(t.gpu_milli, 0.0) if t.num_gpu == 1 else 0.0)))
            for t, w in zip(self.types, self.weights, strict=True)
        ]
        return TaskMix(self.types, weights, self.memory_mib.tolist(), observed=self.observed)

    def coefficient_table(self, cluster: Cluster) -> np.ndarray:
        """[model id + 1, gpu types]: weight x GPU-milli of one task of type k on a node of that model (0: refused)."""
        key = ("coef", *cluster.model_names)
        table = self._access.get(key)
        if table is None:
            table = self.access(cluster) * (self.gpu_weight * self.gpu_milli * self.gpu_num)
            self._access[key] = table
        return table

    def access(self, cluster: Cluster) -> np.ndarray:
        """bool[model id + 1, gpu types]: may GPU type k run on a node of this model (row 0: CPU nodes)?"""
        key = tuple(cluster.model_names)
        table = self._access.get(key)
        if table is None:
            table = np.ones((len(cluster.model_names) + 1, len(self.gpu_models)), dtype=np.bool_)
            table[0, :] = False
            for k, models in enumerate(self.gpu_models):
                if models:
                    for m, name in enumerate(cluster.model_names):
                        table[m + 1, k] = name in models
            self._access[key] = table
        return table


def frag_weighted(
    mix: TaskMix, free: IntArray, cpu_free: IntArray, node_model: IntArray, cluster: Cluster
) -> IntArray:
    """Fragmentation times the mix's total weight, for each row of `free` (GPU-milli per slot, 0 where absent)."""
    access = mix.access(cluster)[node_model - NO_MODEL]  # rows: nodes, cols: GPU types
    total = free.sum(axis=-1)
    fits = free[..., None] >= mix.gpu_milli  # [..., slot, k]
    count = fits.sum(axis=-2)
    usable = (free[..., None] * fits).sum(axis=-2)
    hostable = access & (cpu_free[..., None] >= mix.gpu_cpu) & (count >= mix.gpu_num)
    return np.asarray(total * mix.total_weight - (hostable * usable * mix.gpu_weight).sum(axis=-1))


def frag_after_share(
    mix: TaskMix, free: IntArray, cpu_after: IntArray, node_model: IntArray, share: int, cluster: Cluster
) -> IntArray:
    """Weighted fragmentation after taking `share` milli from each GPU slot in turn: shape [nodes, slots].

    Computed incrementally (only one slot changes) to stay cheap on many nodes; slots with less than `share`
    free give meaningless values and must be masked by the caller.
    """
    access = mix.access(cluster)[node_model - NO_MODEL][:, None, :]  # [n, 1, k]
    total = free.sum(axis=-1)
    fits = free[..., None] >= mix.gpu_milli  # [n, s, k]
    count = fits.sum(axis=1)  # [n, k]
    usable = (free[..., None] * fits).sum(axis=1)  # [n, k]
    after = free - share  # [n, s]: the slot's free milli after the share
    fits_after = after[..., None] >= mix.gpu_milli  # [n, s, k]
    count_after = count[:, None, :] - fits + fits_after
    usable_after = usable[:, None, :] - free[..., None] * fits + after[..., None] * fits_after
    hostable = access & (cpu_after[:, None, None] >= mix.gpu_cpu) & (count_after >= mix.gpu_num)
    lost = (hostable * usable_after * mix.gpu_weight).sum(axis=-1)  # [n, s]
    return np.asarray((total - share)[:, None] * mix.total_weight - lost)


def take_gpus_best_fit(free: IntArray, eligible: np.ndarray, num_gpu: int, milli: int) -> IntArray:
    """Free milli after taking `milli` from `num_gpu` eligible slots, least free first (the FGD simulator's Sub)."""
    if num_gpu == 0:
        return free
    key = np.where(eligible, free, np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1, kind="stable")[:, :num_gpu]
    after = free.copy()
    rows = np.arange(free.shape[0])[:, None]
    after[rows, order] -= milli
    return after


def sigmoid_score(frag_before: IntArray, frag_after: IntArray, weight: int) -> IntArray:
    """FGD's node score: int(100 * sigmoid((before - after) / 1000 GPU-milli)), truncated like Go's int64()."""
    x = (frag_before - frag_after) / weight / 1000.0
    return (1.0 / (1.0 + np.exp(-x)) * 100.0).astype(np.int64)


# ---- capacity-aware fragmentation (gpuorch's default policy) ------------------------------------------------------
#
# FGD asks, per task type, "can this node host one more?". We ask "how much of this node's free GPU could tasks of
# this type actually take?": instances limited by GPUs (shares per GPU: floor(free / share); whole: free GPUs / n),
# by host CPU and by host memory. Free GPU-milli the type cannot take counts as fragment.
#
#     frag(node) = S - sum over GPU types k of f_k * min(gpu_k, cpu_free // c_k, mem_free // mem_k) * m_k * n_k


def gpu_instances(mix: TaskMix, free: IntArray) -> IntArray:
    """[..., k]: how many tasks of each GPU type the free GPU-milli could hold, ignoring CPU and memory.
    (A share type has num_gpu 1, so dividing by num_gpu serves both kinds.)"""
    return np.asarray(mix.shares_per_gpu[free].sum(axis=-2) // mix.gpu_num)


def host_instances(mix: TaskMix, cpu_free: IntArray, mem_free: IntArray | None) -> IntArray:
    """[..., k]: how many tasks of each GPU type the host CPU (and memory) could hold."""
    cap = cpu_free[..., None] // np.maximum(mix.gpu_cpu, 1)
    if mem_free is not None:
        cap = np.minimum(cap, mem_free[..., None] // np.maximum(mix.gpu_memory, 1))
    return np.asarray(np.maximum(cap, 0))


def _coefficients(mix: TaskMix, node_model: IntArray, cluster: Cluster) -> np.ndarray:
    """[n, k]: weight x GPU-milli per task of type k, 0 where the node's model is refused."""
    return np.asarray(mix.coefficient_table(cluster)[node_model - NO_MODEL])


def capacity_frag(
    mix: TaskMix, free: IntArray, cpu_free: IntArray, mem_free: IntArray | None, node_model: IntArray,
    cluster: Cluster,
) -> IntArray:
    """Capacity-aware fragmentation times the mix's total weight, per row of `free`."""
    cap = np.minimum(gpu_instances(mix, free), host_instances(mix, cpu_free, mem_free))
    coef = _coefficients(mix, node_model, cluster)
    return np.asarray(free.sum(axis=-1) * mix.total_weight - (cap * coef).sum(axis=-1))


def capacity_frag_share(
    mix: TaskMix, free: IntArray, cpu_free: IntArray, mem_free: IntArray | None, node_model: IntArray,
    request_cpu: int, request_memory: int, share: int, cluster: Cluster,
) -> tuple[IntArray, IntArray]:
    """Capacity-aware weighted fragmentation before [nodes] and after putting the share on each slot [nodes, slots]
    (slots with less than the share free give meaningless values; mask them)."""
    coef = _coefficients(mix, node_model, cluster)
    table = mix.shares_per_gpu
    per_gpu = table[free]  # [n, s, k]
    total = per_gpu.sum(axis=1)  # [n, k]
    host_before = host_instances(mix, cpu_free, mem_free)
    weighted_free = free.sum(axis=-1) * mix.total_weight
    before = weighted_free - (np.minimum(total // mix.gpu_num, host_before) * coef).sum(axis=-1)
    total_after = total[:, None, :] - per_gpu + table[np.maximum(free - share, 0)]  # [n, s, k]
    mem_after = mem_free - request_memory if mem_free is not None else None
    host_after = host_instances(mix, cpu_free - request_cpu, mem_after)  # [n, k]
    cap = np.minimum(total_after // mix.gpu_num, host_after[:, None, :])
    after = (weighted_free - share * mix.total_weight)[:, None] - np.einsum("nsk,nk->ns", cap, coef)
    return np.asarray(before), np.asarray(after)
