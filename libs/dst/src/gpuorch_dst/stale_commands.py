"""Stale commands: the executor's two rules against acting on a decision that was overtaken, as pure functions.

1. Leader epochs. Every takeover increments the lease's epoch; every command is stamped with the epoch of the
   leader that committed it. An executor remembers the newest epoch it has accepted and refuses a command of an
   older one (``refuses``): a leader that woke up after it was replaced cannot act through that executor.
   The rule is the real executor's and node-agent's (``gpuorch_contracts.leader_epoch.judge_leader_epoch``);
   ``EpochGuard.enabled=False`` switches it off.

2. Launches that predate a recovery. A node cut off (or powered off) past the scheduler's lost deadline has its
   jobs requeued elsewhere, but the LaunchJobs that waited in its durable command queue are still delivered when
   it comes back: started then, the job runs twice. A LaunchJob decided before the executor's last recovery is
   refused and reported lost (``predates_recovery``): the scheduler requeues it if the placement was still current,
   and ignores it as history if not. A recovery is the first renewal after a lapse of ``fencing_deadline_s -
   grace_s`` or more (a fence, a pause that outlived it, a restart after that long: lease.json says how long),
   or a start after a reboot; a shorter silence cannot have let the scheduler declare the node lost. Found by
   this simulation (seed 51 of the CI config); the real executor has the same rule
   (``gpuorch_executor.domain.fencing.predates_recovery``; libraries may not import services, hence this copy).
   The two times come from different hosts' wall clocks: the rule is exact while their skew stays below the
   scheduler's ``lost_after_s - suspect_after_s`` (a launch decided while the node was alive is at least that
   much older than the recovery that follows a loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_contracts.leader_epoch import judge_leader_epoch


def refuses(command_epoch: int | None, newest_seen: int) -> bool:
    """Whether an executor that has accepted commands up to epoch ``newest_seen`` refuses one of
    ``command_epoch`` (None: a command from before epochs existed, accepted)."""
    return command_epoch is not None and not judge_leader_epoch(command_epoch, newest_seen).admitted


def predates_recovery(decided_at: float, recovered_at: float | None) -> bool:
    """Whether a LaunchJob decided at ``decided_at`` (the scheduler's wall clock) was decided before the
    executor's last recovery at ``recovered_at`` (its own wall clock; None: never recovered from anything)."""
    return recovered_at is not None and decided_at < recovered_at


@dataclass
class EpochGuard:
    """One executor's memory of the newest epoch it accepted (durable: kept across its restarts, as the real
    executor keeps its placement records). ``enabled=False`` accepts everything (the check switched off)."""

    enabled: bool = True
    newest_seen: int = 0
    refused: int = 0

    def admit(self, command_epoch: int | None) -> bool:
        """True if the command may be handled (and remember its epoch); False if it is refused."""
        if self.enabled and refuses(command_epoch, self.newest_seen):
            self.refused += 1
            return False
        if command_epoch is not None:
            self.newest_seen = max(self.newest_seen, command_epoch)
        return True
