"""Device profiles of the simulated NVML: what each GPU model reports, with NVIDIA's MIG tables.

NVIDIA's MIG tables (profiles, placements, instance counts, memory) live in ``gpuorch_policy.mig_profiles``, the one
copy that the MIG planner reads too; this module re-exports them.

Models of the openb trace (G2, G3 are anonymised in the trace; their memory is an assumption) are included so a
fleet can be built from ``openb_node_list_gpu_node.csv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuorch_policy.mig_profiles import (  # noqa: F401 (re-exported for the simulated NVML)
    MIG_A100_40GB,
    MIG_A100_80GB,
    MIG_COMPUTE_SLICES,
    MIG_H100_80GB,
    MIG_MEMORY_SLICES,
    MigProfileSpec,
)


@dataclass(frozen=True)
class DeviceProfile:
    """What one simulated GPU model reports through NVML."""

    key: str
    model: str
    nvml_name: str
    memory_mib: int
    compute_capability: tuple[int, int]
    power_idle_w: float
    power_max_w: float
    sm_clock_idle_mhz: int
    sm_clock_max_mhz: int
    nvlink: str = "none"
    """``all`` (NVSwitch: every pair linked), ``cube_mesh`` (V100 hybrid cube mesh), ``pairs`` or ``none``."""
    mig: tuple[MigProfileSpec, ...] = ()
    ecc: bool = True


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    p.key: p
    for p in (
        DeviceProfile("h100", "H100-80GB", "NVIDIA H100 80GB HBM3", 81559, (9, 0), 70, 700, 345, 1980,
                      nvlink="all", mig=MIG_H100_80GB),
        DeviceProfile("a100", "A100-40GB", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), 55, 400, 210, 1410,
                      nvlink="all", mig=MIG_A100_40GB),
        DeviceProfile("a100-80", "A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 60, 400, 210, 1410,
                      nvlink="all", mig=MIG_A100_80GB),
        DeviceProfile("l4", "L4", "NVIDIA L4", 23034, (8, 9), 16, 72, 210, 2040),
        DeviceProfile("t4", "T4", "Tesla T4", 15360, (7, 5), 10, 70, 300, 1590),
        DeviceProfile("v100", "V100-32GB", "Tesla V100-SXM2-32GB", 32768, (7, 0), 40, 300, 135, 1530,
                      nvlink="cube_mesh"),
        # GPU models named in the openb trace (Alibaba); G2/G3 are anonymised there.
        DeviceProfile("p100", "P100", "Tesla P100-PCIE-16GB", 16280, (6, 0), 25, 250, 544, 1328),
        DeviceProfile("v100m16", "V100M16", "Tesla V100-SXM2-16GB", 16384, (7, 0), 40, 300, 135, 1530,
                      nvlink="cube_mesh"),
        DeviceProfile("v100m32", "V100M32", "Tesla V100-SXM2-32GB", 32768, (7, 0), 40, 300, 135, 1530,
                      nvlink="cube_mesh"),
        DeviceProfile("a10", "A10", "NVIDIA A10", 23028, (8, 6), 20, 150, 210, 1695),
        DeviceProfile("g2", "G2", "Simulated openb G2", 16384, (7, 5), 15, 150, 300, 1590),
        DeviceProfile("g3", "G3", "Simulated openb G3", 32768, (8, 6), 20, 250, 210, 1695),
    )
}

OPENB_MODEL_PROFILES = {"G2": "g2", "G3": "g3", "P100": "p100", "T4": "t4", "V100M16": "v100m16",
                        "V100M32": "v100m32", "A10": "a10"}
"""openb ``model`` column -> device profile key."""


def device_profile(key: str) -> DeviceProfile:
    try:
        return DEVICE_PROFILES[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU profile {key!r}; known: {', '.join(sorted(DEVICE_PROFILES))}") from None


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node: its id, GPUs and host size."""

    node_id: str
    gpu_profile: DeviceProfile
    gpu_count: int
    cpu_milli: int = 64000
    memory_mib: int = 512 * 1024
    labels: dict[str, str] = field(default_factory=dict)
    """Inventory labels, e.g. its topology blocks (``topology.gpuorch.io/rack: rack-0``)."""


TOPOLOGY_LEVELS = ("block", "rack", "nvlink-domain")
"""Topology levels a fleet description may give (``@rack=4``; CSV columns of these names)."""


def parse_node_profile(text: str) -> tuple[DeviceProfile, int]:
    """``h100x8`` -> (H100 profile, 8). The GPU count defaults to 8."""
    key, sep, count = text.strip().lower().rpartition("x")
    if not sep or not count.isdigit() or not key:
        return device_profile(text.strip()), 8
    return device_profile(key), int(count)


def parse_profile_mix(mix: str, *, prefix: str = "sim-node") -> list[NodeSpec]:
    """``h100x8:2,a100x8:1,l4x4:2`` -> 5 node specs with ids ``<prefix>-00000`` ...; ``h100x8`` alone = 1 node.
    A part may end with topology blocks: ``h100x8:16@rack=4`` puts its 16 nodes in racks of 4 (labels
    ``topology.gpuorch.io/rack: rack-0`` ..., numbered across the whole mix); ``@block=8@rack=4`` nests them."""
    specs: list[NodeSpec] = []
    blocks_seen: dict[str, int] = {}
    for part in (p.strip() for p in mix.split(",") if p.strip()):
        part, *levels = part.split("@")
        sizes: dict[str, int] = {}
        for level in levels:
            name, _, per_block = level.partition("=")
            if name not in TOPOLOGY_LEVELS or not per_block.isdigit() or int(per_block) < 1:
                raise ValueError(f"bad topology {level!r}: use {'|'.join(TOPOLOGY_LEVELS)}=<nodes per block>")
            sizes[name] = int(per_block)
        first = len(specs)
        profile_text, _, count_text = part.partition(":")
        profile, gpus = parse_node_profile(profile_text)
        count = int(count_text) if count_text else 1
        if count < 0 or gpus < 0 or gpus > 64:
            raise ValueError(f"bad fleet part {part!r}")
        for k in range(count):
            labels = {f"topology.gpuorch.io/{name}": f"{name}-{blocks_seen.get(name, 0) + k // nodes}"
                      for name, nodes in sizes.items()}
            specs.append(NodeSpec(f"{prefix}-{len(specs):05d}", profile, gpus,
                                  cpu_milli=gpus * 16000 or 16000, memory_mib=max(gpus, 1) * 128 * 1024,
                                  labels=labels))
        for name, nodes in sizes.items():
            blocks_seen[name] = blocks_seen.get(name, 0) + -(-(len(specs) - first) // nodes)
    return specs


def parse_node_csv(text: str) -> list[NodeSpec]:
    """openb node list (``sn,cpu_milli,memory_mib,gpu,model``, optional ``block,rack,nvlink-domain`` columns: its
    topology labels) -> node specs; GPU-less rows get no GPUs."""
    import csv
    import io

    specs = []
    for row in csv.DictReader(io.StringIO(text)):
        model = (row.get("model") or "").strip()
        gpus = int(row.get("gpu") or 0)
        key = OPENB_MODEL_PROFILES.get(model, model.lower() or "t4")
        labels = {f"topology.gpuorch.io/{level}": row[level].strip() for level in TOPOLOGY_LEVELS
                  if (row.get(level) or "").strip()}
        specs.append(NodeSpec(row["sn"].strip(), device_profile(key), gpus,
                              cpu_milli=int(row["cpu_milli"]), memory_mib=int(row["memory_mib"]), labels=labels))
    return specs
