"""Advance reservations: GPUs promised to one tenant for a window (operators only).

    CreateReservation (an operator, or the API on an operator's behalf) ──► scheduler ──► ReservationCreated
                                                                                          (the nodes it holds) or
                                                                                          ReservationRefused (why)
    DeleteReservation                                                    ──► scheduler ──► ReservationDeleted

The scheduler chooses the nodes when it accepts a reservation (whole nodes of the model asked, among ``nodes`` when
given, fewest first) and logs them: the reservation is state from events. Before ``start_at`` its nodes take only
jobs that end in time (runtime estimate or limit) or preemptible jobs, which are checkpointed and stopped at the
start; from ``start_at`` to ``end_at`` only the reservation's tenant places there.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from gpuorch_contracts.envelope import Message
from gpuorch_contracts.text import Name, ShortText, TenantName

MAX_RESERVATION_S = 366 * 86400.0
ReservationNodes = Annotated[list[Name], Field(max_length=10_000)]


class _OperatorCommand(Message):
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity a gateway acts for (see SubmitJob.on_behalf_of)"))


class CreateReservation(_OperatorCommand):
    """Ask the scheduler to reserve ``gpus`` GPUs (of ``gpu_model``, on ``nodes`` when given) for ``tenant`` from
    ``start_at`` for ``duration_s``. Only operators may."""

    TYPE = "reservation.create"
    type: Literal["reservation.create"] = "reservation.create"
    reservation_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    tenant: TenantName
    gpus: int = Field(ge=1, le=1_000_000)
    gpu_model: Name | None = Field(default=None, description="a GPU model the nodes must have (substring, any case)")
    nodes: ReservationNodes = Field(default=[], description="choose among these nodes only (empty: any)")
    start_at: datetime
    duration_s: float = Field(gt=0, le=MAX_RESERVATION_S)


class DeleteReservation(_OperatorCommand):
    """Ask the scheduler to end a reservation now (operators only)."""

    TYPE = "reservation.delete"
    type: Literal["reservation.delete"] = "reservation.delete"
    reservation_id: uuid.UUID
    reason: ShortText = "deleted by an operator"


class ReservationCreated(Message):
    """The scheduler accepted a reservation and holds ``nodes`` for it in its window."""

    TYPE = "reservation.created"
    type: Literal["reservation.created"] = "reservation.created"
    reservation_id: uuid.UUID
    tenant: TenantName
    gpus: int = Field(ge=1, le=1_000_000)
    gpu_model: Name | None = None
    nodes: ReservationNodes
    start_at: datetime
    end_at: datetime
    created_by: Name | None = None


class ReservationRefused(Message):
    """A reservation the scheduler could not accept (not allowed, or not enough nodes), and why."""

    TYPE = "reservation.refused"
    type: Literal["reservation.refused"] = "reservation.refused"
    reservation_id: uuid.UUID
    tenant: TenantName
    reason: ShortText


class ReservationDeleted(Message):
    """A reservation ended before its end (deleted)."""

    TYPE = "reservation.deleted"
    type: Literal["reservation.deleted"] = "reservation.deleted"
    reservation_id: uuid.UUID
    reason: ShortText
