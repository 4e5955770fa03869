"""HTTP handlers of advance reservations: operators make and delete them, everyone lists their tenants' own.

    POST   /api/v1/reservations        {tenant, gpus, gpu_model?, nodes?, start_at, duration_s} -> 202
                                       {reservation_id}: a CreateReservation on the operator's behalf (operators only)
    GET    /api/v1/reservations        the reservations of the caller's tenants (operator: all), newest start first
    GET    /api/v1/reservations/{id}   one of them (404 when not visible)
    DELETE /api/v1/reservations/{id}   202: a DeleteReservation on the operator's behalf (operators only)

The scheduler decides (it chooses the nodes, or refuses with the reason, and checks again that the sender is an
operator); the answers here show what it logged (``reservations`` read model), with the phase from the clock and
the problems from the nodes' liveness (``views.reservation_view``).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from gpuorch_contracts.reservations import MAX_RESERVATION_S, ReservationNodes
from gpuorch_contracts.text import Name, ShortText, TenantName
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from gpuorch_api import schemas
from gpuorch_api.auth import ApiError
from gpuorch_api.domain import views
from gpuorch_api.routes import BackendsDep, CallerDep

router = APIRouter()


class ReservationRequest(BaseModel):
    """An advance reservation: ``gpus`` GPUs (of ``gpu_model``; among ``nodes`` when given) for ``tenant`` from
    ``start_at`` for ``duration_s``. The scheduler reserves whole nodes."""

    model_config = ConfigDict(extra="forbid")
    tenant: TenantName
    gpus: int = Field(ge=1, le=1_000_000)
    gpu_model: Name | None = None
    nodes: ReservationNodes = []
    start_at: AwareDatetime
    duration_s: float = Field(gt=0, le=MAX_RESERVATION_S)


class ReservationAccepted(BaseModel):
    reservation_id: uuid.UUID
    status: Literal["reservation requested", "deletion requested"]


@router.post("/api/v1/reservations", status_code=202, tags=["reservations"], response_model=ReservationAccepted)
async def create_reservation(body: ReservationRequest, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """Ask the scheduler for an advance reservation (operators only); read it back to see the nodes it holds, or
    why it was refused."""
    message = await svc.gateway.reserve(who, body.model_dump())
    return {"reservation_id": message.reservation_id, "status": "reservation requested"}


@router.get("/api/v1/reservations", tags=["reservations"], response_model=list[schemas.Reservation])
async def list_reservations(
    who: CallerDep, svc: BackendsDep,
    ended: Annotated[bool, Query(description="also those that ended, were deleted or refused")] = False,
) -> list[dict[str, Any]]:
    """Reservations of the caller's tenants (operators: all): phase, nodes, window, problems."""
    now = datetime.now(UTC)
    shown = [views.reservation_view(r, now) for r in await svc.read.reservations(tenants=who.tenants)]
    return shown if ended else [r for r in shown if r["state"] in ("pending", "active")]


@router.get("/api/v1/reservations/{reservation_id}", tags=["reservations"], response_model=schemas.Reservation)
async def get_reservation(reservation_id: uuid.UUID, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """One reservation (404 when it does not exist, is not yet recorded, or is another tenant's)."""
    rows = await svc.read.reservations(tenants=who.tenants, reservation_id=reservation_id)
    if not rows:
        raise ApiError(404, f"no reservation {reservation_id} (not recorded yet, or not visible to {who.name})")
    return views.reservation_view(rows[0], datetime.now(UTC))


@router.delete("/api/v1/reservations/{reservation_id}", status_code=202, tags=["reservations"],
               response_model=ReservationAccepted)
async def delete_reservation(
    reservation_id: uuid.UUID, who: CallerDep, svc: BackendsDep,
    reason: Annotated[ShortText, Query(description="why (shown with it)")] = "deleted by an operator",
) -> dict[str, Any]:
    """Ask the scheduler to delete a reservation (operators only); its nodes are open to everyone again."""
    await svc.gateway.unreserve(who, reservation_id, reason)
    return {"reservation_id": reservation_id, "status": "deletion requested"}
