"""The placement index: the same decision as `place`, at a cost that does not grow with the fleet.

    request ──► its shape's heap of (score, name rank, node, node version)      one heap per distinct Request
                  │ catch up: nodes changed since this shape last looked        (cluster.changes, read from where
                  │   (usually the one node the previous placement took)         this heap stopped)
                  │   ──► filters + scorer for those rows only, or a memo hit:    memo key: (request, node class,
                  │       equal nodes in equal states have equal scores           node's dynamic state)
                  ▼
            top entry whose version is current and whose node is not excluded ──► Placement
            (stale entries are dropped as they surface; excluded ones put back)

Only node-local scorers can be indexed (a node's score depends on that node alone); for any other scorer
`PlacementIndex.place` falls back to `place`. Ties break as in `place`: highest score, then lowest node name. A heap
(re)builds in one vectorised pass over the fleet when it is first used, after nodes are added (`cluster.epoch`) or
when it has fallen far behind; then each decision costs O(changed nodes x log nodes).

Reads the cluster only; the caller applies a decision with `Cluster.assign` (which bumps the node's version).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable

import numpy as np

from gpuorch_policy.cluster import Cluster, IntArray
from gpuorch_policy.framework import Policy, choose_gpus, feasible_mask, place, unfit_reasons
from gpuorch_policy.model import Placement, Request, Unfit

GpuChooser = Callable[[Request, Cluster, int, int], tuple[tuple[int, int], ...]]
_Entry = tuple[int, int, int, int, int, Hashable]
"""(-score, name rank, row, version, scorer's GPU pick, memo key of the node's state or None)."""
"""(request, cluster, row, scorer's pick) -> the (slot, milli) pairs used on that node."""

_MEMO_LIMIT = 1_000_000
LEFT_OUT = "every node it fits on is left out"


class _ShapeHeap:
    __slots__ = ("entries", "epoch", "seen")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.epoch = -1
        self.seen = 0


class PlacementIndex:
    """`place` for one cluster and policy, answered from per-shape heaps kept current from the change log."""

    def __init__(self, cluster: Cluster, policy: Policy, chooser: GpuChooser = choose_gpus) -> None:
        self.cluster = cluster
        self.policy = policy
        self.chooser = chooser
        self.indexed = bool(getattr(policy.scorer, "node_local", False))
        self._heaps: dict[Hashable, _ShapeHeap] = {}
        self._memo: dict[Hashable, tuple[int, int] | None] = {}
        self._chosen: dict[Hashable, tuple[tuple[int, int], ...]] = {}
        self.stats = {"rebuilds": 0, "rescored": 0, "memo_hits": 0}

    def place(self, request: Request, exclude: Collection[int] = (), explain: bool = True) -> Placement | Unfit:
        """The best node for ``request`` leaving out the rows in ``exclude``, or why none fits."""
        cluster = self.cluster
        if not self.indexed or request.invalid_reason() is not None:
            return self._place_plain(request, exclude, explain)
        heap = self._current_heap(request)
        entries = self._caught_up(request, heap)
        version = cluster.version
        put_back: list[_Entry] = []
        found: _Entry | None = None
        while entries:
            top = entries[0]
            if top[3] != version[top[2]]:
                heapq.heappop(entries)  # stale: the node changed, its new entry is in the heap already
                continue
            if top[2] in exclude:
                put_back.append(heapq.heappop(entries))
                continue
            found = top
            break
        for entry in put_back:
            heapq.heappush(entries, entry)
        if found is None:
            if not explain:
                return Unfit(())
            return self._unfit(request, exclude)
        row, key = found[2], found[5]
        gpus = self._chosen.get(key) if key is not None else None
        if gpus is None:
            gpus = self.chooser(request, cluster, row, found[4])
            if key is not None:
                self._chosen[key] = gpus  # equal nodes in equal states get the same GPUs
        return Placement(node_id=cluster.node_ids[row], gpus=gpus, score=-found[0])

    def fitting_rows(self, request: Request) -> list[int]:
        """Every row the request fits on now (current entries of its heap)."""
        heap = self._current_heap(request)
        version = self.cluster.version
        return sorted({e[2] for e in self._caught_up(request, heap) if e[3] == version[e[2]]})

    # -- keeping heaps current --------------------------------------------------------------------------------

    def _current_heap(self, request: Request) -> _ShapeHeap:
        heap = self._heaps.get(request)
        if heap is None:
            heap = self._heaps[request] = _ShapeHeap()
        return heap

    def _caught_up(self, request: Request, heap: _ShapeHeap) -> list[_Entry]:
        cluster = self.cluster
        size = cluster.size
        if heap.epoch == cluster.epoch and heap.seen <= len(cluster.changes):
            pending = len(cluster.changes) - heap.seen
            if pending and pending <= size // 4 + 8:
                rows = np.fromiter(set(cluster.changes[heap.seen:]), dtype=np.int64)
                heap.seen = len(cluster.changes)
                for entry in self._entries(request, rows):
                    heapq.heappush(heap.entries, entry)
                if len(heap.entries) > 3 * size + 64:
                    version = cluster.version
                    heap.entries = [e for e in heap.entries if e[3] == version[e[2]]]
                    heapq.heapify(heap.entries)
                return heap.entries
            if not pending:
                return heap.entries
        heap.entries = self._entries(request, np.arange(size, dtype=np.int64))
        heapq.heapify(heap.entries)
        heap.epoch, heap.seen = cluster.epoch, len(cluster.changes)
        self.stats["rebuilds"] += 1
        return heap.entries

    def _entries(self, request: Request, rows: IntArray) -> list[_Entry]:
        """Heap entries for the feasible ones among ``rows``, from the memo where the same class and state of
        node was scored before."""
        cluster = self.cluster
        memo = self._memo
        classes = cluster.static_class
        keys = [(request, int(classes[r]), cluster.dynamic_key(int(r))) for r in rows] if len(rows) < 64 else None
        if keys is not None:
            missing = [k for k, key in enumerate(keys) if key not in memo]
            self.stats["memo_hits"] += len(rows) - len(missing)
        else:
            missing = list(range(len(rows)))
        if missing:
            todo = rows[missing] if len(missing) != len(rows) else rows
            scored = self._score(request, todo)
            if keys is not None:
                for k, value in zip(missing, scored, strict=True):
                    memo[keys[k]] = value
                if len(memo) > _MEMO_LIMIT:
                    memo.clear()
                    self._chosen.clear()
                values = [memo.get(key) for key in keys]
            else:
                values = scored
        else:
            values = [memo[key] for key in keys]  # type: ignore[union-attr]
        rank, version = cluster.name_rank, cluster.version
        keyed = keys if keys is not None else [None] * len(rows)
        return [(-v[0], int(rank[r]), int(r), int(version[r]), v[1], k)
                for r, v, k in zip(rows, values, keyed, strict=True) if v is not None]

    def _score(self, request: Request, rows: IntArray) -> list[tuple[int, int] | None]:
        """(score, scorer's GPU pick) per row, None where a filter rules the node out."""
        cluster = self.cluster
        self.stats["rescored"] += len(rows)
        ok = np.ones(len(rows), dtype=np.bool_)
        for flt in self.policy.filters:
            ok &= flt.mask(request, cluster, rows)
        result: list[tuple[int, int] | None] = [None] * len(rows)
        feasible = np.flatnonzero(ok)
        if len(feasible):
            scores, picks = self.policy.scorer.score(request, cluster, rows[feasible], None)
            for k, score, pick in zip(feasible.tolist(), scores.tolist(), picks.tolist(), strict=True):
                result[k] = (int(score), int(pick))
        return result

    # -- answers without the index -----------------------------------------------------------------------------

    def _unfit(self, request: Request, exclude: Collection[int]) -> Unfit:
        """Why nothing fits: the filters' words, or LEFT_OUT when it fits only on excluded nodes."""
        cluster = self.cluster
        if exclude and (self.fitting_rows(request) or set(np.flatnonzero(cluster.schedulable).tolist()) <= set(exclude)):
            return Unfit((f"{LEFT_OUT} (reserved, or taken by another rank)",))
        return Unfit(unfit_reasons(request, cluster, self.policy.filters))

    def _place_plain(self, request: Request, exclude: Collection[int], explain: bool) -> Placement | Unfit:
        cluster = self.cluster
        if not exclude:
            decision = place(request, cluster, self.policy)
        else:
            saved = cluster.schedulable
            cluster.schedulable = saved.copy()
            try:
                cluster.schedulable[list(exclude)] = False
                decision = place(request, cluster, self.policy)
            finally:
                cluster.schedulable = saved
        if isinstance(decision, Placement) and self.chooser is not choose_gpus:
            row = cluster.index_of[decision.node_id]
            return Placement(decision.node_id, self.chooser(request, cluster, row, -1), decision.score)
        return decision if explain or isinstance(decision, Placement) else Unfit(())


def feasible_rows(request: Request, cluster: Cluster, policy: Policy) -> IntArray:
    """Rows passing every filter (a full pass; for callers that need them all once)."""
    return np.flatnonzero(feasible_mask(request, cluster, policy.filters))
