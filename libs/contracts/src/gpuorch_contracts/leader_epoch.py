"""Leader epochs: a command decided by a scheduler leader that has since been superseded is refused.

The rule every receiver of commands applies to ``LeaderEpoch`` fields (``commands``): the executor to
``LaunchJob``/``StopJob``, the node-agent to ``ApplyMigLayout``, the deterministic simulation to its modelled
executors (``gpuorch_dst.stale_commands``). It lives with the contract so that each of them imports one rule (a
library may not import a service).

The scheduler's leadership is a lease with an epoch (``gpuorch_scheduler.leadership``); every command it publishes
carries the epoch of the leader that decided it (``LaunchJob.leader_epoch`` ...). A leader that was paused (a VM
stall, a long GC, SIGSTOP) may wake up after a standby took over, with commands already in flight; once this node
has seen a command of the newer epoch, anything older comes from a leader that no longer decides, and is dropped.

``judge_leader_epoch`` is the whole rule, pure; the receiver keeps ``newest_seen`` across restarts (the executor
and the node-agent each in its state directory, written before the command acts):

- epoch 0 is a sender without epochs (a scheduler older than epochs, a tool): always admitted, changes nothing;
- an epoch older than the newest seen is refused;
- an equal or newer one is admitted and becomes the newest seen.

Commands of one leader reach a node in the order it committed them (one relay, in outbox order), and a new leader
publishes what its predecessor left unsent before anything of its own, so a refused command is either a late copy
of one already delivered or one a superseded leader never committed (docs/decisions.md 41).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochVerdict:
    admitted: bool
    newest_seen: int
    """The newest epoch seen once this command is judged (the caller keeps it for the next one)."""


def judge_leader_epoch(command_epoch: int, newest_seen: int) -> EpochVerdict:
    """Whether a command of ``command_epoch`` may act on a node that has seen ``newest_seen`` (see the module)."""
    if command_epoch == 0:
        return EpochVerdict(True, newest_seen)
    if command_epoch < newest_seen:
        return EpochVerdict(False, newest_seen)
    return EpochVerdict(True, command_epoch)
