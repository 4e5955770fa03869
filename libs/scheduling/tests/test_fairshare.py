"""Fair share over time: decayed usage from the log decides the order between tenants, and survives a restart."""

from __future__ import annotations

import json
import math

import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun
from gpuorch_scheduling import QueuePolicy
from gpuorch_scheduling.fairshare import FairSharePolicy, fair_shares
from gpuorch_scheduling.harness import Harness, SimJob
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node
from gpuorch_scheduling.usage import DecayedUsage

RUN = ProcessRun(argv=["python", "train.py"])
DAY = 86400.0


def spec(tenant: str, gpus: int = 8) -> JobSpec:
    return JobSpec(run=RUN, tenant=tenant, resources=GpuRequest(gpus=gpus), runtime_estimate_s=3600)


def test_usage_decays_by_half_each_half_life_and_accrues_while_held() -> None:
    ledger = DecayedUsage(half_life_s=100.0)
    ledger.change("a", "H100", 2.0, at=0.0)
    held_one_half_life = ledger.value("a", "H100", 100.0)
    assert held_one_half_life == pytest.approx(2.0 * 0.5 * 100.0 / math.log(2))  # < 200 GPU-s: it decays as it accrues
    ledger.change("a", "H100", -2.0, at=100.0)
    assert ledger.value("a", "H100", 200.0) == pytest.approx(held_one_half_life / 2)
    assert ledger.value("a", "H100", 300.0) == pytest.approx(held_one_half_life / 4)
    assert DecayedUsage.from_list(ledger.to_list(), 100.0).value("a", "H100", 300.0) == \
        pytest.approx(held_one_half_life / 4)


def test_model_weights_and_shares_give_the_sshare_factors() -> None:
    policy = FairSharePolicy(model_weights={"h100": 2.0}, shares={"a": 1.0, "b": 3.0})
    assert policy.model_weight("NVIDIA H100 80GB HBM3") == 2.0 and policy.model_weight("A100-80GB") == 1.0
    state = SchedulerState(usage=DecayedUsage(math.inf))
    state.usage.change("a", "H100", 1.0, 0.0)
    state.usage.change("b", "A100", 1.0, 0.0)
    lines = {line.tenant: line for line in fair_shares(state, policy, 100.0)}
    assert lines["a"].usage_gpu_s == pytest.approx(200.0) and lines["b"].usage_gpu_s == pytest.approx(100.0)
    assert lines["a"].normalized_share == pytest.approx(0.25)
    assert lines["a"].factor == pytest.approx(2 ** (-(2 / 3) / 0.25))
    assert lines["b"].factor == pytest.approx(2 ** (-(1 / 3) / 0.75))


def _yesterday(weight: float) -> Harness:
    """One 8-GPU node; tenant ``alpha`` used all of it for 20 hours yesterday, ``beta`` nothing."""
    policy = QueuePolicy(fair_share=FairSharePolicy(weight=weight, shares={"alpha": 1.0, "beta": 1.0}))
    h = Harness(SchedulerConfig(queues=policy), keep_steps=True, tick_s=600.0, heartbeat_s=600.0)
    h.add_node(registered_node("n0", gpus=8, model="H100").inventory)
    h.submit(spec("alpha"), at=0.0, runtime_s=20 * 3600)
    h.run(until=DAY)
    return h


def _today(h: Harness) -> tuple[SimJob, SimJob]:
    """Both tenants ask for the whole node at the same instant (alpha's name and submission come first)."""
    alpha = h.submit(spec("alpha"), at=DAY + 10, runtime_s=600)
    beta = h.submit(spec("beta"), at=DAY + 10, runtime_s=600)
    h.run()
    return alpha, beta


def test_the_tenant_that_used_nothing_yesterday_is_placed_first_today() -> None:
    h = _yesterday(weight=1.0)
    alpha, beta = _today(h)
    assert beta.started_at is not None and alpha.started_at is not None
    assert beta.started_at < alpha.started_at
    line = {s.tenant: s for s in fair_shares(h.state, h.scheduler.config.queues.fair_share, DAY)}
    assert line["alpha"].factor < 0.5 < line["beta"].factor


def test_without_memory_plain_drf_places_alpha_first() -> None:
    """The control: the same day with the past weighing nothing (so the test above can fail)."""
    alpha, beta = _today(_yesterday(weight=0.0))
    assert alpha.started_at is not None and beta.started_at is not None
    assert alpha.started_at < beta.started_at


def test_the_same_order_after_a_restart_that_rebuilds_the_state_from_the_log() -> None:
    h = _yesterday(weight=1.0)
    before = h.state.usage.weighted(DAY)
    rebuilt = SchedulerState(retention_s=h.state.retention_s, usage=DecayedUsage(h.state.usage.half_life_s))
    for position, event in enumerate(h.logged(), start=1):
        rebuilt.apply(event)
        rebuilt.position = position
    assert rebuilt.usage.weighted(DAY) == pytest.approx(before) and before["alpha"] > 0
    from_snapshot = SchedulerState.from_snapshot(json.loads(rebuilt.snapshot_json()),
                                                 half_life_s=rebuilt.usage.half_life_s)
    assert from_snapshot.usage.weighted(DAY) == pytest.approx(before)
    h.scheduler.recovered(rebuilt, lease_now=DAY)
    alpha, beta = _today(h)
    assert beta.started_at is not None and alpha.started_at is not None
    assert beta.started_at < alpha.started_at
