"""Fencing: an executor that cannot renew its lease stops its own jobs before the scheduler may requeue them.

The executor renews its node's lease by publishing ``ExecutorHeartbeat`` (see ``gpuorch_executor.lease``); a renewal
counts once the broker confirmed it, dated when it was *sent*, on the monotonic clock. The scheduler declares the
node lost (and requeues its jobs) only once ``deadline_s`` has passed since the last heartbeat it *received*, which
is never earlier than the last one sent. So that a job never runs in two places, this node must have *finished*
stopping its jobs by then: the fence starts the stop ``grace_s`` before the deadline (checkpoint signal), and every
job is killed at the deadline at the latest. A broker that is down, unreachable, or blocking publishers (a memory
alarm) all look the same here: no confirmed renewal.

A node cut off (or powered off) past the scheduler's lost deadline has its jobs requeued elsewhere, yet the
LaunchJobs that waited in its durable command queue are delivered when it is back: started then, a job runs twice.
So a LaunchJob decided before this executor's last *recovery* (the first renewal after a lapse of ``stop_after_s``
or more, or a start after a reboot) is refused and reported lost (``predates_recovery``): the scheduler requeues it
if that placement is still current and ignores it as history if not. Found by the deterministic simulation
(``libs/dst``, docs/RELIABILITY.md); the rule compares the scheduler's wall clock with this host's, and is exact
while their skew stays below the scheduler's ``lost_after_s - suspect_after_s``.

``LeaseFence`` is pure: it is fed observations (when the lease was last renewed, and now, both monotonic seconds)
and answers with the action to take. It fires ``fence`` once per lapse and ``recovered`` once when a renewal
succeeds again after a fence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FenceAction = Literal["none", "fence", "recovered"]


@dataclass(frozen=True)
class FenceDecision:
    action: FenceAction
    kill_by: float | None = None
    """Monotonic time by which every job must be dead (set with ``fence``)."""
    unrenewed_for_s: float = 0.0


class LeaseFence:
    """One executor's lease against its fencing deadline (monotonic seconds throughout)."""

    def __init__(self, deadline_s: float, grace_s: float) -> None:
        if deadline_s <= 0:
            raise ValueError("the fencing deadline must be positive")
        self.deadline_s = deadline_s
        self.grace_s = min(max(grace_s, 0.0), deadline_s)
        self.fenced = False

    @property
    def stop_after_s(self) -> float:
        """How long the lease may go unrenewed before the fence starts stopping jobs."""
        return self.deadline_s - self.grace_s

    def observe(self, renewed_at: float, now: float) -> FenceDecision:
        """Say what to do at monotonic ``now`` when the lease was last renewed at monotonic ``renewed_at``
        (the send time of the newest heartbeat the broker confirmed; the executor's start before the first)."""
        unrenewed_for = max(0.0, now - renewed_at)
        if unrenewed_for < self.stop_after_s:
            if self.fenced:
                self.fenced = False
                return FenceDecision("recovered", unrenewed_for_s=unrenewed_for)
            return FenceDecision("none", unrenewed_for_s=unrenewed_for)
        if not self.fenced:
            self.fenced = True
            return FenceDecision("fence", kill_by=renewed_at + self.deadline_s, unrenewed_for_s=unrenewed_for)
        return FenceDecision("none", unrenewed_for_s=unrenewed_for)


def predates_recovery(decided_at: float, recovered_at: float | None) -> bool:
    """Whether a LaunchJob decided at ``decided_at`` (epoch seconds, the scheduler's clock) was decided before this
    executor's last recovery at ``recovered_at`` (epoch seconds, this host's clock; None: no recovery yet)."""
    return recovered_at is not None and decided_at < recovered_at
