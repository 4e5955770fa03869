"""Carrying out MIG proposals: a per-GPU state machine the scheduler drives (pure: it is told the time and events).

    in_service ──start(proposal)──► draining ──no job left on the GPU──► applying ──applied──► in_service (new layout)
                                     │  no new placements on the GPU          │  ApplyMigLayout sent  │
                                     │  after drain_wait_s: preempt the       ├─refused / failed──────┤► in_service
                                     │  preemptible jobs (checkpoint signal,  │  (old layout), alert  │  (old layout)
                                     │  each job's own grace)                 └─no answer in          │
                                     └─past drain_give_up_s (a job that may      apply_timeout_s──────┘► alert
                                       not be preempted still runs): back to in_service, nothing applied, alert

Contract (what the scheduler gets back from each call is a list of actions, applied in order):
- ``StopPlacements(gpu)`` on start: the scheduler places nothing new on that GPU (or its MIG instances) until
  ``Resume(gpu)``; every path out of draining/applying ends with exactly one ``Resume``.
- ``Preempt(job, gpu)`` only for jobs the scheduler said are preemptible, only after ``drain_wait_s`` of draining,
  and once per job: the scheduler preempts it the usual way (``StopJob`` reason ``drain`` with the job's checkpoint
  grace, then requeue), so no job is stopped without its checkpoint grace. Jobs that may not be preempted are waited
  for.
- ``SendApplyMigLayout`` only once no job runs on the GPU (the node-agent refuses a GPU with work anyway): no running
  instance is ever destroyed. A MIG mode change (``needs_reset``) is therefore always a drain of the whole GPU.
- ``Resume(gpu, applied=True, at=now)`` after ``MigLayoutApplied`` says applied: the caller records ``at`` in the
  GPU's reconfiguration times (the planner's cap and hysteresis read them). A refusal, a failure or no answer
  within ``apply_timeout_s`` resumes with ``applied=False`` and raises an ``Alert``; the GPU keeps the layout the
  node-agent reports in its next inventory (the old one after a refusal; a partial one if NVML failed half-way).
- Calls for a GPU not under reconfiguration, or a ``MigLayoutApplied`` for another command, change nothing.
No I/O, no clock: ``now`` is passed in; state lives in the ``MigExecution`` object (the caller may rebuild it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from gpuorch_policy.mig_planner import MigProposal, describe

GpuKey = tuple[str, int]
Phase = Literal["in_service", "draining", "applying"]


@dataclass(frozen=True)
class ExecutionSettings:
    drain_wait_s: float = 600.0
    """How long running jobs may end on their own before the preemptible ones are preempted."""
    drain_give_up_s: float = 7200.0
    """A drain still blocked by jobs that may not be preempted after this long is abandoned."""
    apply_timeout_s: float = 300.0
    """No ``MigLayoutApplied`` within this long: resume the GPU and alert."""


# -- actions --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StopPlacements:
    gpu: GpuKey
    reason: str


@dataclass(frozen=True)
class Preempt:
    job_id: str
    gpu: GpuKey
    reason: str


@dataclass(frozen=True)
class SendApplyMigLayout:
    """Send ``ApplyMigLayout(node_id, layouts=[MigGpuLayout(gpu_index, profiles)])``; remember its message id and
    pass it as ``command_id`` with ``applied`` when the answer comes."""

    node_id: str
    gpu_index: int
    profiles: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Resume:
    gpu: GpuKey
    applied: bool
    at: float


@dataclass(frozen=True)
class Alert:
    gpu: GpuKey
    message: str


Action = StopPlacements | Preempt | SendApplyMigLayout | Resume | Alert


@dataclass(frozen=True)
class Reconfiguration:
    proposal: MigProposal
    phase: Phase
    since: float
    """When the current phase began."""
    preempted: frozenset[str] = frozenset()
    command_id: str | None = None


@dataclass
class MigExecution:
    settings: ExecutionSettings = field(default_factory=ExecutionSettings)
    active: dict[GpuKey, Reconfiguration] = field(default_factory=dict)

    def phase(self, gpu: GpuKey) -> Phase:
        found = self.active.get(gpu)
        return found.phase if found else "in_service"

    def start(self, proposal: MigProposal, now: float) -> list[Action]:
        """Begin carrying out ``proposal`` (its GPU stops taking placements). Nothing if the GPU is busy already."""
        if proposal.key in self.active:
            return []
        self.active[proposal.key] = Reconfiguration(proposal, "draining", now)
        what = f"{describe(proposal.current)} -> {describe(proposal.target)}"
        if proposal.needs_reset:
            what += " (MIG mode change: whole GPU drained)"
        return [StopPlacements(proposal.key, f"MIG reconfiguration {what}: {proposal.reason}")]

    def tick(self, running: Mapping[GpuKey, Collection[str]], preemptible: Collection[str], now: float
             ) -> list[Action]:
        """Advance every draining GPU: ``running`` = jobs still holding each GPU (its instances or itself);
        ``preemptible`` = which of them may be preempted. Also times out unanswered applies."""
        actions: list[Action] = []
        for key, reconf in sorted(self.active.items()):
            if reconf.phase == "draining":
                actions += self._drain(key, reconf, set(running.get(key, ())), set(preemptible), now)
            elif now - reconf.since >= self.settings.apply_timeout_s:
                del self.active[key]
                actions += [Resume(key, False, now),
                            Alert(key, f"no answer to ApplyMigLayout within {self.settings.apply_timeout_s:.0f} s; "
                                       "the GPU is back in service with whatever layout it reports")]
        return actions

    def _drain(self, key: GpuKey, reconf: Reconfiguration, running: set[str], preemptible: set[str], now: float
               ) -> list[Action]:
        proposal = reconf.proposal
        if not running:
            self.active[key] = replace(reconf, phase="applying", since=now)
            return [SendApplyMigLayout(proposal.node_id, proposal.gpu_index, tuple(proposal.target_profiles),
                                       proposal.reason)]
        waited = now - reconf.since
        if waited >= self.settings.drain_give_up_s:
            del self.active[key]
            stuck = ", ".join(sorted(running)[:5])
            return [Resume(key, False, now),
                    Alert(key, f"MIG reconfiguration abandoned after {waited:.0f} s: job(s) {stuck} may not be "
                               "preempted and still run; the old layout stays")]
        if waited < self.settings.drain_wait_s:
            return []
        due = sorted((running & preemptible) - reconf.preempted)
        if not due:
            return []
        self.active[key] = replace(reconf, preempted=reconf.preempted | set(due))
        return [Preempt(job, key, f"MIG reconfiguration of GPU {key[1]} on {key[0]}: {proposal.reason}")
                for job in due]

    def sent(self, gpu: GpuKey, command_id: str) -> None:
        """Record the message id of the ``ApplyMigLayout`` sent for ``gpu``."""
        reconf = self.active.get(gpu)
        if reconf is not None and reconf.phase == "applying":
            self.active[gpu] = replace(reconf, command_id=command_id)

    def applied(self, gpu: GpuKey, command_id: str, applied: bool, reason: str, now: float) -> list[Action]:
        """The node-agent's ``MigLayoutApplied`` outcome for ``gpu``."""
        reconf = self.active.get(gpu)
        if reconf is None or reconf.phase != "applying" or reconf.command_id not in (None, command_id):
            return []
        del self.active[gpu]
        if applied:
            return [Resume(gpu, True, now)]
        return [Resume(gpu, False, now),
                Alert(gpu, f"MIG layout {describe(reconf.proposal.target)} refused or failed: {reason}; "
                           "back in service with the layout it reports")]
