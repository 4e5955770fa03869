"""Who may say what: publisher identities and per-queue allow-lists of message types and senders.

Pipeline of one delivery (``Broker`` runs it before the handler)::

    AMQP user_id (set by every gpuorch publisher; RabbitMQ refuses a user_id that is not the connection's user)
        -> provenance.judged_publisher  the first publisher of an operator's replay; a forged claim is refused
        -> speaker_of(publisher)        role + the nodes it may speak for, from the naming convention below
        -> refusal(accepts, message, speaker)
             type not in the queue's table  -> "queue Q does not take T"        (even with identity off)
             no Sender rule for the role    -> "T from U (role R) refused ..."
             node field not the speaker's   -> "T from U for node N refused ..."
        -> None: hand to the handler;   a reason: dead-letter with it (nothing changes)

Broker user naming convention (deploy/rabbitmq/make_definitions.py creates users by it):

    scheduler, scheduler-<x>         role "scheduler"   (decisions, commands)
    telemetry, telemetry-<x>         role "telemetry"
    executor-<node id>               role "executor"    speaks for exactly that node
    node-agent-<node id>             role "node-agent"  speaks for exactly that node
    operator[-<x>], gpuctl-operator[-<x>]   role "operator"
    anything else (gpuctl-submit, acme-ci ...)   role "submitter" (what it may submit for: gpuorch_identity)

A user serving several nodes (one executor process for a rack) is named in ``node_scopes`` (user -> node ids),
which overrides the suffix; ``gpuorch_identity.IdentityMap.node_scopes`` reads them from deploy/identity.json.

``Sender(role="executor", node_field="node_id")`` accepts the type from an executor only when the body's
``node_id`` is a node that executor speaks for (a dotted path such as ``inventory.node_id`` reaches nested fields;
a missing or empty value is refused). ``role="*"`` accepts any identified publisher (submissions: who may submit
for which tenant is decided at admission, by the identity map).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuorch_contracts import Message

IdentityMode = Literal["strict", "trust_all"]
"""``strict`` (the default): senders are checked against each queue's ``accepts``. ``trust_all``: only the message
types are checked; for local development and tests where every process connects as ``guest``."""

ROLES = ("scheduler", "telemetry", "executor", "node-agent", "operator", "submitter")


@dataclass(frozen=True)
class Sender:
    """One allowed sender of a message type: a role, and for node-scoped roles the body field naming the node."""

    role: str
    node_field: str | None = None

    def describe(self) -> str:
        return f"{self.role} (for its own {self.node_field})" if self.node_field else self.role


Accepts = Mapping[str, Sequence[Sender]]
"""A queue's allow-list: message type -> the senders that may publish it there."""


@dataclass(frozen=True)
class Speaker:
    """A publisher as its broker user identifies it."""

    user: str
    role: str
    nodes: frozenset[str] = frozenset()


def speaker_of(user_id: str, node_scopes: Mapping[str, Collection[str]] | None = None) -> Speaker:
    """The role and nodes of broker user ``user_id`` by the naming convention (module docstring)."""
    scoped = (node_scopes or {}).get(user_id)
    for role in ("node-agent", "executor"):
        if user_id.startswith(role + "-") and len(user_id) > len(role) + 1:
            nodes = frozenset(scoped) if scoped is not None else frozenset({user_id[len(role) + 1:]})
            return Speaker(user_id, role, nodes)
    for prefix, role in (("scheduler", "scheduler"), ("telemetry", "telemetry"), ("operator", "operator"),
                         ("gpuctl-operator", "operator")):
        if user_id == prefix or user_id.startswith(prefix + "-"):
            return Speaker(user_id, role)
    return Speaker(user_id, "submitter")


def refusal(
    accepts: Accepts, message: Message, user_id: str | None, *, queue: str, mode: IdentityMode = "strict",
    node_scopes: Mapping[str, Collection[str]] | None = None,
) -> str | None:
    """Why ``message`` published by ``user_id`` must not reach ``queue``'s handler, or None when it may."""
    senders = accepts.get(message.TYPE)
    if senders is None:
        return f"queue {queue} does not take {message.TYPE} (it takes {', '.join(sorted(accepts)) or 'nothing'})"
    if mode == "trust_all":
        return None
    if not user_id:
        return f"{message.TYPE} has no user_id: its publisher is unknown"
    speaker = speaker_of(user_id, node_scopes)
    node_refusals = []
    for sender in senders:
        if sender.role not in ("*", speaker.role):
            continue
        if sender.node_field is None:
            return None
        node = _field(message, sender.node_field)
        if isinstance(node, str) and node and node in speaker.nodes:
            return None
        node_refusals.append(f"{sender.node_field}={node!r} is not a node {user_id} speaks for")
    if node_refusals:
        return f"{message.TYPE} from {user_id} refused: {node_refusals[0]}"
    allowed = ", ".join(s.describe() for s in senders)
    return f"{message.TYPE} from {user_id} (role {speaker.role}) refused: only {allowed} may send it to {queue}"


def _field(message: Message, path: str) -> object:
    value: object = message
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


# -- the allow-lists of gpuorch's queues ----------------------------------------------------------------------

SCHEDULER = (Sender("scheduler"),)
EXECUTOR_OF_NODE = Sender("executor", node_field="node_id")
NODE_AGENT_OF_NODE = Sender("node-agent", node_field="node_id")
ANY_IDENTIFIED = (Sender("*"),)


def scheduler_accepts() -> dict[str, tuple[Sender, ...]]:
    """Allow-list of the scheduler's queues (``scheduler`` and ``scheduler.heartbeats``; one table serves both).

    Submissions, cancels, array parallelism changes, priority changes and reservations from any identified user
    (tenant and priority are then checked against the identity map at admission; a reservation and a priority
    change must come from an operator); job lifecycle facts from the executor of the node named in the body (``job.failed`` also
    from the scheduler itself, which publishes it when a launch is undeliverable); node facts and ``NodeHeartbeat``
    from that node's agent; ``ExecutorHeartbeat`` (the other half of the lease) from that node's executor.
    """
    return {
        "job.submit": ANY_IDENTIFIED,
        "job.cancel": ANY_IDENTIFIED,
        "job.array_set": ANY_IDENTIFIED,
        "job.priority_set": ANY_IDENTIFIED,
        "job.session": ANY_IDENTIFIED,
        "reservation.create": ANY_IDENTIFIED,
        "reservation.delete": ANY_IDENTIFIED,
        "job.started": (EXECUTOR_OF_NODE,),
        "job.finished": (EXECUTOR_OF_NODE,),
        "job.failed": (EXECUTOR_OF_NODE, *SCHEDULER),
        "job.lost": (EXECUTOR_OF_NODE,),
        "job.checkpointed": (EXECUTOR_OF_NODE,),
        "node.registered": (Sender("node-agent", node_field="inventory.node_id"),),
        "gpu.health_changed": (NODE_AGENT_OF_NODE,),
        "node.heartbeat": (NODE_AGENT_OF_NODE,),
        "executor.heartbeat": (EXECUTOR_OF_NODE,),
        "node.mig_layout_applied": (NODE_AGENT_OF_NODE,),
    }


def executor_accepts() -> dict[str, tuple[Sender, ...]]:
    """``executor.<node>``: launch and stop commands, from the scheduler only (so a LaunchJob's ``spec.tenant`` is
    the tenant the scheduler verified, and the allow-list is looked up by it)."""
    return {"launch_job": SCHEDULER, "stop_job": SCHEDULER}


def node_agent_accepts() -> dict[str, tuple[Sender, ...]]:
    """``node-agent.<node>``: MIG layouts, from the scheduler only."""
    return {"apply_mig_layout": SCHEDULER}


def log_endpoint_accepts() -> dict[str, tuple[Sender, ...]]:
    """The API's node-log directory (``api.nodes.*``): where a node serves its jobs' logs is said only by that
    node's executor (its ``ExecutorHeartbeat.logs_url``); the API sends that executor's own credential there."""
    return {"executor.heartbeat": (EXECUTOR_OF_NODE,)}


def telemetry_accepts() -> dict[str, tuple[Sender, ...]]:
    """``telemetry.samples``: usage and health from the node's agent; job lifecycle from whoever may publish it; the
    MIG plan from the scheduler."""
    executor_or_scheduler = (EXECUTOR_OF_NODE, *SCHEDULER)
    return {
        "gpu.usage_sampled": (NODE_AGENT_OF_NODE,),
        "gpu.health_changed": (NODE_AGENT_OF_NODE,),
        **{t: SCHEDULER for t in ("job.accepted", "job.rejected", "job.queued", "job.placed", "job.preempting",
                                  "job.requeued", "job.cancelled", "job.array_parallelism_changed",
                                  "job.priority_changed", "job.session_parked", "job.submission_rejected")},
        **{t: (EXECUTOR_OF_NODE,) for t in ("job.started", "job.finished", "job.lost", "job.checkpointed")},
        "job.failed": executor_or_scheduler,
        "mig.plan_proposed": SCHEDULER,
    }
