"""Fencing: an executor that cannot reach the broker stops its own jobs before the scheduler may requeue them.

The scheduler declares a node lost (and requeues its jobs) only after the node's fencing deadline. So that a job
never runs in two places, this node must have *finished* stopping its jobs by then: the fence starts the stop
``grace_s`` before the deadline (checkpoint signal), and every job is killed at the deadline at the latest.

``BrokerFence`` is pure: it is fed observations (connected or not, at a monotonic time) and answers with the
action to take. It fires ``fence`` once per outage and ``recovered`` once when the broker comes back after a fence.
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
    disconnected_for_s: float = 0.0


class BrokerFence:
    """State of one executor's broker connectivity against its fencing deadline."""

    def __init__(self, deadline_s: float, grace_s: float) -> None:
        if deadline_s <= 0:
            raise ValueError("the fencing deadline must be positive")
        self.deadline_s = deadline_s
        self.grace_s = min(max(grace_s, 0.0), deadline_s)
        self.disconnected_since: float | None = None
        self.fenced = False

    @property
    def stop_after_s(self) -> float:
        """How long a disconnection lasts before the fence starts stopping jobs."""
        return self.deadline_s - self.grace_s

    def observe(self, connected: bool, now: float, disconnected_since: float | None = None) -> FenceDecision:
        """Record one connectivity observation at monotonic ``now`` and say what to do.

        ``disconnected_since`` (monotonic), when the connection knows it, dates the outage's start more exactly
        than the first observation of it.
        """
        if connected:
            was_fenced = self.fenced
            self.disconnected_since = None
            self.fenced = False
            return FenceDecision("recovered") if was_fenced else FenceDecision("none")
        if self.disconnected_since is None:
            self.disconnected_since = min(now, disconnected_since) if disconnected_since is not None else now
        disconnected_for = now - self.disconnected_since
        if not self.fenced and disconnected_for >= self.stop_after_s:
            self.fenced = True
            return FenceDecision("fence", kill_by=self.disconnected_since + self.deadline_s,
                                 disconnected_for_s=disconnected_for)
        return FenceDecision("none", disconnected_for_s=disconnected_for)
