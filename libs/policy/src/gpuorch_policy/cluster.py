"""Array-backed state of the fleet that filters and scorers read.

`Cluster` keeps, per node, host CPU and memory (free/total) and, per GPU slot, GPU-milli free, GPU memory, model and
health, in numpy arrays so that a filter or scorer looks at every node in a few vector operations. Node order is
the order given; `name_rank` is the position in name order, used to break score ties (the lowest name wins, as in the
FGD simulator). `version[i]` grows each time node i changes, so a caller may cache per-node scores safely.

`place` never mutates a Cluster. `assign` / `release` mutate it: only the one applier that accepted a plan (the live
scheduler's fleet, or the replay loop) calls them.

Change tracking, for indexes that must not rescan the fleet: every change of a node appends its row to `changes`
(a log an index reads from where it stopped), `freed` counts changes that may have added room (a release, a GPU
turning healthy, a node turning schedulable or added), and `epoch` grows when rows were added or the log was
truncated (an index then rebuilds once). `static_class[i]` numbers the node's fixed shape (GPU count, models, memory,
host totals, NVLink pairs) so equal nodes in equal states share scores; `dynamic_key(i)` is its changing state.
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
        self.linked = np.array([bool(node.nvlink_pairs) for node in nodes], dtype=np.bool_)
        """Nodes with NVLink pairs (the NVLink plugin looks at these only)."""
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
        self.changes: list[int] = []
        self.epoch = 0
        self.freed = 0
        self._classes: dict[tuple[object, ...], int] = {}
        self.static_class = np.array([self._class_of(i) for i in range(n)], dtype=np.int64)

    def _class_of(self, i: int) -> int:
        key = (int(self.gpu_count[i]), self.gpu_model[i].tobytes(), self.gpu_mem_total[i].tobytes(),
               self.gpu_present[i].tobytes(), int(self.cpu_total[i]), int(self.mem_total[i]),
               self.nvlink_pairs[i], int(self.node_model[i]))
        return self._classes.setdefault(key, len(self._classes))

    def dynamic_key(self, i: int) -> tuple[object, ...]:
        """Everything about node ``i`` that changes (free amounts, health, schedulable, placed task counts)."""
        return (bool(self.schedulable[i]), int(self.cpu_free[i]), int(self.mem_free[i]), self.gpu_usable[i].tobytes(),
                self.gpu_mem_free[i].tobytes(), self.affinity_counts[i].tobytes())

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
        """An independent copy (for simulations); its change log starts empty."""
        clone = object.__new__(Cluster)
        for key, value in self.__dict__.items():
            setattr(clone, key, value.copy() if isinstance(value, np.ndarray) else value)
        clone.changes = []
        clone.epoch = self.epoch + 1
        return clone

    # ---- growing the fleet -------------------------------------------------------------------------------------
    _PER_NODE = ("cpu_total", "mem_total", "cpu_free", "mem_free", "schedulable", "linked", "gpu_count", "node_model",
                 "version", "max_usable", "whole_usable")
    _PER_GPU = ("gpu_present", "gpu_healthy", "gpu_free", "gpu_mem_free", "gpu_mem_total", "gpu_model",
                "gpu_usable")

    def extend(self, nodes: Sequence[NodeView]) -> None:
        """Add nodes (ids not present yet). O(nodes) once per call: callers add many at a time. Bumps ``epoch``
        (name ranks move) and counts as freed room."""
        if not nodes:
            return
        other = Cluster(nodes)
        if set(other.node_ids) & set(self.index_of):
            raise ValueError("extend adds new nodes only; use set_node to change one")
        other._remap_models(self)
        width = max(self.gpu_present.shape[1], other.gpu_present.shape[1])
        self._widen(width)
        other._widen(width)
        for name in self._PER_NODE + self._PER_GPU + ("affinity_counts",):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        base = len(self.node_ids)
        self.node_ids += other.node_ids
        self.gpu_uuid += other.gpu_uuid
        self.nvlink_pairs += other.nvlink_pairs
        self.index_of.update({nid: base + k for k, nid in enumerate(other.node_ids)})
        n = len(self.node_ids)
        order = sorted(range(n), key=lambda i: self.node_ids[i])
        self.name_rank = np.empty(n, dtype=np.int64)
        self.name_rank[order] = np.arange(n, dtype=np.int64)
        self.static_class = np.concatenate([self.static_class, np.zeros(len(other.node_ids), dtype=np.int64)])
        for i in range(base, n):
            self.static_class[i] = self._class_of(i)
        self.changes = []
        self.epoch += 1
        self.freed += 1

    def set_node(self, node: NodeView) -> None:
        """Replace one node's inventory and free amounts (its shape changed, e.g. a new MIG layout)."""
        i = self.index_of[node.node_id]
        other = Cluster([node])
        other._remap_models(self)
        width = max(self.gpu_present.shape[1], other.gpu_present.shape[1])
        self._widen(width)
        other._widen(width)
        for name in self._PER_NODE + self._PER_GPU + ("affinity_counts",):
            if name != "version":
                getattr(self, name)[i] = getattr(other, name)[0]
        self.gpu_uuid[i] = other.gpu_uuid[0]
        self.nvlink_pairs[i] = other.nvlink_pairs[0]
        self.static_class[i] = self._class_of(i)
        self._refresh(i, freed=True)

    def set_schedulable(self, node_id: str, schedulable: bool) -> None:
        i = self.index_of[node_id]
        if bool(self.schedulable[i]) != schedulable:
            self.schedulable[i] = schedulable
            self._refresh(i, freed=schedulable)

    def _remap_models(self, target: Cluster) -> None:
        """Renumber this cluster's GPU model ids into ``target``'s model list (adding new names there)."""
        mapping = np.array([target._model_index(name) for name in self.model_names] + [NO_MODEL], dtype=np.int64)
        self.gpu_model = mapping[self.gpu_model]  # NO_MODEL (-1) maps to the appended NO_MODEL
        self.node_model = mapping[self.node_model]
        self.model_names = list(target.model_names)

    def _model_index(self, name: str) -> int:
        if name not in self.model_names:
            self.model_names.append(name)
        return self.model_names.index(name)

    def _widen(self, width: int) -> None:
        extra = width - self.gpu_present.shape[1]
        if extra <= 0:
            return
        for name in self._PER_GPU:
            array = getattr(self, name)
            fill = NO_MODEL if name == "gpu_model" else 0
            pad = np.full((array.shape[0], extra), fill, dtype=array.dtype)
            setattr(self, name, np.concatenate([array, pad], axis=1))

    # ---- the applier's side ----------------------------------------------------------------------------------
    def assign(self, request: Request, placement: Placement) -> None:
        """Take the request's resources on the placement's node. Raises CapacityError (and changes nothing) if any
        CPU, memory, GPU-milli or GPU memory would go below zero, or a GPU is unhealthy or of a refused model."""
        i = self.index_of[placement.node_id]
        self._check(i, request, placement)
        self._apply(i, request, placement, +1)

    def _check(self, i: int, request: Request, placement: Placement) -> None:
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

    def release(self, request: Request, placement: Placement) -> None:
        """Give back what `assign` took for the same request and placement."""
        self._apply(self.index_of[placement.node_id], request, placement, -1)

    def check(self, request: Request, placement: Placement) -> str | None:
        """Why ``assign`` would refuse this placement (None: it fits). Changes nothing."""
        try:
            self._check(self.index_of[placement.node_id], request, placement)
        except (CapacityError, KeyError) as exc:
            return str(exc)
        return None

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
        self._refresh(i, freed=sign < 0)

    def _refresh(self, i: int, freed: bool = False) -> None:
        row = self.gpu_usable[i].tolist()  # a handful of slots: plain Python beats numpy's per-call cost here
        self.max_usable[i] = max(row)
        self.whole_usable[i] = len([milli for milli in row if milli >= GPU_MILLI])
        self.version[i] += 1
        self.changes.append(i)
        if freed:
            self.freed += 1
        if len(self.changes) > 8 * len(self.node_ids) + 10_000:
            self.changes = []  # indexes that had not caught up rebuild once
            self.epoch += 1

    def take(self, node_id: str, cpu_milli: int, memory_mib: int, gpus: Sequence[tuple[int, int, int]],
             sign: int = +1) -> None:
        """Hold (``sign`` +1) or give back (-1) CPU, memory and, per GPU slot, (slot, milli, memory MiB) on a node.
        Unchecked: the caller checked it with ``shortfall`` (a plan applier) or is replaying what was checked."""
        i = self.index_of[node_id]
        self.cpu_free[i] -= sign * cpu_milli
        self.mem_free[i] -= sign * memory_mib
        count = 0
        slots = int(self.gpu_count[i])
        for slot, milli, memory in gpus:
            if not 0 <= slot < slots:
                continue
            count += 1
            free = int(self.gpu_free[i, slot]) - sign * milli
            self.gpu_free[i, slot] = free
            self.gpu_mem_free[i, slot] -= sign * memory
            self.gpu_usable[i, slot] = free if self.gpu_healthy[i, slot] else 0
        if count:
            share = count == 1 and gpus[0][1] < GPU_MILLI
            self.affinity_counts[i, 0 if share else min(count, 9)] += sign
        self._refresh(i, freed=sign < 0)

    def shortfall(self, node_id: str, cpu_milli: int, memory_mib: int,
                  gpus: Sequence[tuple[int, int, int]]) -> str | None:
        """Why ``take`` of this holding would over-allocate the node (None: it fits). Changes nothing."""
        i = self.index_of.get(node_id)
        if i is None:
            return f"{node_id}: unknown node"
        if self.cpu_free[i] < cpu_milli or self.mem_free[i] < memory_mib:
            return f"{node_id}: host CPU or memory exceeded ({int(self.cpu_free[i])} mCPU, {int(self.mem_free[i])} " \
                   f"MiB free; {cpu_milli} mCPU, {memory_mib} MiB asked)"
        slots = [slot for slot, _, _ in gpus]
        if len(set(slots)) != len(slots):
            return f"{node_id}: a GPU given twice"
        for slot, milli, _memory in gpus:
            if not 0 <= slot < self.gpu_count[i]:
                return f"{node_id}: no GPU {slot}"
            if self.gpu_usable[i, slot] < milli:
                return f"{node_id}: GPU {slot} has {int(self.gpu_usable[i, slot])} milli usable, {milli} asked"
        return None

    def set_gpu_health(self, node_id: str, gpu_index: int, healthy: bool) -> None:
        i = self.index_of[node_id]
        self.gpu_healthy[i, gpu_index] = healthy
        self.gpu_usable[i, gpu_index] = self.gpu_free[i, gpu_index] if healthy else 0
        self._refresh(i, freed=healthy)


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
