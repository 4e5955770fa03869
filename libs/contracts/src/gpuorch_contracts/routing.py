"""Where each message travels: exchanges, routing keys, and the type -> model registry used to decode.

- ``gpuorch.submit`` (topic): the public entry point; only ``job.submit`` (SubmitJob), ``job.cancel``,
  ``job.array_set`` (SetArrayParallelism), ``job.session`` (ChangeSession) and the operators'
  ``job.priority_set`` (SetJobPriority), ``reservation.create``/``reservation.delete`` (only the operator's and the
  API's broker users may publish these three); no tenant lane binds any of these, they always take the shared lane. A
  submission whose spec names a tenant routes ``job.submit.<tenant>``: the scheduler gives every tenant it knows
  (identity map, quotas) a queue of its own and takes from them in turn, so one tenant's flood does not wait in
  front of another's jobs. Every other key (``job.submit``, ``job.cancel``, a tenant the scheduler does not know)
  is unroutable there and goes to the exchange's alternate ``gpuorch.submit.shared`` (fanout): the shared lane.
- ``gpuorch.events`` (topic): every event, routing key = the event type (``job.placed``, ``node.heartbeat`` ...);
  a job lifecycle event that names its tenant (``jobs.TenantRouted``) has key ``<type>.<tenant>``
  (``job.started.acme``; ``JobAccepted`` falls back to its spec's tenant). Consumers of all tenants bind
  ``<type>.#`` (matches with and without a tenant); a submitter binds ``job.*.<tenant>`` and its broker user may
  bind nothing else (``deploy/rabbitmq``).
- ``gpuorch.commands`` (topic): commands for one node, routing key ``node.<node_id>.<command type>``.
- ``gpuorch.dlx`` (topic): dead letters; each queue ``Q`` has ``Q.dlq`` bound with routing key ``Q``.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from gpuorch_contracts import capacity, commands, jobs, nodes, reservations, telemetry
from gpuorch_contracts.envelope import Message

SUBMIT_EXCHANGE = "gpuorch.submit"
SUBMIT_SHARED_EXCHANGE = "gpuorch.submit.shared"
"""Alternate exchange of ``gpuorch.submit`` (fanout): submissions no tenant lane takes."""
EVENTS_EXCHANGE = "gpuorch.events"
COMMANDS_EXCHANGE = "gpuorch.commands"
DEAD_LETTER_EXCHANGE = "gpuorch.dlx"

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        jobs.SubmitJob, jobs.CancelJob, jobs.JobAccepted, jobs.JobRejected, jobs.JobQueued, jobs.JobPlaced,
        jobs.JobStarted, jobs.JobFinished, jobs.JobFailed, jobs.JobCheckpointed, jobs.JobLost,
        jobs.JobPreempting, jobs.JobRequeued, jobs.JobCancelled, jobs.SetArrayParallelism,
        jobs.ArrayParallelismChanged, jobs.SetJobPriority, jobs.JobPriorityChanged, jobs.ChangeSession, jobs.SessionParked, jobs.SubmissionRejected,
        nodes.NodeRegistered, nodes.NodeHeartbeat, nodes.GpuHealthChanged, nodes.GpuUsageSampled,
        nodes.NodeLivenessChanged, nodes.FleetAlert, nodes.ExecutorHeartbeat, nodes.MigLayoutApplied,
        nodes.MigReconfiguration, nodes.MigPlanProposed,
        commands.LaunchJob, commands.StopJob, commands.ApplyMigLayout,
        telemetry.AlertRaised, telemetry.AlertResolved, telemetry.RecommendationMade,
        capacity.FleetScaleRequested,
        reservations.CreateReservation, reservations.DeleteReservation, reservations.ReservationCreated,
        reservations.ReservationRefused, reservations.ReservationDeleted,
    )
}
COMMAND_TYPES = frozenset({commands.LaunchJob.TYPE, commands.StopJob.TYPE, commands.ApplyMigLayout.TYPE})
SUBMIT_TYPES = frozenset({jobs.SubmitJob.TYPE, jobs.CancelJob.TYPE, jobs.SetArrayParallelism.TYPE,
                          jobs.SetJobPriority.TYPE, jobs.ChangeSession.TYPE, reservations.CreateReservation.TYPE,
                          reservations.DeleteReservation.TYPE})
TENANT_ROUTED_TYPES = frozenset(t for t, cls in MESSAGE_TYPES.items() if issubclass(cls, jobs.TenantRouted))
"""Job lifecycle events whose routing key carries the tenant: ``<type>.<tenant>``."""


def event_binding(event_type: str) -> str:
    """Binding key that receives ``event_type`` for every tenant (``job.started.#``), and with no tenant."""
    return f"{event_type}.#" if event_type in TENANT_ROUTED_TYPES else event_type


def tenant_binding(tenant: str, event_type: str = "*") -> str:
    """Binding key for one tenant's job events: ``job.*.<tenant>`` (all of them) or ``job.started.<tenant>``."""
    return f"{event_type}.{tenant}" if event_type != "*" else f"job.*.{tenant}"


def submit_routing_key(tenant: str | None, submit_type: str = jobs.SubmitJob.TYPE) -> str:
    """``job.submit.<tenant>`` (the tenant's own lane); ``job.submit`` without a tenant or for the contract's
    ``default`` placeholder, which admission treats as omitted (the shared lane)."""
    return f"{submit_type}.{tenant}" if tenant and tenant != jobs.DEFAULT_TENANT else submit_type


def command_routing_key(node_id: str, command_type: str) -> str:
    return f"node.{node_id}.{command_type}"


def route(message: Message) -> tuple[str, str]:
    """Return ``(exchange, routing_key)`` for a message, following the table in this module's docstring."""
    if isinstance(message, jobs.SubmitJob):
        return SUBMIT_EXCHANGE, submit_routing_key(message.spec.tenant)
    if isinstance(message, jobs.CancelJob | jobs.SetArrayParallelism | jobs.SetJobPriority | jobs.ChangeSession):
        return SUBMIT_EXCHANGE, submit_routing_key(message.tenant, message.TYPE)
    if message.TYPE in SUBMIT_TYPES:
        return SUBMIT_EXCHANGE, message.TYPE
    if message.TYPE in COMMAND_TYPES:
        node_id = getattr(message, "node_id")  # noqa: B009 - every command carries node_id
        return COMMANDS_EXCHANGE, command_routing_key(node_id, message.TYPE)
    if isinstance(message, jobs.TenantRouted):
        tenant = message.tenant
        if tenant is None and isinstance(message, jobs.JobAccepted):
            tenant = message.spec.tenant
        if tenant is not None:
            return EVENTS_EXCHANGE, f"{message.TYPE}.{tenant}"
    return EVENTS_EXCHANGE, message.TYPE


class UnknownMessageType(ValueError):
    pass


_TYPE_FIELD = re.compile(rb'"type"\s*:\s*"([a-z_.]{1,64})"')


def decode(body: bytes | str) -> Message:
    """Parse and validate a message body; raises ``UnknownMessageType`` or ``pydantic.ValidationError``.

    The body must be a JSON object with a ``type`` naming a registered message; every field is validated against
    that message's model (unknown fields refused). Fast path: the first ``"type": "..."`` in the body names the
    model, which parses and validates the bytes in one pass (its ``type`` literal proves the guess); any failure
    there is decided again by the plain path, whose errors say what is wrong.
    """
    raw_bytes = body.encode("utf-8") if isinstance(body, str) else body
    guess = _TYPE_FIELD.search(raw_bytes, 0, 4096)
    cls = MESSAGE_TYPES.get(guess.group(1).decode()) if guess is not None else None
    if cls is not None:
        try:
            return cls.model_validate_json(raw_bytes)
        except ValueError:
            pass  # a nested "type", or an invalid message: the plain path says which
    raw = json.loads(raw_bytes.decode("utf-8"))
    if not isinstance(raw, dict):
        raise UnknownMessageType("a message must be a JSON object")
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise UnknownMessageType(f"unknown message type {kind!r}")
    return cls.model_validate(raw)


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()
