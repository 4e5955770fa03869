"""Array-backed state of the fleet that filters and scorers read.

`Cluster` keeps, per node, host CPU and memory (free/total) and, per GPU slot, GPU-milli free, GPU memory, model and
health, in numpy arrays so that a filter or scorer looks at every node in a few vector operations. Node order is
the order given; `name_rank` is the position in name order, used to break score ties (the lowest name wins, as in the
FGD simulator). `version[i]` grows each time node i changes, so a caller may cache per-node scores safely.

`place` never mutates a Cluster. `assign` / `release` mutate it: only the one applier that accepted a plan (the live
scheduler, or the replay loop) calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from gpuorch_policy.model import GPU_MILLI, GpuView, NodeView, Placement, Request

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

NO_MODEL = -1


class CapacityError(ValueError):
    """An assignment would take more than a node has: the plan must be refused."""


class Cluster:
    """Mutable numpy view of all nodes. See the module docstring for who may mutate it."""

    def __init__(self, nodes: Sequence[NodeView]) -> None:
        n = len(nodes)
        g = max((len(node.gpus) for node in nodes), default=0)
        g = max(g, 1)
        self.node_ids: list[str] = [node.node_id for node in nodes]
        self.index_of: dict[str, int] = {nid: i for i, nid in enumerate(self.node_ids)}
        if len(self.index_of) != n:
            raise ValueError("node ids must be unique")
        order = sorted(range(n), key=lambda i: self.node_ids[i])
        self.name_rank: IntArray = np.empty(n, dtype=np.int64)
        self.name_rank[order] = np.arange(n, dtype=np.int64)
        self.model_names: list[str] = []
        model_index: dict[str, int] = {}

        def model_id(name: str) -> int:
            if name not in model_index:
                model_index[name] = len(self.model_names)
                self.model_names.append(name)
            return model_index[name]

        self.cpu_total = np.array([node.cpu_milli_total for node in nodes], dtype=np.int64)
        self.mem_total = np.array([node.memory_mib_total for node in nodes], dtype=np.int64)
        self.cpu_free = np.array(
            [node.cpu_milli_total if node.cpu_milli_free is None else node.cpu_milli_free for node in nodes],
            dtype=np.int64,
        )
        self.mem_free = np.array(
            [node.memory_mib_total if node.memory_mib_free is None else node.memory_mib_free for node in nodes],
            dtype=np.int64,
        )
        self.schedulable = np.array([node.schedulable for node in nodes], dtype=np.bool_)
        self.gpu_count = np.array([len(node.gpus) for node in nodes], dtype=np.int64)
        self.gpu_present = np.zeros((n, g), dtype=np.bool_)
        self.gpu_healthy = np.zeros((n, g), dtype=np.bool_)
        self.gpu_free = np.zeros((n, g), dtype=np.int64)
        self.gpu_mem_free = np.zeros((n, g), dtype=np.int64)
        self.gpu_mem_total = np.zeros((n, g), dtype=np.int64)
        self.gpu_model = np.full((n, g), NO_MODEL, dtype=np.int64)
        self.gpu_uuid: list[list[str]] = []
        self.nvlink_pairs: list[tuple[tuple[int, int], ...]] = []
        for i, node in enumerate(nodes):
            self.gpu_uuid.append([gpu.uuid for gpu in node.gpus])
            self.nvlink_pairs.append(node.nvlink_pairs)
            for slot, gpu in enumerate(node.gpus):
                if gpu.index != slot:
                    raise ValueError(f"node {node.node_id}: GPU indexes must be 0..n-1 in order")
                self.gpu_present[i, slot] = True
                self.gpu_healthy[i, slot] = gpu.healthy
                self.gpu_free[i, slot] = gpu.milli_free
                self.gpu_mem_free[i, slot] = gpu.memory_mib_free
                self.gpu_mem_total[i, slot] = gpu.memory_mib_total
                self.gpu_model[i, slot] = model_id(gpu.model)
        # The node's model as FGD sees it (first GPU); NO_MODEL for CPU nodes.
        self.node_model = np.where(self.gpu_count > 0, self.gpu_model[:, 0], NO_MODEL).astype(np.int64)
        # GPU-milli a placement may use: free and on a healthy GPU.
        self.gpu_usable: IntArray = np.where(self.gpu_present & self.gpu_healthy, self.gpu_free, 0)
        # Counts of placed tasks per GPU-affinity tag (0: share, k: k whole GPUs); used by GpuClustering.
        self.affinity_counts = np.zeros((n, 10), dtype=np.int64)
        self.version = np.zeros(n, dtype=np.int64)
        # Per-node aggregates kept current by every change, so common filters need no per-GPU pass.
        self.max_usable = self.gpu_usable.max(axis=1)
        self.whole_usable = (self.gpu_usable >= GPU_MILLI).sum(axis=1)

    # ---- small derived facts -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.node_ids)

    @property
    def gpu_capacity_milli(self) -> int:
        return int(self.gpu_present.sum()) * GPU_MILLI

    def gpu_milli_allocated(self) -> int:
        return int((np.where(self.gpu_present, GPU_MILLI - self.gpu_free, 0)).sum())

    def model_id(self, name: str) -> int:
        try:
            return self.model_names.index(name)
        except ValueError:
            return NO_MODEL

    def accepted_models(self, request: Request) -> IntArray | None:
        """Model ids a request accepts, or None for any model."""
        if not request.gpu_models:
            return None
        return np.array([self.model_id(m) for m in request.gpu_models], dtype=np.int64)

    def eligible_gpus(self, request: Request, rows: IntArray | slice = slice(None)) -> BoolArray:
        """Per GPU slot of the given nodes: could this GPU serve one GPU of the request right now?"""
        usable = self.gpu_usable[rows]
        ok = usable >= request.gpu_milli
        accepted = self.accepted_models(request)
        if accepted is not None:
            ok &= np.isin(self.gpu_model[rows], accepted)
        if request.gpu_memory_mib > 0:
            ok &= self.gpu_mem_free[rows] >= request.gpu_memory_mib
        return ok

    # ---- views -----------------------------------------------------------------------------------------------
    def node_view(self, i: int) -> NodeView:
        gpus = tuple(
            GpuView(
                index=s,
                model=self.model_names[int(self.gpu_model[i, s])],
                uuid=self.gpu_uuid[i][s],
                milli_free=int(self.gpu_free[i, s]),
                memory_mib_free=int(self.gpu_mem_free[i, s]),
                memory_mib_total=int(self.gpu_mem_total[i, s]),
                healthy=bool(self.gpu_healthy[i, s]),
            )
            for s in range(int(self.gpu_count[i]))
        )
        return NodeView(
            node_id=self.node_ids[i],
            cpu_milli_total=int(self.cpu_total[i]),
            memory_mib_total=int(self.mem_total[i]),
            gpus=gpus,
            cpu_milli_free=int(self.cpu_free[i]),
            memory_mib_free=int(self.mem_free[i]),
            nvlink_pairs=self.nvlink_pairs[i],
            schedulable=bool(self.schedulable[i]),
        )

    def node_views(self) -> list[NodeView]:
        return [self.node_view(i) for i in range(self.size)]

    def copy(self) -> Cluster:
        clone = object.__new__(Cluster)
        for key, value in self.__dict__.items():
            setattr(clone, key, value.copy() if isinstance(value, np.ndarray) else value)
        return clone

    # ---- the applier's side ----------------------------------------------------------------------------------
    def assign(self, request: Request, placement: Placement) -> None:
        """Take the request's resources on the placement's node. Raises CapacityError (and changes nothing) if any
        CPU, memory, GPU-milli or GPU memory would go below zero, or a GPU is unhealthy or of a refused model."""
        i = self.index_of[placement.node_id]
        if self.cpu_free[i] < request.cpu_milli or self.mem_free[i] < request.memory_mib:
            raise CapacityError(f"{placement.node_id}: host CPU or memory exceeded")
        if len(placement.gpus) != request.num_gpu:
            raise CapacityError(f"{placement.node_id}: {len(placement.gpus)} GPUs given, {request.num_gpu} asked")
        seen = set()
        accepted = self.accepted_models(request)
        for slot, milli in placement.gpus:
            if slot in seen or not 0 <= slot < self.gpu_count[i]:
                raise CapacityError(f"{placement.node_id}: bad GPU index {slot}")
            seen.add(slot)
            if milli != request.gpu_milli or self.gpu_usable[i, slot] < milli:
                raise CapacityError(f"{placement.node_id}: GPU {slot} has {self.gpu_usable[i, slot]} milli free")
            if request.gpu_memory_mib and self.gpu_mem_free[i, slot] < request.gpu_memory_mib:
                raise CapacityError(f"{placement.node_id}: GPU {slot} memory exceeded")
            if accepted is not None and self.gpu_model[i, slot] not in accepted:
                raise CapacityError(f"{placement.node_id}: GPU {slot} model not accepted")
        self._apply(i, request, placement, +1)

    def release(self, request: Request, placement: Placement) -> None:
        """Give back what `assign` took for the same request and placement."""
        self._apply(self.index_of[placement.node_id], request, placement, -1)

    def _apply(self, i: int, request: Request, placement: Placement, sign: int) -> None:
        self.cpu_free[i] -= sign * request.cpu_milli
        self.mem_free[i] -= sign * request.memory_mib
        for slot, milli in placement.gpus:
            self.gpu_free[i, slot] -= sign * milli
            self.gpu_mem_free[i, slot] -= sign * request.gpu_memory_mib
            self.gpu_usable[i, slot] = self.gpu_free[i, slot] if self.gpu_healthy[i, slot] else 0
        if request.num_gpu > 0:
            tag = 0 if request.is_share else min(request.num_gpu, 9)
            self.affinity_counts[i, tag] += sign
        self._refresh(i)

    def _refresh(self, i: int) -> None:
        row = self.gpu_usable[i]
        self.max_usable[i] = row.max()
        self.whole_usable[i] = (row >= GPU_MILLI).sum()
        self.version[i] += 1

    def set_gpu_health(self, node_id: str, gpu_index: int, healthy: bool) -> None:
        i = self.index_of[node_id]
        self.gpu_healthy[i, gpu_index] = healthy
        self.gpu_usable[i, gpu_index] = self.gpu_free[i, gpu_index] if healthy else 0
        self._refresh(i)


def whole_gpu_nodes(rows: Sequence[tuple[str, int, int, int, str]]) -> list[NodeView]:
    """Build node views from (node_id, cpu_milli, memory_mib, gpu_count, model) rows, all GPUs empty and healthy."""
    return [
        NodeView(
            node_id=sn,
            cpu_milli_total=cpu,
            memory_mib_total=mem,
            gpus=tuple(GpuView(index=k, model=model, uuid=f"{sn}-gpu{k}") for k in range(count)),
        )
        for sn, cpu, mem, count, model in rows
    ]
