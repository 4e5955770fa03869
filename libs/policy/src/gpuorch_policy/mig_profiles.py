"""NVIDIA's MIG profile tables for A100 and H100 (the one copy: the simulated NVML and the MIG planner read it).

Tables follow NVIDIA's Multi-Instance GPU User Guide ("Supported MIG Profiles") and what
``nvidia-smi mig -lgip`` / ``-lgipp`` print on those GPUs:

- a GPU has 8 memory slices and 7 compute slices; a profile ``<c>g.<m>gb`` takes ``c`` compute slices and a
  placement of ``memory_slices`` memory slices starting at one of the allowed ``starts``;
- instances never overlap in memory slices, their compute slices add up to at most 7, and a profile has at most
  ``instance_count`` instances (``+me`` media-extension profiles: one per GPU).
Profile ids are the ``nvidia-smi`` ids (19 = 1g, 20 = 1g+me, 15 = 1g with two memory slices, 14 = 2g, 9 = 3g,
5 = 4g, 0 = 7g); ``nvml_profile`` is the ``NVML_GPU_INSTANCE_PROFILE_*`` constant that NVML's profile-info call takes.
Memory sizes are the GiB figures ``nvidia-smi mig -lgip`` prints, in MiB. Pure data: no NVML here.
"""

from __future__ import annotations

from dataclasses import dataclass

# NVML_GPU_INSTANCE_PROFILE_* constants (values as in nvidia-ml-py)
_P1, _P2, _P3, _P4, _P7 = 0x0, 0x1, 0x2, 0x3, 0x4
_P1_REV1, _P1_REV2 = 0x7, 0x9

MIG_MEMORY_SLICES = 8
MIG_COMPUTE_SLICES = 7


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

MIG_TABLES: dict[str, tuple[MigProfileSpec, ...]] = {
    "H100-80GB": MIG_H100_80GB,
    "A100-80GB": MIG_A100_80GB,
    "A100-40GB": MIG_A100_40GB,
}
"""GPU model (as the node-agent reports it) -> its MIG profile table."""


def mig_table_for(model: str) -> tuple[MigProfileSpec, ...]:
    """The MIG table of a GPU model (``H100-80GB``; ``NVIDIA H100 80GB HBM3`` and ``h100`` too), or ``()``."""
    key = model.strip().upper().replace("NVIDIA ", "").replace("-SXM4", "").replace(" HBM3", "").replace(" ", "-")
    if key in MIG_TABLES:
        return MIG_TABLES[key]
    if key == "H100":
        return MIG_H100_80GB
    return ()
