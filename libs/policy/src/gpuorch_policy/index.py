"""The placement index: the same decision as `place`, at a cost that grows with what changed, not with the fleet.

    request ──► its shape's cache: score, GPU pick and feasibility per node, each with the node version it is for
                  │
                  ├─ shape asked again soon (few nodes changed since): its heap of (score, name rank, node,
                  │    version) catches up on the changed rows only (filters + scorer for those, or a memo hit:
                  │    equal nodes in equal states have equal scores)   ──► top current, not excluded entry
                  │    O(changed nodes x log nodes)
                  └─ shape asked after many changes (a trace with hundreds of shapes, a busy fleet): its cache
                       rescores the nodes whose version moved (one vectorised pass) and the best current node is
                       taken from the arrays; the heap is rebuilt from them only once the shape is asked often
                       O(stale nodes) vectorised + O(nodes) in numpy
                                                                    ──► Placement

Only node-local scorers can be indexed (a node's score depends on that node alone); for any other scorer
`PlacementIndex.place` falls back to `place` (with the index's ``rng``). Ties break as in `place`: highest score, then
lowest node name.

Reads the cluster only; the caller applies a decision with `Cluster.assign` (which bumps the node's version).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable
from itertools import repeat

import numpy as np

from gpuorch_policy.cluster import Cluster, IntArray
from gpuorch_policy.framework import Policy, choose_gpus, feasible_mask, place, unfit_reasons
from gpuorch_policy.model import Placement, Request, Unfit

GpuChooser = Callable[[Request, Cluster, int, int], tuple[tuple[int, int], ...]]
_Entry = tuple[int, int, int, int, int, Hashable]
"""(-score, name rank, row, version, scorer's GPU pick, memo key of the node's state or None)."""
"""(request, cluster, row, scorer's pick) -> the (slot, milli) pairs used on that node."""

_MEMO_LIMIT = 1_000_000
_UNSCORED: tuple[int, int] | None = (0, -1)
"""A memo miss (``_entry``; compared by identity)."""
HEAP_AFTER = 3
"""A shape's heap is built once it was asked this many times in a row with few nodes changed in between."""
LEFT_OUT = "every node it fits on is left out"


class _ShapeHeap:
    __slots__ = ("arrays_seen", "entries", "epoch", "feasible", "near", "picks", "scores", "seen", "valid", "version")

    def __init__(self, valid: bool = True) -> None:
        self.valid = valid
        """The request is well formed (``Request.invalid_reason``; judged once per shape)."""
        self.entries: list[_Entry] | None = None
        """The heap (None: not built, or dropped while the shape was answered from the arrays)."""
        self.epoch = -1
        self.seen = 0
        """Length of ``cluster.changes`` the heap has caught up with."""
        self.near = 0
        """Asks in a row that came after few changes (a heap is built once this reaches ``HEAP_AFTER``)."""
        self.arrays_seen = -1
        """Length of ``cluster.changes`` when the arrays were last brought up to date (-1: never, or another
        epoch)."""
        self.version = np.zeros(0, dtype=np.int64)
        """Per node, the node version ``scores``/``picks``/``feasible`` are for (-1: never scored)."""
        self.scores = np.zeros(0, dtype=np.int64)
        self.picks = np.zeros(0, dtype=np.int64)
        self.feasible = np.zeros(0, dtype=np.bool_)


class PlacementIndex:
    """`place` for one cluster and policy, answered from per-shape heaps kept current from the change log."""

    def __init__(self, cluster: Cluster, policy: Policy, chooser: GpuChooser = choose_gpus,
                 rng: np.random.Generator | None = None) -> None:
        """``rng`` drives randomised (not node-local) scorers, which are not indexed."""
        self.cluster = cluster
        self.policy = policy
        self.chooser = chooser
        self.rng = rng
        self.indexed = bool(getattr(policy.scorer, "node_local", False))
        self._heaps: dict[Hashable, _ShapeHeap] = {}
        self._memo: dict[Hashable, tuple[int, int] | None] = {}
        self._chosen: dict[Hashable, tuple[tuple[int, int], ...]] = {}
        self.stats = {"rebuilds": 0, "rescored": 0, "memo_hits": 0}

    def place(self, request: Request, exclude: Collection[int] = (), explain: bool = True) -> Placement | Unfit:
        """The best node for ``request`` leaving out the rows in ``exclude``, or why none fits."""
        cluster = self.cluster
        heap = self._current_heap(request)
        if not self.indexed or not heap.valid:
            return self._place_plain(request, exclude, explain)
        entries = self._caught_up(request, heap)
        if entries is None:
            return self._place_from_arrays(request, heap, exclude, explain)
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
        if key is None:  # an entry built from the arrays: its node's state is current (its version matched)
            key = (request, int(cluster.static_class[row]), cluster.dynamic_key(row))
        gpus = self._chosen.get(key)
        if gpus is None:
            gpus = self.chooser(request, cluster, row, found[4])
            if len(self._chosen) > _MEMO_LIMIT:
                self._chosen.clear()
            self._chosen[key] = gpus  # equal nodes in equal states get the same GPUs
        return Placement(node_id=cluster.node_ids[row], gpus=gpus, score=-found[0])

    def fitting_rows(self, request: Request) -> list[int]:
        """Every row the request fits on now."""
        heap = self._current_heap(request)
        self._refresh_arrays(request, heap)
        return np.flatnonzero(heap.feasible).tolist()

    # -- keeping heaps current --------------------------------------------------------------------------------

    def _current_heap(self, request: Request) -> _ShapeHeap:
        heap = self._heaps.get(request)
        if heap is None:
            heap = self._heaps[request] = _ShapeHeap(request.invalid_reason() is None)
        return heap

    def _caught_up(self, request: Request, heap: _ShapeHeap) -> list[_Entry] | None:
        """The shape's heap brought up to date, or None when the shape is better answered from its arrays (the
        heap is not built, or has fallen far behind: catching it up would cost more than a vectorised pass)."""
        cluster = self.cluster
        size = cluster.size
        limit = size // 4 + 8
        same_epoch = heap.epoch == cluster.epoch
        if heap.entries is not None and same_epoch and 0 <= len(cluster.changes) - heap.seen <= limit:
            behind = len(cluster.changes) - heap.seen
            if behind:
                if behind == 1:  # one changed row (the last placement's) is the usual case of a busy cycle
                    one = self._entry(request, cluster.changes[heap.seen])
                    if one is not None:
                        heapq.heappush(heap.entries, one)
                else:
                    for entry in self._entries(request, list(set(cluster.changes[heap.seen:]))):
                        heapq.heappush(heap.entries, entry)
                heap.seen = len(cluster.changes)
                if len(heap.entries) > 3 * size + 64:
                    version = cluster.version
                    heap.entries = [e for e in heap.entries if e[3] == version[e[2]]]
                    heapq.heapify(heap.entries)
            return heap.entries
        near = same_epoch and 0 <= len(cluster.changes) - heap.arrays_seen <= limit
        heap.near = heap.near + 1 if near else 0
        if heap.entries is None and near and heap.near >= HEAP_AFTER:
            # asked again and again after few changes: worth a heap (built from the arrays, rescoring only what
            # moved); a shape asked now and then is cheaper answered from its arrays each time
            self._refresh_arrays(request, heap)
            rows = np.flatnonzero(heap.feasible)
            # the entries (-score, name rank, row, version, pick, None) of every feasible row, column by column
            heap.entries = list(zip((-heap.scores[rows]).tolist(), cluster.name_rank[rows].tolist(), rows.tolist(),
                                    cluster.version[rows].tolist(), heap.picks[rows].tolist(),
                                    repeat(None, len(rows)), strict=True))
            heapq.heapify(heap.entries)
            heap.seen = len(cluster.changes)
            self.stats["rebuilds"] += 1
            return heap.entries
        heap.entries = None  # answered from the arrays this time
        return None

    def _refresh_arrays(self, request: Request, heap: _ShapeHeap) -> None:
        """Rescore (one vectorised pass) the nodes whose version moved since the shape's arrays last saw them."""
        cluster = self.cluster
        size = cluster.size
        if len(heap.version) != size:
            grown = np.full(size, -1, dtype=np.int64)
            keep = min(size, len(heap.version))
            grown[:keep] = heap.version[:keep]
            heap.version = grown
            heap.scores = np.resize(heap.scores, size)
            heap.picks = np.resize(heap.picks, size)
            heap.feasible = np.resize(heap.feasible, size)
        stale = np.flatnonzero(heap.version != cluster.version)
        if len(stale):
            self.stats["rescored"] += len(stale)
            ok = np.ones(len(stale), dtype=np.bool_)
            for flt in self.policy.filters:
                ok &= flt.mask(request, cluster, stale)
            heap.feasible[stale] = ok
            feasible = stale[ok]
            if len(feasible):
                scores, picks = self.policy.scorer.score(request, cluster, feasible, None)
                heap.scores[feasible] = scores
                heap.picks[feasible] = picks
            heap.version[stale] = cluster.version[stale]
        if heap.epoch != cluster.epoch:
            heap.epoch, heap.entries = cluster.epoch, None  # rows were added, or the change log restarted
        heap.arrays_seen = len(cluster.changes)

    def _place_from_arrays(self, request: Request, heap: _ShapeHeap, exclude: Collection[int],
                           explain: bool) -> Placement | Unfit:
        """The decision from the shape's arrays: the best feasible, not excluded node (ties: lowest name)."""
        cluster = self.cluster
        self._refresh_arrays(request, heap)
        rows = np.flatnonzero(heap.feasible)
        if exclude and len(rows):
            rows = rows[~np.isin(rows, np.fromiter(exclude, dtype=np.int64))]
        if len(rows) == 0:
            return Unfit(()) if not explain else self._unfit(request, exclude)
        n = cluster.size
        combined = heap.scores[rows] * (n + 1) + (n - cluster.name_rank[rows])
        row = int(rows[int(np.argmax(combined))])
        gpus = self.chooser(request, cluster, row, int(heap.picks[row]))
        return Placement(node_id=cluster.node_ids[row], gpus=gpus, score=int(heap.scores[row]))

    def _entries(self, request: Request, rows: list[int]) -> list[_Entry]:
        """Heap entries for the feasible ones among ``rows``, from the memo where the same class and state of
        node was scored before."""
        cluster = self.cluster
        memo = self._memo
        classes = cluster.static_class
        keys = [(request, int(classes[r]), cluster.dynamic_key(r)) for r in rows] if len(rows) < 64 else None
        if keys is not None:
            missing = [k for k, key in enumerate(keys) if key not in memo]
            self.stats["memo_hits"] += len(rows) - len(missing)
        else:
            missing = list(range(len(rows)))
        if missing:
            todo = np.array([rows[k] for k in missing] if len(missing) != len(rows) else rows, dtype=np.int64)
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
        return [(-v[0], int(rank[r]), r, int(version[r]), v[1], k)
                for r, v, k in zip(rows, values, keyed, strict=True) if v is not None]

    def _entry(self, request: Request, row: int) -> _Entry | None:
        """``_entries(request, [row])``, without the lists (the catch-up of a busy cycle's every placement)."""
        cluster = self.cluster
        memo = self._memo
        key = (request, int(cluster.static_class[row]), cluster.dynamic_key(row))
        value = memo.get(key, _UNSCORED)  # type: ignore[arg-type]
        if value is _UNSCORED:
            memo[key] = value = self._score(request, np.array([row], dtype=np.int64))[0]
            if len(memo) > _MEMO_LIMIT:
                memo.clear()
                self._chosen.clear()
                value = None  # as ``_entries`` reads it back from the cleared memo
        else:
            self.stats["memo_hits"] += 1
        if value is None:
            return None
        return (-value[0], int(cluster.name_rank[row]), row, int(cluster.version[row]), value[1], key)

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
            decision = place(request, cluster, self.policy, self.rng)
        else:
            saved = cluster.schedulable
            cluster.schedulable = saved.copy()
            try:
                cluster.schedulable[list(exclude)] = False
                decision = place(request, cluster, self.policy, self.rng)
            finally:
                cluster.schedulable = saved
        if isinstance(decision, Placement) and self.chooser is not choose_gpus:
            row = cluster.index_of[decision.node_id]
            return Placement(decision.node_id, self.chooser(request, cluster, row, -1), decision.score)
        return decision if explain or isinstance(decision, Placement) else Unfit(())


def feasible_rows(request: Request, cluster: Cluster, policy: Policy) -> IntArray:
    """Rows passing every filter (a full pass; for callers that need them all once)."""
    return np.flatnonzero(feasible_mask(request, cluster, policy.filters))
