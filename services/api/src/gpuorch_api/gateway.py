"""Submissions and cancels on a caller's behalf: the same SubmitJob/CancelJob any system publishes.

    caller (token) --auth--> identity name
        submit: authorize_submission(map, name, spec)  refused -> Forbidden (403), nothing published
                a gpu_memory_auto share: sized from earlier runs (size_share, domain.share_sizing)
                SubmitJob(spec as authorized, on_behalf_of=name) -> gpuorch.submit / job.submit.<tenant>
        cancel: authorize_job_access(map, name, job's tenant)  refused -> Forbidden (403)
                CancelJob(job_id, tenant, on_behalf_of=name) -> gpuorch.submit / job.cancel.<tenant>
        set an array's parallelism: the same check as cancel
                SetArrayParallelism(job_id, tenant, on_behalf_of=name) -> gpuorch.submit / job.array_set.<tenant>
    set_priority: operators only -> SetJobPriority(job_id, priority_class, tenant, on_behalf_of=name)
                -> gpuorch.submit / job.priority_set.<tenant>
        reserve / unreserve: operators only (else Forbidden)
                CreateReservation / DeleteReservation(on_behalf_of=name) -> gpuorch.submit / reservation.*
        park or resume a session: the same check as cancel
                ChangeSession(job_id, action, tenant, on_behalf_of=name) -> gpuorch.submit / job.session.<tenant>

The API publishes as its own broker user (a ``gateway`` identity in the identity map); the scheduler judges the
message as ``on_behalf_of`` only because that user is a gateway (``gpuorch_identity.acting_user``, decision 25),
and applies the same rules again: the API's own check is for an immediate answer, not the guarantee.
Publishing uses confirms and ``mandatory``: ``PublishError`` (no scheduler bound, broker down) reaches the
caller as 503.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gpuorch_contracts import (
    CancelJob,
    ChangeSession,
    CreateReservation,
    DeleteReservation,
    JobSpec,
    SetArrayParallelism,
    SetJobPriority,
    SubmitJob,
)
from gpuorch_contracts.jobs import PriorityClass, SessionAction
from gpuorch_identity import IdentityMap, Rejection, authorize_job_access, authorize_submission
from gpuorch_messaging import Broker
from gpuorch_observability import tracer
from opentelemetry import trace

from gpuorch_api.auth import Caller, Forbidden


class Gateway:
    def __init__(self, broker: Broker, identity_map: IdentityMap,
                 size_share: Callable[[JobSpec], Awaitable[JobSpec]] | None = None) -> None:
        """``size_share``: resolves a ``gpu_memory_auto`` share of an authorized spec (``domain.share_sizing``)."""
        self.broker = broker
        self.identity_map = identity_map
        self.size_share = size_share

    async def submit(self, caller: Caller, spec: JobSpec, job_id: uuid.UUID | None = None) -> SubmitJob:
        """Publish the caller's submission; returns the message (its ``job_id``) once the broker confirmed it.
        ``spec`` must be as decoded from the request (omitted tenant/priority stay omitted until authorized)."""
        verdict = authorize_submission(self.identity_map, caller.name, spec)
        if isinstance(verdict, Rejection):
            raise Forbidden(verdict.reason)
        if verdict.resources.gpu_memory_auto and self.size_share is not None:
            verdict = await self.size_share(verdict)
        message = SubmitJob(spec=verdict, producer="gpuorch-api", on_behalf_of=caller.name,
                            **({"job_id": job_id} if job_id else {}))
        # the root of the job's trace: the scheduler's spans join it from the headers; ``job_id`` as on every span of
        # the job (routes.JOB_ID_TAG), ``gpuorch.job_id`` as before
        with tracer("gpuorch-api").start_as_current_span(
                f"api {SubmitJob.TYPE}", kind=trace.SpanKind.PRODUCER,
                attributes={"job_id": str(message.job_id), "gpuorch.job_id": str(message.job_id),
                            "gpuorch.identity": caller.name}):
            await self.broker.publish(message)
        return message

    async def cancel(self, caller: Caller, job: dict[str, Any], reason: str,
                     array_tasks: str | None = None) -> CancelJob:
        """Cancel a job, a whole array, or (``array_tasks``) some tasks of an array."""
        self._may_act_on(caller, job)
        message = CancelJob(job_id=job["job_id"], reason=reason, tenant=job["tenant"] or None,
                            producer="gpuorch-api", on_behalf_of=caller.name, array_tasks=array_tasks)
        await self.broker.publish(message)
        return message

    async def set_parallelism(self, caller: Caller, job: dict[str, Any], parallelism: int | None
                              ) -> SetArrayParallelism:
        """Change how many tasks of an array may run at once (whoever may cancel it may)."""
        self._may_act_on(caller, job)
        message = SetArrayParallelism(job_id=job["job_id"], parallelism=parallelism, tenant=job["tenant"] or None,
                                      producer="gpuorch-api", on_behalf_of=caller.name)
        await self.broker.publish(message)
        return message

    async def set_priority(self, caller: Caller, job: dict[str, Any], priority_class: PriorityClass
                           ) -> SetJobPriority:
        """Change a job's priority class; operators only (the scheduler checks again)."""
        self._operator(caller, "a job's priority is changed")
        message = SetJobPriority(job_id=job["job_id"], priority_class=priority_class, tenant=job["tenant"] or None,
                                 producer="gpuorch-api", on_behalf_of=caller.name)
        await self.broker.publish(message)
        return message

    async def reserve(self, caller: Caller, request: dict[str, Any]) -> CreateReservation:
        """Ask for an advance reservation (``request``: CreateReservation's fields); operators only."""
        self._operator(caller)
        message = CreateReservation(**request, producer="gpuorch-api", on_behalf_of=caller.name)
        await self.broker.publish(message)
        return message

    async def unreserve(self, caller: Caller, reservation_id: uuid.UUID, reason: str) -> DeleteReservation:
        self._operator(caller)
        message = DeleteReservation(reservation_id=reservation_id, reason=reason, producer="gpuorch-api",
                                    on_behalf_of=caller.name)
        await self.broker.publish(message)
        return message

    @staticmethod
    def _operator(caller: Caller, what: str = "reservations are made and deleted") -> None:
        if not caller.is_operator:
            raise Forbidden(f"{caller.name} is not an operator: {what} by operators")

    async def change_session(self, caller: Caller, job: dict[str, Any], action: SessionAction,
                             reason: str = "asked by its owner") -> ChangeSession:
        """Park or resume a session (whoever may cancel it may)."""
        self._may_act_on(caller, job)
        message = ChangeSession(job_id=job["job_id"], action=action, reason=reason, tenant=job["tenant"] or None,
                                producer="gpuorch-api", on_behalf_of=caller.name)
        await self.broker.publish(message)
        return message

    def _may_act_on(self, caller: Caller, job: dict[str, Any]) -> None:
        refused = authorize_job_access(self.identity_map, caller.name, job["tenant"])
        if refused is not None:
            raise Forbidden(refused.reason)
