"""The capacity lib's simulated node types (``gpuorch_capacity.SIM_NODE_TYPES``, used by the simulated cloud and the
capacity benchmark) follow this simulated NVML's device profiles: model name, memory and MIG profiles."""

from __future__ import annotations

from gpuorch_capacity import SIM_NODE_TYPES
from gpuorch_node_agent.sim.profiles import device_profile


def test_simulated_node_types_match_the_simulated_nvml() -> None:
    for node_type in SIM_NODE_TYPES.values():
        profile = device_profile(node_type.sim_profile)
        assert (profile.model, profile.memory_mib) == (node_type.gpu_model, node_type.gpu_memory_mib)
        assert tuple(p.name for p in profile.mig if not p.media_extensions) == node_type.mig_profiles
