"""The scheduler's MIG plan becomes telemetry's recommendations (real PostgreSQL): one per proposed GPU change,
published once; a proposal that left the plan is resolved."""

from __future__ import annotations

import pytest
from gpuorch_contracts import AlertResolved, MigPlanProposed, MigProposalView, MigSlot, RecommendationMade, utc_now
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.store import TelemetryStore

pytestmark = pytest.mark.integration


def proposal(gpu: int, target: list[str] | None) -> MigProposalView:
    slots = None if target is None else [MigSlot(profile=p, start=2 * k) for k, p in enumerate(target)]
    return MigProposalView(node_id="node-1", gpu_index=gpu, model="H100-80GB", current=None, target=slots,
                           needs_reset=True, enables=["job-a", "job-b"], reason="2 waiting MIG job(s) need 2g.20gb")


async def test_each_proposal_is_one_recommendation_and_leaves_with_the_plan(migrated_dsn: str) -> None:
    store = await TelemetryStore.open(migrated_dsn, max_size=2)
    publisher = RecordingPublisher()
    now = utc_now()
    try:
        handlers = TelemetryHandlers(store=store, publisher=publisher, clock=lambda: now)
        plan = MigPlanProposed(mode="advise", proposals=[proposal(0, ["2g.20gb", "2g.20gb"]), proposal(1, None)])
        await handlers.handle(plan)
        await handlers.handle(plan)  # the same plan again: nothing new
        made = publisher.of_type(RecommendationMade)
        assert sorted(m.evidence["gpu_index"] for m in made) == [0.0, 1.0]
        first = next(m for m in made if m.evidence["gpu_index"] == 0.0)
        assert first.kind == "mig_layout" and first.node_id == "node-1"
        assert "whole GPU -> 2g.20gb@0 2g.20gb@2" in first.explanation and "need 2g.20gb" in first.explanation
        assert first.evidence["enables_jobs"] == 2.0 and "GPUORCH_MIG_MODE=auto" in (first.advice or "")

        await handlers.handle(MigPlanProposed(mode="advise", proposals=[proposal(1, None)]))
        open_rows = await store.alerts(open_only=True)
        assert [(r.kind, r.evidence["gpu_index"]) for r in open_rows] == [("mig_layout", 1.0)]
        resolved = publisher.of_type(AlertResolved)
        assert len(resolved) == 1 and resolved[0].reason == "no longer in the MIG plan"
    finally:
        await store.close()
