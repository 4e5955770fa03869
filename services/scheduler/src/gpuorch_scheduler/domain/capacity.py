"""A mutable free-capacity view built from the state, used within one scheduling cycle.

``CapacityView.from_state`` computes what is free on every schedulable node; ``find`` tries to fit one job spec
and returns either the assignments or a plain-words reason; ``take`` reserves what ``find`` returned so the next job
in the same cycle sees it gone. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuorch_contracts import GpuAllocation, JobSpec, NodeAssignment

from gpuorch_scheduler.domain.state import SchedulerState


@dataclass
class FreeGpu:
    uuid: str
    index: int
    model: str
    memory_total_mib: int
    milli_free: int
    memory_free_mib: int
    healthy: bool
    mig_profile: str | None = None
    """Set for a MIG instance (allocatable only whole, by profile)."""


@dataclass
class FreeNode:
    node_id: str
    cpu_free: int
    memory_free: int
    gpus: list[FreeGpu] = field(default_factory=list)
    nvlink: frozenset[tuple[int, int]] = frozenset()
    schedulable: bool = True
    why_not: str = ""


@dataclass
class CapacityView:
    nodes: dict[str, FreeNode]

    @classmethod
    def from_state(cls, state: SchedulerState, *, empty: bool = False) -> CapacityView:
        """Free capacity now; with ``empty``, the whole fleet as if idle and alive (to test 'can never fit')."""
        gpu_used = {} if empty else state.gpu_usage()
        host_used = {} if empty else state.host_usage()
        nodes: dict[str, FreeNode] = {}
        for node_id, record in sorted(state.nodes.items()):
            inv = record.inventory
            cpu_used, mem_used = host_used.get(node_id, (0, 0))
            free = FreeNode(
                node_id=node_id, cpu_free=inv.cpu_milli - cpu_used, memory_free=inv.memory_mib - mem_used,
                nvlink=frozenset(tuple(sorted(p)) for p in inv.nvlink_pairs),  # type: ignore[misc]
                schedulable=empty or record.schedulable,
                why_not="" if empty or record.schedulable else f"node {record.liveness}",
            )
            for gpu in inv.gpus:
                healthy = empty or record.gpu_health.get(gpu.index, gpu.health) in ("healthy", "degraded")
                if gpu.mig_enabled:
                    for mig in gpu.mig_instances:
                        used, _ = gpu_used.get((node_id, mig.uuid), (0, 0))
                        free.gpus.append(FreeGpu(
                            uuid=mig.uuid, index=gpu.index, model=gpu.model, memory_total_mib=mig.memory_mib,
                            milli_free=1000 - used, memory_free_mib=mig.memory_mib if used == 0 else 0,
                            healthy=healthy, mig_profile=mig.profile,
                        ))
                    continue
                used_milli, used_mem = gpu_used.get((node_id, gpu.uuid), (0, 0))
                free.gpus.append(FreeGpu(
                    uuid=gpu.uuid, index=gpu.index, model=gpu.model, memory_total_mib=gpu.memory_total_mib,
                    milli_free=1000 - used_milli, memory_free_mib=gpu.memory_total_mib - used_mem, healthy=healthy,
                ))
            nodes[node_id] = free
        return cls(nodes)

    # -- fitting ----------------------------------------------------------------------------------------------

    def find(self, spec: JobSpec) -> list[NodeAssignment] | str:
        """Assignments for ``spec`` (one per gang node), or the reason it does not fit now.

        First fit in node-name order; the placement policy (gpuorch_policy) scores candidates when present.
        """
        per_node: list[NodeAssignment] = []
        reasons: dict[str, int] = {}
        taken: set[str] = set()
        for node in self.nodes.values():
            if len(per_node) == spec.gang.nodes:
                break
            if node.node_id in taken:
                continue
            fit = self._fit_node(spec, node)
            if isinstance(fit, str):
                reasons[fit] = reasons.get(fit, 0) + 1
                continue
            per_node.append(NodeAssignment(node_id=node.node_id, gpus=fit))
            taken.add(node.node_id)
        if len(per_node) == spec.gang.nodes:
            return per_node
        return _summarise(spec, reasons, len(per_node))

    def _fit_node(self, spec: JobSpec, node: FreeNode) -> list[GpuAllocation] | str:
        if not node.schedulable:
            return node.why_not
        if node.cpu_free < spec.cpu_milli:
            return "not enough host CPU"
        if node.memory_free < spec.memory_mib:
            return "not enough host memory"
        request = spec.resources
        usable = [g for g in node.gpus if g.healthy and (not request.gpu_models or g.model in request.gpu_models)]
        match request.kind:
            case "none":
                return []
            case "whole":
                free = [g for g in usable if g.mig_profile is None and g.milli_free == 1000]
                if len(free) < request.gpus:
                    return f"needs {request.gpus} free GPUs on one node; largest free: {len(free)}"
                chosen = _prefer_nvlink(free, request.gpus, node.nvlink)
                return [GpuAllocation(gpu_uuid=g.uuid, gpu_index=g.index, memory_mib=g.memory_total_mib)
                        for g in chosen]
            case "share":
                want_milli = request.gpu_milli or 0
                want_mem = request.gpu_memory_mib or 0
                candidates = [g for g in usable if g.mig_profile is None and g.milli_free >= max(want_milli, 1)
                              and g.memory_free_mib >= want_mem]
                if not candidates:
                    return "no GPU has the share free"
                # pack: the fullest GPU that still fits, so whole GPUs stay whole
                best = min(candidates, key=lambda g: (g.milli_free, g.memory_free_mib, g.index))
                milli = want_milli or max(1, round(1000 * want_mem / max(best.memory_total_mib, 1)))
                return [GpuAllocation(gpu_uuid=best.uuid, gpu_index=best.index, milli=min(milli, 1000),
                                      memory_mib=want_mem or None)]
            case "mig":
                for profile in request.mig_profiles:
                    for g in usable:
                        if g.mig_profile == profile and g.milli_free == 1000:
                            return [GpuAllocation(gpu_uuid=g.uuid, gpu_index=g.index, memory_mib=g.memory_total_mib,
                                                  mig_profile=profile)]
                return f"no free MIG instance of {', '.join(request.mig_profiles)}"
        return "unknown GPU request"

    def take(self, spec: JobSpec, assignments: list[NodeAssignment]) -> None:
        """Reserve ``assignments`` (as returned by ``find``) in this view."""
        for assignment in assignments:
            node = self.nodes[assignment.node_id]
            node.cpu_free -= spec.cpu_milli
            node.memory_free -= spec.memory_mib
            by_uuid = {g.uuid: g for g in node.gpus}
            for alloc in assignment.gpus:
                gpu = by_uuid[alloc.gpu_uuid]
                gpu.milli_free -= alloc.milli
                gpu.memory_free_mib -= alloc.memory_mib or 0

    def could_ever_fit(self, spec: JobSpec) -> str | None:
        """None if ``spec`` fits this view (use on an ``empty`` view); else why it can never fit."""
        if not self.nodes:
            return None
        fit = self.find(spec)
        return None if not isinstance(fit, str) else f"can never fit on this fleet: {fit}"


def _prefer_nvlink(free: list[FreeGpu], count: int, nvlink: frozenset[tuple[int, int]]) -> list[FreeGpu]:
    """Pick ``count`` GPUs, preferring a set whose members are NVLink-connected to each other."""
    if count <= 1 or not nvlink:
        return free[:count]
    best: list[FreeGpu] = free[:count]
    best_links = -1
    for start in free:
        group = [start]
        for g in free:
            if g is start or len(group) == count:
                continue
            if all(tuple(sorted((g.index, m.index))) in nvlink for m in group):
                group.append(g)
        if len(group) < count:
            group += [g for g in free if g not in group][: count - len(group)]
        links = sum(1 for a in group for b in group if a.index < b.index and (a.index, b.index) in nvlink)
        if links > best_links:
            best, best_links = group, links
    return best


def _summarise(spec: JobSpec, reasons: dict[str, int], found: int) -> str:
    if not reasons:
        return "no nodes registered yet" if found == 0 else f"needs {spec.gang.nodes} nodes; only {found} fit"
    common = sorted(reasons.items(), key=lambda kv: -kv[1])
    text = "; ".join(f"{reason} ({count} node{'s' if count > 1 else ''})" for reason, count in common[:3])
    if spec.gang.nodes > 1:
        return f"gang needs {spec.gang.nodes} nodes, {found} fit now: {text}"
    return text
