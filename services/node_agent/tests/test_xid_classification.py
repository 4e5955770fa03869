from __future__ import annotations

import pytest
from gpuorch_node_agent.domain.health import HealthBook
from gpuorch_node_agent.domain.xid import (
    EVENT_CLOCK,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_XID,
    classify_event,
    classify_xid,
)


@pytest.mark.parametrize(("xid", "health", "action"), [
    (13, "healthy", "fail_job"),
    (31, "healthy", "fail_job"),
    (43, "healthy", "fail_job"),
    (45, "healthy", "fail_job"),
    (68, "healthy", "fail_job"),
    (109, "healthy", "fail_job"),
    (48, "unhealthy", "reset"),
    (63, "degraded", "drain"),
    (64, "unhealthy", "replace"),
    (74, "unhealthy", "reset"),
    (79, "unhealthy", "reset"),
    (92, "degraded", "drain"),
    (94, "degraded", "drain"),
    (95, "unhealthy", "reset"),
    (119, "unhealthy", "reset"),
    (12345, "degraded", "none"),
])
def test_xid_catalogue(xid, health, action):
    verdict = classify_xid(xid)
    assert (verdict.health, verdict.action) == (health, action)
    assert f"XID {xid}" in verdict.reason


def test_event_types():
    assert classify_event(EVENT_XID, 79).health == "unhealthy"
    assert classify_event(EVENT_DOUBLE_BIT_ECC, 0).action == "reset"
    assert classify_event(EVENT_CLOCK, 0) is None


def test_health_only_worsens_through_events_and_app_errors_keep_health():
    book = HealthBook()
    app = book.apply(0, classify_xid(13), xid=13)
    assert app is not None and app.health == "healthy" and app.action == "fail_job"
    degraded = book.apply(0, classify_xid(94), xid=94)
    assert degraded is not None and degraded.health == "degraded"
    assert book.apply(0, classify_xid(94), xid=94) is None  # same verdict: nothing new to publish
    again_app = book.apply(0, classify_xid(31), xid=31)
    assert again_app is not None and again_app.health == "degraded"  # app error does not heal the GPU
    worse = book.apply(0, classify_xid(79), xid=79)
    assert worse is not None and worse.health == "unhealthy"
    assert book.apply(0, classify_xid(94), xid=94) is None  # never better through an event
    book.reset(0)
    assert book.state(0).health == "healthy"
