"""Events telemetry emits: alerts (something is wrong now) and recommendations (how to use less).

Both are events on ``gpuorch.events`` routed by their type: ``alert.raised``, ``alert.resolved`` and
``recommendation.made``, so a consumer binds ``alert.*`` or ``recommendation.*`` and reads ``kind`` to tell them
apart (one literal ``type`` per class keeps ``gpuorch_contracts.route`` unchanged).

Kinds: ``idle``, ``starved``, ``throttled``, ``memory_pressure``, ``gpu_unhealthy`` (alerts) and ``oversized``
(recommendation). Telemetry keeps at most one open alert per subject (job, or GPU when there is no job) and kind;
``alert_id`` names it, so ``AlertResolved`` refers to the ``AlertRaised`` it closes.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field

from gpuorch_contracts.envelope import Message
from gpuorch_contracts.text import GpuUuid, Name, ShortText, TenantName

Severity = Literal["info", "warning", "critical"]
Evidence = Annotated[dict[Name, Annotated[float, Field(ge=-1e15, le=1e15)]], Field(max_length=64)]
"""The numbers behind a detection, by name (``mean_util_pct``, ``peak_memory_mib`` ...)."""


class AlertRaised(Message):
    """A detection opened: ``explanation`` says in plain words what was seen, ``evidence`` the numbers."""

    TYPE = "alert.raised"
    type: Literal["alert.raised"] = "alert.raised"
    alert_id: uuid.UUID
    kind: Name
    severity: Severity = "warning"
    job_id: uuid.UUID | None = None
    node_id: Name
    gpu_uuid: GpuUuid | None = None
    tenant: TenantName | None = None
    explanation: ShortText
    evidence: Evidence = {}
    advice: ShortText | None = None


class AlertResolved(Message):
    """The condition behind ``alert_id`` no longer holds, or its job ended."""

    TYPE = "alert.resolved"
    type: Literal["alert.resolved"] = "alert.resolved"
    alert_id: uuid.UUID
    kind: Name
    job_id: uuid.UUID | None = None
    node_id: Name
    gpu_uuid: GpuUuid | None = None
    tenant: TenantName | None = None
    reason: ShortText


class RecommendationMade(Message):
    """Advice to ask for less (or different) GPU resources, with the numbers it rests on."""

    TYPE = "recommendation.made"
    type: Literal["recommendation.made"] = "recommendation.made"
    recommendation_id: uuid.UUID
    kind: Name
    severity: Severity = "info"
    job_id: uuid.UUID | None = None
    node_id: Name
    gpu_uuid: GpuUuid | None = None
    tenant: TenantName | None = None
    explanation: ShortText
    evidence: Evidence = {}
    advice: ShortText | None = None
