"""The weekly review's conclusions from hand-made rows (pure: no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuorch_capacity import CapacityPlan, Drain, PoolDecision, ScaleOut
from gpuorch_report import findings
from gpuorch_report.document import TenantUse

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)


def test_idle_tenants_need_a_tenth_of_their_allocation_idle_and_name_the_jobs() -> None:
    tenants = [TenantUse(tenant="nlp", jobs=2, allocated_gpu_hours=10.0, used_gpu_hours=1.0, idle_gpu_hours=6.0),
               TenantUse(tenant="vision", jobs=1, allocated_gpu_hours=10.0, used_gpu_hours=9.5, idle_gpu_hours=0.5)]
    jobs = [{"job_id": "a" * 36, "tenant": "nlp", "name": "notebook", "idle_gpu_hours": 5.0},
            {"job_id": "b" * 36, "tenant": "nlp", "name": "", "idle_gpu_hours": 1.0}]
    (only,) = findings.idle_tenants(tenants, jobs)
    assert only.subject == "nlp" and only.gpu_hours == 6.0
    assert "6.00 GPU-hours" in only.text and "60 %" in only.text and "notebook, bbbbbbbb" in only.text


def test_an_idle_reservation_is_what_its_tenant_did_not_use_of_it() -> None:
    rows = [{"reservation_id": "r" * 36, "tenant": "vip", "gpus": 16, "nodes": ["n1", "n2"],
             "reserved_gpu_hours": 64.0, "used_gpu_hours": 16.0},
            {"reservation_id": "s" * 36, "tenant": "vip", "gpus": 8, "nodes": ["n3"], "reserved_gpu_hours": 8.0,
             "used_gpu_hours": 8.0}]
    (only,) = findings.idle_reservations(rows)
    assert (only.kind, only.subject, only.gpu_hours) == ("idle_reservation", "vip", 48.0)
    assert "rrrrrrrr" in only.text and "48 GPU-hours of the 64 GPU-hours" in only.text and "n1, n2" in only.text


def test_right_sizing_counts_the_gpus_a_share_frees() -> None:
    jobs = [{"job_id": "j1", "tenant": "nlp", "name": "big", "gpus": 2.0}]
    oversized = [{"job_id": "j1", "advice": "Ask for the MIG profile 1g.10gb (10.0 GiB) or a share of 5 GiB and 250 "
                                            "milli-GPU instead", "evidence": {"recommended_share_milli": 250.0,
                                                                               "peak_memory_mib": 4096.0}}]
    (move,) = findings.right_sizing(jobs, oversized)
    assert move.gpus_freed == 1.5 and "MIG 1g.10gb or a 250-milli share" in move.text and "4.0 GiB" in move.text


def test_queue_waits_by_shape_and_what_the_fleet_is_short_of() -> None:
    def row(state: str, gpus: int, waited: float | None, **extra: object) -> dict[str, object]:
        submitted = NOW - timedelta(hours=1)
        return {"spec": {"resources": {"gpus": gpus, "gpu_models": ["H100-80GB"]}}, "tier": "training",
                "state": state, "submitted_at": submitted, "reason": None, "pending_reason": None,
                "placed_at": submitted + timedelta(seconds=waited) if waited is not None else None, **extra}

    rows = [row("succeeded", 8, 600), row("running", 8, 1200), row("queued", 8, None, pending_reason="no room"),
            row("succeeded", 1, 2),
            {"spec": {}, "tier": "", "state": "rejected", "submitted_at": NOW, "placed_at": None,
             "reason": "can never fit on this fleet: needs 16 GPUs on one node; the largest node has 8"}]
    waits = findings.queue_waits(rows, NOW)
    assert [(w.shape, w.jobs, w.never_fits) for w in waits] == [
        ("16 GPUs on one node", 1, 1), ("8 GPUs (H100-80GB)", 3, 0), ("1 GPU (H100-80GB)", 1, 0)]
    assert waits[1].mean_wait_s == (600 + 1200 + 3600) / 3 and waits[1].queued_now == 1
    never, short = findings.short_of(waits)
    assert "16 GPUs on one node, which no node can ever run" in never.text
    assert short.subject == "8 GPUs (H100-80GB)" and "30.0 min on average" in short.text and "no room" in short.text


def test_throttling_hot_spots_and_the_autoscaler_lines() -> None:
    nodes = [{"node_id": "hot", "observed_s": 3600, "throttled_s": 1800, "temperature_max": 91.0},
             {"node_id": "cool", "observed_s": 3600, "throttled_s": 60, "temperature_max": 60.0}]
    (hot,) = findings.throttling(nodes)
    assert hot.subject == "hot" and "50 %" in hot.text and "91 °C" in hot.text
    plan = CapacityPlan(now=0, pools=(
        PoolDecision("h100", 1, 3, scale_out=ScaleOut("h100", 2, "add 2 h100x8 node(s)")),
        PoolDecision("l4", 2, 1, drain=Drain("l4", ("l4-1",), "drain 1 idle l4x4 node(s)"))))
    lines = [c.text for c in findings.autoscaler(plan, [])]
    assert lines == ["The autoscaler would have: add 2 h100x8 node(s).",
                     "The autoscaler would have: drain 1 idle l4x4 node(s): l4-1."]
    recorded = [{"pool": "h100", "mode": "advise", "add_nodes": 2, "drain_node_ids": [], "reason": "r1"},
                {"pool": "h100", "mode": "advise", "add_nodes": 0, "drain_node_ids": ["n1"], "reason": "r2"}]
    (did,) = findings.autoscaler(None, recorded)
    assert did.text == "Autoscaler (advise) advised +2 / -1 node(s) in pool h100 over 2 decision(s); the last: r2"


def test_the_retrospective_plan_serves_mig_demand_unless_the_mig_plan_hosts_it() -> None:
    from gpuorch_report.reading import _retrospective_plan

    a100 = {"gpus": [{"model": "A100-80GB", "index": i, "memory_total_mib": 81920} for i in range(4)]}
    nodes = [{"node_id": "a1", "inventory": a100, "liveness": "alive", "last_busy": None, "active": 1,
              "pinned": True}]
    asked = {"mig_profiles": ["1g.10gb"], "gang_nodes": 1}

    def waiting(reason: str) -> findings.ShapeWait:
        return findings.ShapeWait("MIG 1g.10gb", "inference", asked, jobs=2, waits=[600.0, 900.0], queued_now=1,
                                  reason=reason)

    # an A100 node can be partitioned: MIG demand is servable by a node of that shape (not "no pool can run it")
    plan = _retrospective_plan(nodes, [waiting("no free MIG instance of 1g.10gb")], NOW - timedelta(hours=1), NOW)
    assert not plan.unservable and [o.pool for o in plan.scale_outs] == ["A100-80GBx4"]
    # the MIG plan hosts it on a GPU the fleet has: no node is bought for it
    hosted = waiting("no free MIG instance of 1g.10gb; the MIG plan (mode advise) would repartition a1 GPU 0 for it")
    plan = _retrospective_plan(nodes, [hosted], NOW - timedelta(hours=1), NOW)
    assert not plan.unservable and not plan.scale_outs


def test_share_sizing_names_oversized_and_undersized_shares() -> None:
    def job(name: str, peak: int, alloc: int = 4096, gpus: float = 0.25) -> dict[str, object]:
        return {"job_id": f"{name}-id", "name": name, "tenant": "serving", "devices": 1, "gpus": gpus,
                "alloc_memory_mib_per_gpu": alloc, "peak_memory_mib_per_gpu": peak}

    found = findings.share_sizing([job("greedy", 30720), job("tiny", 500), job("fits", 3500),
                                   job("whole", 500, 81920, 1.0)])
    assert [(c.kind, c.subject) for c in found] == [("share_size", "greedy"), ("share_size", "tiny")]
    assert "undersized share: its GPU memory peaked at 30720 MiB of the 4096 MiB share" in found[0].text
    assert "a share of 36864 MiB" in found[0].text
    assert "oversized share" in found[1].text and "a share of 768 MiB" in found[1].text
