"""The read-model rows telemetry's capacity duty reads, taken from a scheduler in memory (the Harness's).

Live, telemetry selects ``NODES_SQL``, ``RUNNING_SQL`` and ``QUEUED_SQL`` (services/telemetry ``capacity.py``) from
the read models the scheduler writes with each step, and ``observe.observation`` turns them into the autoscaler's
``FleetObservation``. A simulation on the Harness has no database: ``ReadModelRows`` answers the same columns from
the ``Scheduler``'s state (its fold) and the pending reasons it last published, so the same ``observation`` sees
what telemetry would see:

    nodes()    node_id, liveness, inventory, last_job_end: the latest of the last end an executor reported for a
               job on the node and the node row's last change (registration, liveness), as ``NODES_SQL``'s
               ``greatest(max(ended_at), updated_at)``
    running()  job_id, node_ids, assignments, preemptible: jobs ``placed`` or ``running`` (as ``RUNNING_SQL``; a
               job being preempted is in neither state)
    queued()   tier, spec, submitted_at (its acceptance), pending_reason (the last ``JobQueued``'s; "" before the
               first cycle saw it)

``observe`` must be registered as a Harness observer (``harness.observers.append(rows.observe)``) before the run,
so that no end or registration is missed. Inventories, specs and assignments become dicts once each, so a call
costs what the rows cost, not their JSON.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import JobFailed, JobFinished, JobLost, NodeLivenessChanged, NodeRegistered
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.scheduler import Scheduler
from gpuorch_scheduling.step import Step

RUNNING_STATES = ("placed", "running")
_NODE_CHANGES = (NodeLivenessChanged, JobFinished, JobFailed, JobLost)
"""Events after which a node row counts as changed (a liveness change, a job on it ended)."""


def moment(seconds: float) -> datetime:
    """Simulated seconds as the datetime a read model would hold (the Harness dates its messages the same way)."""
    return datetime.fromtimestamp(seconds, UTC)


class ReadModelRows:
    """See the module docstring. Reads ``scheduler``'s state at each call; keeps only the node times it observed."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.node_changed_at: dict[str, float] = {}
        """Node -> the last time its row changed or an executor reported a job on it ended (seconds)."""
        self._inventories: dict[str, tuple[str, dict[str, Any]]] = {}
        self._specs: dict[int, tuple[object, dict[str, Any]]] = {}
        self._assignments: dict[uuid.UUID, list[dict[str, Any]]] = {}

    def observe(self, step: Step, harness: Harness) -> None:
        """A Harness observer: note registrations, liveness changes and job ends per node at the step's time."""
        for event, _ in step.events:
            if isinstance(event, NodeRegistered):
                self.node_changed_at[event.inventory.node_id] = harness.now
            elif isinstance(event, _NODE_CHANGES):
                self.node_changed_at[event.node_id] = harness.now

    def nodes(self) -> list[dict[str, Any]]:
        rows = []
        for node_id, node in self.scheduler.state.nodes.items():
            cached = self._inventories.get(node_id)
            if cached is None or cached[0] != node.inventory_hash:
                cached = self._inventories[node_id] = (node.inventory_hash, node.inventory.model_dump(mode="json"))
            changed = self.node_changed_at.get(node_id)
            rows.append({"node_id": node_id, "liveness": node.liveness, "inventory": cached[1],
                         "last_job_end": moment(changed) if changed is not None else None})
        return rows

    def running(self) -> list[dict[str, Any]]:
        rows = []
        for job in self.scheduler.state.active.values():
            if job.state not in RUNNING_STATES or job.placement_id is None:
                continue
            assignments = self._assignments.get(job.placement_id)
            if assignments is None:
                if len(self._assignments) > 100_000:
                    self._assignments.clear()
                assignments = self._assignments[job.placement_id] = [
                    a.model_dump(mode="json") for a in job.assignments]
            rows.append({"job_id": job.job_id, "node_ids": [a["node_id"] for a in assignments],
                         "assignments": assignments, "preemptible": job.spec.preemptible})
        return rows

    def queued(self) -> list[dict[str, Any]]:
        pending = self.scheduler.pending
        rows = []
        for job in self.scheduler.state.queued.values():
            cached = self._specs.get(id(job.spec))
            if cached is None or cached[0] is not job.spec:
                cached = self._specs[id(job.spec)] = (job.spec, job.spec.model_dump(mode="json"))
            waiting = pending.get(job.job_id)
            rows.append({"tier": job.spec.tier, "spec": cached[1], "submitted_at": moment(job.accepted_at),
                         "pending_reason": waiting.reason if waiting is not None else ""})
        return rows


__all__ = ["ReadModelRows", "moment"]
