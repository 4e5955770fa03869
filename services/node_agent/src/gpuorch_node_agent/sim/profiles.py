"""Device profiles of the simulated NVML: what each GPU model reports, and NVIDIA's MIG tables.

MIG tables follow NVIDIA's Multi-Instance GPU User Guide ("Supported MIG Profiles") and what
``nvidia-smi mig -lgip`` / ``-lgipp`` print on those GPUs:

- a GPU has 8 memory slices and 7 compute slices; a profile ``<c>g.<m>gb`` takes ``c`` compute slices and a
  placement of ``size`` memory slices starting at one of the allowed ``starts``;
- instances never overlap in memory slices, their compute slices add up to at most 7, and a profile has at most
  ``instance_count`` instances (``+me`` media-extension profiles: one per GPU).
Profile ids are the ``nvidia-smi`` ids (19 = 1g, 20 = 1g+me, 15 = 1g with two memory slices, 14 = 2g, 9 = 3g,
5 = 4g, 0 = 7g); ``nvml_profile`` is the ``NVML_GPU_INSTANCE_PROFILE_*`` constant that NVML's profile-info call takes.
Memory sizes are the GiB figures ``nvidia-smi mig -lgip`` prints, in MiB.

Models of the openb trace (G2, G3 are anonymised in the trace; their memory is an assumption) are included so a
fleet can be built from ``openb_node_list_gpu_node.csv``.
"""

from __future__ import annotations

from dataclasses import dataclass

# NVML_GPU_INSTANCE_PROFILE_* constants (values as in nvidia-ml-py)
_P1, _P2, _P3, _P4, _P7 = 0x0, 0x1, 0x2, 0x3, 0x4
_P1_REV1, _P1_REV2 = 0x7, 0x9


@dataclass(frozen=True)
class MigProfileSpec:
    nvml_profile: int
    profile_id: int
    name: str
    compute_slices: int
    memory_slices: int
    instance_count: int
    memory_mib: int
    multiprocessors: int
    starts: tuple[int, ...]
    media_extensions: bool = False


def _mig_table(one: int, one_big: int, two: int, three: int, four: int, seven: int,
               sms: tuple[int, int, int, int, int, int], names: tuple[str, str, str, str, str, str]
               ) -> tuple[MigProfileSpec, ...]:
    n1, n1big, n2, n3, n4, n7 = names
    s1, s1big, s2, s3, s4, s7 = sms
    return (
        MigProfileSpec(_P1, 19, n1, 1, 1, 7, one, s1, (0, 1, 2, 3, 4, 5, 6)),
        MigProfileSpec(_P1_REV1, 20, n1 + "+me", 1, 1, 1, one, s1, (0, 1, 2, 3, 4, 5, 6), media_extensions=True),
        MigProfileSpec(_P1_REV2, 15, n1big, 1, 2, 4, one_big, s1big, (0, 2, 4, 6)),
        MigProfileSpec(_P2, 14, n2, 2, 2, 3, two, s2, (0, 2, 4)),
        MigProfileSpec(_P3, 9, n3, 3, 4, 2, three, s3, (0, 4)),
        MigProfileSpec(_P4, 5, n4, 4, 4, 1, four, s4, (0,)),
        MigProfileSpec(_P7, 0, n7, 7, 8, 1, seven, s7, (0,)),
    )


MIG_A100_40GB = _mig_table(
    4864, 9856, 9856, 20096, 20096, 40448, (14, 14, 28, 42, 56, 98),
    ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
)
MIG_A100_80GB = _mig_table(
    9728, 19968, 19968, 40192, 40192, 81152, (14, 14, 28, 42, 56, 98),
    ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
MIG_H100_80GB = _mig_table(
    9984, 20096, 20096, 40448, 40448, 81152, (16, 26, 32, 60, 64, 132),
    ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
MIG_MEMORY_SLICES = 8
MIG_COMPUTE_SLICES = 7


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


def parse_node_profile(text: str) -> tuple[DeviceProfile, int]:
    """``h100x8`` -> (H100 profile, 8). The GPU count defaults to 8."""
    key, sep, count = text.strip().lower().rpartition("x")
    if not sep or not count.isdigit() or not key:
        return device_profile(text.strip()), 8
    return device_profile(key), int(count)


def parse_profile_mix(mix: str, *, prefix: str = "sim-node") -> list[NodeSpec]:
    """``h100x8:2,a100x8:1,l4x4:2`` -> 5 node specs with ids ``<prefix>-00000`` ...; ``h100x8`` alone = 1 node."""
    specs: list[NodeSpec] = []
    for part in (p.strip() for p in mix.split(",") if p.strip()):
        profile_text, _, count_text = part.partition(":")
        profile, gpus = parse_node_profile(profile_text)
        count = int(count_text) if count_text else 1
        if count < 0 or gpus < 0 or gpus > 64:
            raise ValueError(f"bad fleet part {part!r}")
        for _ in range(count):
            specs.append(NodeSpec(f"{prefix}-{len(specs):05d}", profile, gpus,
                                  cpu_milli=gpus * 16000 or 16000, memory_mib=max(gpus, 1) * 128 * 1024))
    return specs


def parse_node_csv(text: str) -> list[NodeSpec]:
    """openb node list (``sn,cpu_milli,memory_mib,gpu,model``) -> node specs; GPU-less rows get no GPUs."""
    import csv
    import io

    specs = []
    for row in csv.DictReader(io.StringIO(text)):
        model = (row.get("model") or "").strip()
        gpus = int(row.get("gpu") or 0)
        key = OPENB_MODEL_PROFILES.get(model, model.lower() or "t4")
        specs.append(NodeSpec(row["sn"].strip(), device_profile(key), gpus,
                              cpu_milli=int(row["cpu_milli"]), memory_mib=int(row["memory_mib"])))
    return specs
