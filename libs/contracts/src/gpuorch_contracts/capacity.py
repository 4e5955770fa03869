"""Events of capacity planning: what the autoscaler wants the fleet to become.

``fleet.scale_requested`` (on ``gpuorch.events``, routing key = its type) is published by the autoscaler loop
(telemetry's capacity duty, ``gpuorch_capacity``) whenever it decides to grow or shrink a node pool: in mode
``auto`` an external autoscaler (a cluster autoscaler, KEDA, a cloud webhook bridge) acts on it; in mode
``advise`` it is advice for people and ``gpuctl report``. The same figure is exported as the Prometheus gauge
``gpuorch_capacity_desired_nodes{pool}``, for followers that poll instead of consuming events. Delivery is at
least once: ``request_id`` identifies a decision, and ``desired_nodes`` is a level (not a delta), so acting on a
duplicate is harmless.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field

from gpuorch_contracts.envelope import Message
from gpuorch_contracts.text import Name, ShortText


class FleetScaleRequested(Message):
    """A node pool should grow to, or shrink to, ``desired_nodes``; ``reason`` says why in plain words."""

    TYPE = "fleet.scale_requested"
    type: Literal["fleet.scale_requested"] = "fleet.scale_requested"
    request_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    mode: Literal["advise", "auto"]
    pool: Name
    node_type: Name
    gpu_model: Name
    gpus_per_node: int = Field(ge=0, le=64)
    current_nodes: int = Field(ge=0, le=1_000_000)
    desired_nodes: int = Field(ge=0, le=1_000_000)
    add_nodes: int = Field(default=0, ge=0, le=1_000_000)
    drain_node_ids: Annotated[list[Name], Field(max_length=1024)] = Field(
        default=[], description="nodes to drain and then release; each runs no non-preemptible work"
    )
    reason: ShortText
