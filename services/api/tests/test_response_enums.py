"""Response models type their closed fields with the contracts' value sets: the OpenAPI document lists each one's
``enum`` (clients can generate types from it), and the answers keep to them (a job rejected at admission, whose
row keeps no tier or priority class, answers with the spec's defaults, not with an empty string)."""

from __future__ import annotations

from typing import Any, get_args

import httpx
import pytest
from gpuorch_contracts.jobs import JobState, PriorityClass, Tier
from gpuorch_contracts.nodes import GpuHealth
from gpuorch_contracts.telemetry import Severity
from gpuorch_identity import Role

from .conftest import RunningApi, auth
from .test_api import seed

pytestmark = pytest.mark.integration

CLOSED = {
    ("JobSummary", "tier"): Tier, ("JobSummary", "priority_class"): PriorityClass, ("JobSummary", "state"): JobState,
    ("JobDetail", "state"): JobState, ("Queue", "tier"): Tier, ("Caller", "role"): Role,
    ("Caller", "max_priority"): PriorityClass, ("Node", "liveness"): None, ("Gpu", "health"): GpuHealth,
    ("Advice", "severity"): Severity, ("Advice", "category"): None, ("Reservation", "state"): None,
    ("MigPlan", "mode"): None, ("Accepted", "status"): None, ("ReservationAccepted", "status"): None,
}
"""(schema, property) -> the contracts' Literal it must list (None: a closed set of the API's own)."""
NOT_CLOSED = {"Problem", "JobUse", "QueueWait"}
"""``Problem.status`` is an HTTP status; ``JobUse``/``QueueWait`` are ``gpuorch_report``'s rows of the weekly review
(read from rows of any age, a rejected job's tier may be empty): text there."""


def _enum(schemas: dict[str, Any], name: str, field: str) -> list[str] | None:
    prop = schemas[name]["properties"][field]
    if "$ref" in prop:
        prop = schemas[prop["$ref"].rsplit("/", 1)[1]]
    return prop.get("enum")


async def test_closed_fields_are_enums_in_the_document_and_in_the_answers(api: RunningApi, migrated_dsn: str) -> None:
    ids = await seed(migrated_dsn)
    async with httpx.AsyncClient(base_url=api.url) as http:
        schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
        for (name, field), literal in CLOSED.items():
            listed = _enum(schemas, name, field)
            assert listed, f"{name}.{field} is not an enum"
            if literal is not None:
                assert listed == list(get_args(literal)), f"{name}.{field}"
        # the same names anywhere else in the answers' models are closed too (a new model cannot drift back)
        for name, schema in schemas.items():
            for field in ("state", "tier", "priority_class", "liveness", "health", "severity", "role", "status"):
                if field in schema.get("properties", {}) and name not in NOT_CLOSED:
                    assert _enum(schemas, name, field), f"{name}.{field} is not an enum"

        rejected = (await http.get(f"/api/v1/jobs/{ids['rejected']}", headers=auth("acme"))).json()
        assert (rejected["state"], rejected["tier"], rejected["priority_class"]) == ("rejected", "training", "normal")
        listed_jobs = (await http.get("/api/v1/jobs", headers=auth("ops"))).json()
        assert {j["priority_class"] for j in listed_jobs} <= set(get_args(PriorityClass))
        assert (await http.get("/api/v1/whoami", headers=auth("ops"))).json()["role"] == "operator"
