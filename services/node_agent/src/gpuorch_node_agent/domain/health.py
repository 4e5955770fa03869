"""Each GPU's health as the agent believes it, and when a verdict changes it.

Rules (pure, no I/O):
- a verdict that changes a GPU's health or reason is a change to publish at once (``GpuHealthChanged``);
- an application-error verdict (action ``fail_job``) leaves health as it was but is still published, so the job's
  owner learns why it died;
- health only gets worse from events; it becomes healthy again only through ``reset`` (the GPU was reset, or the
  agent restarted and rediscovered it);
- a GPU NVML reports lost is ``unhealthy`` until reset; a GPU whose UUID could not be read is ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_node_agent.domain.hardware import GpuRecord
from gpuorch_node_agent.domain.xid import Action, Health, HealthVerdict

_SEVERITY = {"healthy": 0, "unknown": 1, "degraded": 2, "unhealthy": 3}


@dataclass(frozen=True)
class GpuHealthState:
    health: Health = "healthy"
    reason: str | None = None

    @staticmethod
    def for_record(gpu: GpuRecord) -> GpuHealthState:
        if gpu.lost:
            return GpuHealthState("unhealthy", "NVML reports the GPU lost (fallen off the bus)")
        if gpu.uuid is None:
            return GpuHealthState("unknown", "NVML could not identify the GPU")
        return GpuHealthState()


@dataclass(frozen=True)
class HealthChange:
    """A verdict to publish: the GPU's health after it, why, and what should happen."""

    index: int
    health: Health
    reason: str
    action: Action
    xid: int | None


class HealthBook:
    """Current health per GPU index; ``apply`` says whether a verdict must be published."""

    def __init__(self) -> None:
        self.states: dict[int, GpuHealthState] = {}

    def state(self, index: int) -> GpuHealthState:
        return self.states.get(index, GpuHealthState())

    def observe(self, gpu: GpuRecord) -> HealthChange | None:
        """Fold in what discovery saw (lost / unidentifiable GPUs)."""
        seen = GpuHealthState.for_record(gpu)
        if seen.health == "healthy":
            self.states.setdefault(gpu.index, GpuHealthState())
            return None
        verdict = HealthVerdict(seen.health, "reset" if gpu.lost else "none", seen.reason or "")
        return self.apply(gpu.index, verdict)

    def apply(self, index: int, verdict: HealthVerdict, xid: int | None = None) -> HealthChange | None:
        current = self.state(index)
        if verdict.action == "fail_job" and verdict.health == "healthy":
            return HealthChange(index, current.health, verdict.reason, verdict.action, xid)
        if _SEVERITY[verdict.health] < _SEVERITY[current.health]:
            return None  # never better through an event; a reset does that
        new = GpuHealthState(verdict.health, verdict.reason)
        if new == current:
            return None
        self.states[index] = new
        return HealthChange(index, new.health, verdict.reason, verdict.action, xid)

    def reset(self, index: int) -> None:
        self.states[index] = GpuHealthState()
