"""Builders for scheduler tests and simulations (like Nomad's scheduler/testing.go): nodes and job specs."""

from __future__ import annotations

from gpuorch_contracts import GpuInfo, MigInstance, NodeInventory, NodeRegistered


def registered_node(node_id: str, gpus: int = 2, model: str = "A100-80GB",
                    nvlink: list[tuple[int, int]] | None = None, mig: bool = False,
                    cpu_milli: int = 64000, memory_mib: int = 256000) -> NodeRegistered:
    """A NodeRegistered event for a node with ``gpus`` GPUs (each with seven 1g.10gb MIG instances if ``mig``)."""
    infos = []
    for i in range(gpus):
        migs = [MigInstance(uuid=f"MIG-{node_id}-{i}-{k}", profile="1g.10gb", memory_mib=9728, slices=1,
                            placement_start=k, placement_size=1) for k in range(7)] if mig else []
        infos.append(GpuInfo(uuid=f"GPU-{node_id}-{i}", index=i, model=model, memory_total_mib=81920,
                             mig_enabled=mig, mig_instances=migs))
    inv = NodeInventory(node_id=node_id, cpu_milli=cpu_milli, memory_mib=memory_mib, gpus=infos,
                        nvlink_pairs=nvlink or [])
    return NodeRegistered(inventory=inv, inventory_hash=f"h-{node_id}-{gpus}-{mig}")
