"""The lifecycle of one placement on this node, and the deterministic ids of the events it produces.

States::

    launching --> running --> stopping --> ended
        |            |                      ^
        +------------+----------------------+

- ``launching``: the record is durable and the supervisor is being started; nothing was reported yet.
- ``running``: the supervisor reported the job's pid (JobStarted is in the record's outbox or published).
- ``stopping``: the checkpoint signal was (or is about to be) sent; the job is killed at ``StopRequest.kill_at``.
- ``ended``: the outcome is decided and stored in the record's outbox; nothing about this placement changes again.
  A record stays on disk after it ended so that a redelivered LaunchJob for it starts nothing.

Each event a placement produces has a message id derived from the placement id and the node (``event_id``): if the
executor crashes after publishing and before recording that it did, the re-publication carries the same id and
consumers, who dedupe by ``message_id``, apply it once. All terminal events (finished, failed, lost) of one node
share the id ``event_id(placement, "outcome", node)``, so a placement has exactly one outcome per node downstream;
the node is part of the id because a gang's ranks are one placement on several nodes, and the scheduler holds a
stopped gang's capacity until every node confirmed its own stop.
"""

from __future__ import annotations

import uuid
from typing import Literal

PlacementState = Literal["launching", "running", "stopping", "ended"]
StopReason = Literal["cancel", "preempt", "max_runtime", "drain", "fenced", "gpu_memory_exceeded"]
EventKind = Literal["started", "checkpointed", "outcome"]

ALLOWED_TRANSITIONS: dict[str, frozenset[str]] = {
    "launching": frozenset({"running", "ended"}),
    "running": frozenset({"stopping", "ended"}),
    "stopping": frozenset({"ended"}),
    "ended": frozenset(),
}
ACTIVE_STATES: frozenset[str] = frozenset({"launching", "running", "stopping"})


class IllegalTransition(ValueError):
    """A placement was asked to move to a state its lifecycle does not allow from where it is."""


def check_transition(current: str, target: str) -> None:
    """Raise ``IllegalTransition`` unless ``current -> target`` is an edge of the lifecycle above."""
    if target not in ALLOWED_TRANSITIONS.get(current, frozenset()):
        raise IllegalTransition(f"a placement cannot go from {current!r} to {target!r}")


def event_id(placement_id: uuid.UUID, kind: EventKind, node_id: str) -> uuid.UUID:
    """Deterministic message id of a placement's event of ``kind`` on ``node_id`` (the same after any restart)."""
    return uuid.uuid5(placement_id, f"{kind}@{node_id}")
