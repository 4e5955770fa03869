"""Value types of the placement core: what the caller hands in and what `place` hands back.

Everything here is immutable. Views describe one moment of the fleet; a `Request` says what a task needs, never
where; `place` answers with a `Placement` (one node, GPU shares by index) or an `Unfit` carrying plain-word reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

GPU_MILLI = 1000
"""A whole GPU, in GPU-milli. A share asks for less than this on one GPU."""


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU of a node as the scheduler last saw it."""

    index: int
    model: str
    uuid: str = ""
    milli_free: int = GPU_MILLI
    memory_mib_free: int = 0
    memory_mib_total: int = 0
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node: host CPU and memory (free and total) and its GPUs. `nvlink_pairs` lists GPU index pairs joined by NVLink."""

    node_id: str
    cpu_milli_total: int
    memory_mib_total: int
    gpus: tuple[GpuView, ...] = ()
    cpu_milli_free: int | None = None
    memory_mib_free: int | None = None
    nvlink_pairs: tuple[tuple[int, int], ...] = ()
    schedulable: bool = True


@dataclass(frozen=True, slots=True)
class Request:
    """What one task needs on a single node.

    `num_gpu` 0: CPU only. `num_gpu` 1 and `gpu_milli` < 1000: a share of one GPU (it may share the GPU with other
    shares). Otherwise `num_gpu` whole GPUs (`gpu_milli` 1000). `gpu_models` empty means any model.
    `gpu_memory_mib`, when set, is needed free on every GPU used.
    """

    cpu_milli: int = 0
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_models: tuple[str, ...] = ()
    gpu_memory_mib: int = 0
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """The hash, computed once: a request keys the index's per-shape caches on every placement."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.cpu_milli, self.memory_mib, self.num_gpu, self.gpu_milli,
                                                self.gpu_models, self.gpu_memory_mib)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def is_share(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < GPU_MILLI

    @property
    def gpu_milli_total(self) -> int:
        return self.num_gpu * self.gpu_milli if self.num_gpu > 0 else 0

    def invalid_reason(self) -> str | None:
        """None when the request is well formed; otherwise why not (an error, not a does-not-fit)."""
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0 or self.gpu_memory_mib < 0:
            return "negative resource request"
        if self.num_gpu > 0 and not 0 < self.gpu_milli <= GPU_MILLI:
            return f"gpu_milli must be in 1..{GPU_MILLI} when GPUs are requested, got {self.gpu_milli}"
        if self.num_gpu > 1 and self.gpu_milli < GPU_MILLI:
            return "a share (gpu_milli < 1000) is for one GPU only"
        return None


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision: the node and, per GPU index used, the GPU-milli taken there."""

    node_id: str
    gpus: tuple[tuple[int, int], ...] = ()
    score: int = 0


@dataclass(frozen=True, slots=True)
class Unfit:
    """No node can take the request now; `reasons` are sentences for the user, most telling first."""

    reasons: tuple[str, ...] = field(default_factory=tuple)


class FilterCode(Enum):
    FITS = "fits"
    UNFIT = "unfit"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class FilterStatus:
    """The answer of one filter plugin for one node (Kubernetes framework style)."""

    code: FilterCode
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.code is FilterCode.FITS
