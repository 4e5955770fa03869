"""The MIG planner: what it proposes for a given queue and fleet, and properties over random fleets and queues."""

from __future__ import annotations

from gpuorch_policy.mig_geometry import Slot, layout_refusal
from gpuorch_policy.mig_planner import (
    HOUR_S,
    GpuState,
    InstanceState,
    PendingJob,
    PlannerSettings,
    plan_mig,
    planned_profile,
    pool_target,
    slice_demand,
)
from gpuorch_policy.mig_profiles import MIG_H100_80GB, mig_table_for
from hypothesis import given, settings
from hypothesis import strategies as st

ADVISE = PlannerSettings()
NOW = 100_000.0


def whole(node: str, index: int, *jobs: str, **kw) -> GpuState:
    return GpuState(node, index, "H100-80GB", whole_job_ids=jobs, **kw)


def mig(node: str, index: int, *instances: tuple[str, int, str | None], **kw) -> GpuState:
    return GpuState(node, index, "H100-80GB", mig_enabled=True,
                    instances=tuple(InstanceState(p, s, j) for p, s, j in instances), **kw)


def small(job_id: str, *profiles: str, peak: int | None = None, waiting: float = 120.0) -> PendingJob:
    return PendingJob(job_id, "inference", waiting, mig_profiles=profiles or ("1g.10gb",), peak_memory_mib=peak)


def train(job_id: str, gpus: int, nodes: int = 1, waiting: float = 120.0) -> PendingJob:
    return PendingJob(job_id, "training", waiting, whole_gpus=gpus, nodes=nodes)


def test_mode_off_proposes_nothing_and_advise_is_not_executable() -> None:
    gpus, queue = [whole("n1", 0)], [small("a")]
    assert plan_mig(gpus, queue, PlannerSettings(mode="off"), NOW).proposals == ()
    advised = plan_mig(gpus, queue, ADVISE, NOW)
    assert advised.proposals and advised.executable == ()
    assert plan_mig(gpus, queue, PlannerSettings(mode="auto"), NOW).executable


def test_idle_whole_gpu_becomes_slices_for_waiting_small_jobs() -> None:
    plan = plan_mig([whole("n1", 0)], [small(f"j{i}") for i in range(3)], ADVISE, NOW)
    (proposal,) = plan.proposals
    assert proposal.current is None and proposal.needs_reset
    assert sorted(proposal.enables) == ["j0", "j1", "j2"] and proposal.drains == ()
    assert [s.profile for s in proposal.target or ()].count("1g.10gb") == 7  # the room left is filled with 1g
    assert "3 waiting MIG job(s)" in proposal.reason


def test_demand_is_planned_only_after_the_batching_window() -> None:
    assert plan_mig([whole("n1", 0)], [small("a", waiting=10)], ADVISE, NOW).proposals == ()


def test_free_whole_gpus_a_training_job_gathers_stay_whole_the_others_may_be_sliced() -> None:
    gpus = [whole("n1", 0), whole("n1", 1), whole("n1", 2, "busy"), whole("n2", 0), whole("n2", 1, "busy")]
    plan = plan_mig(gpus, [train("t", 3), small("a")], ADVISE, NOW)
    (proposal,) = plan.proposals                # n1 gathers for the 3-GPU job; n2's free GPU may be sliced
    assert proposal.key == ("n2", 0) and proposal.enables == ("a",)


def test_a_gpu_wanted_for_whole_gpu_training_stays_whole() -> None:
    gpus = [whole("n1", 0), whole("n1", 1, "busy")]
    plan = plan_mig(gpus, [train("t", 2), small("a")], ADVISE, NOW)
    assert plan.proposals == ()
    assert {j for j, _ in plan.unmet} == {"t", "a"}


def test_existing_free_instances_are_used_before_anything_changes() -> None:
    gpus = [mig("n1", 0, ("1g.10gb", 6, None)), whole("n1", 1)]
    assert plan_mig(gpus, [small("a")], ADVISE, NOW).proposals == ()


def test_empty_mig_gpus_turn_whole_for_training_fewest_running_jobs_first() -> None:
    gpus = [mig("n1", 0, ("3g.40gb", 0, "x"), ("3g.40gb", 4, None)), mig("n1", 1, ("7g.80gb", 0, None)),
            mig("n2", 0, ("3g.40gb", 0, None))]
    plan = plan_mig(gpus, [train("t", 1)], ADVISE, NOW)
    (proposal,) = plan.proposals
    assert proposal.key == ("n1", 1) and proposal.target is None and proposal.drains == ()
    plan = plan_mig(gpus, [train("t", 2)], ADVISE, NOW)
    assert {p.key for p in plan.proposals} == {("n1", 0), ("n1", 1)}
    assert {j for p in plan.proposals for j in p.drains} == {"x"}


def test_idle_slices_go_back_to_whole_gpus_for_waiting_training_keeping_one_warm() -> None:
    gpus = [mig("n1", 0, ("7g.80gb", 0, None)), mig("n1", 1, ("3g.40gb", 0, None)), whole("n1", 2, "busy")]
    plan = plan_mig(gpus, [train("t", 3)], ADVISE, NOW)   # 3 GPUs on n1 cannot be had now: gather
    (proposal,) = plan.proposals
    assert proposal.key == ("n1", 0) and proposal.target is None and "slices unused" in proposal.reason
    assert proposal.enables == () and "(t)" in proposal.reason
    assert plan_mig(gpus, [train("t", 3), small("a", "3g.40gb")], ADVISE, NOW).proposals == ()  # 3g used, 7g warm


def test_right_sizing_from_observed_peak_memory() -> None:
    job = small("a", "3g.40gb", "2g.20gb", "1g.10gb", peak=6000)
    assert planned_profile(job, MIG_H100_80GB, 1.2) == "1g.10gb"
    assert planned_profile(small("b", "3g.40gb", "1g.10gb"), MIG_H100_80GB, 1.2) == "3g.40gb"  # no history
    assert planned_profile(small("c", "3g.40gb", "1g.10gb", peak=30000), MIG_H100_80GB, 1.2) == "3g.40gb"
    plan = plan_mig([whole("n1", 0)], [job], ADVISE, NOW)
    assert plan.right_sized == (("a", "3g.40gb", "1g.10gb"),)


def test_hysteresis_and_the_cap_hold_a_gpu_back() -> None:
    queue = [small("a")]
    recent = plan_mig([whole("n1", 0, reconfigured_at=(NOW - 60,))], queue, ADVISE, NOW)
    assert recent.proposals == () and "hysteresis" in recent.held_back[0][2]
    capped = plan_mig([whole("n1", 0, reconfigured_at=(NOW - 3000, NOW - 2000))], queue, ADVISE, NOW)
    assert capped.proposals == () and "cap" in capped.held_back[0][2]
    # a whole GPU is sliced only if the cap leaves room to make it whole again within the hour
    once = plan_mig([whole("n1", 0, reconfigured_at=(NOW - 2000,))], queue, ADVISE, NOW)
    assert once.proposals == ()
    assert plan_mig([whole("n1", 0, reconfigured_at=(NOW - 4000, NOW - 3700))], queue, ADVISE, NOW).proposals


def test_a_busy_gpu_is_never_changed_beyond_the_drain_limit() -> None:
    gpus = [mig("n1", 0, *((("1g.10gb", s, f"r{s}")) for s in range(6)))]
    plan = plan_mig(gpus, [small("a", "3g.40gb")], ADVISE, NOW)
    assert plan.proposals == () and plan.unmet[0][0] == "a"


def test_the_warm_pool_slices_an_idle_whole_gpu_from_recent_demand_not_one_training_gathers() -> None:
    gpus = [whole("n1", 0), whole("n1", 1), whole("n2", 0, "busy"), whole("n2", 1)]
    demand = [(NOW - 600, 4), (NOW - 60, 9)]
    plan = plan_mig(gpus, [train("t", 2, waiting=0.0)], PlannerSettings(mode="auto"), NOW, demand=demand)
    # t (2 GPUs, waiting) gathers n1's two free GPUs: the pool takes n2's free GPU, twice: 9 slices need 2 GPUs
    # of 7, but only one is free there and n1's are reserved
    (proposal,) = plan.proposals
    assert proposal.key == ("n2", 1) and proposal.current is None and proposal.enables == ()
    assert sorted(s.profile for s in proposal.target or ()) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    assert "warm pool" in proposal.reason
    # no samples in the window: no pool
    assert plan_mig(gpus, [], PlannerSettings(mode="auto"), NOW, demand=[(NOW - 7200, 9)]).proposals == ()


def test_pool_target_is_a_percentile_of_the_window_and_slice_demand_counts_held_and_waiting() -> None:
    knobs = PlannerSettings(pool_percentile=50, pool_factor=1.5, pool_margin_slices=2, pool_window_s=1000)
    assert pool_target([(NOW - 2000, 100), (NOW - 10, 2), (NOW - 5, 4), (NOW, 8)], knobs, NOW) == 4 * 1.5 + 2
    assert pool_target([], knobs, NOW) is None
    assert slice_demand(["3g.40gb", "1g.10gb"], [small("a", "2g.20gb"), train("t", 2)], MIG_H100_80GB, 1.2) == 6


def test_idle_mig_gpus_go_back_whole_only_past_the_pool_with_hysteresis() -> None:
    gpus = [mig("n1", i, ("3g.40gb", 4, None), ("2g.20gb", 2, None), ("1g.10gb", 0, None), ("1g.10gb", 1, None))
            for i in range(3)]  # 21 compute slices, idle
    knobs = PlannerSettings(mode="auto", pool_release_slices=7)
    # pool 7: 21 - 7 = 14 >= 7 + 7, so one GPU goes back; a second would leave 7 < 14
    assert len(plan_mig(gpus, [], knobs, NOW, demand=[(NOW, 7)]).proposals) == 1
    # a whole-GPU job waits unmet: no hysteresis margin, two go back (7 slices stay for the pool)
    assert len(plan_mig(gpus, [train("t", 8)], knobs, NOW, demand=[(NOW, 7)]).proposals) == 2
    assert plan_mig(gpus, [], knobs, NOW, demand=[(NOW, 14)]).proposals == ()


def test_a_short_pool_claims_the_busy_whole_gpu_that_frees_soonest_within_the_window() -> None:
    gpus = [whole("n1", 0, "long"), whole("n1", 1, "soon"), whole("n1", 2, "later")]
    ends = {"long": 5000.0, "soon": 100.0, "later": 600.0}
    knobs = PlannerSettings(mode="auto", pool_claims_busy_within_s=900.0)
    (proposal,) = plan_mig(gpus, [], knobs, NOW, demand=[(NOW, 5)], ends_in=ends).proposals
    assert proposal.key == ("n1", 1) and proposal.drains == ("soon",) and "warm pool" in proposal.reason
    assert plan_mig(gpus, [], PlannerSettings(mode="auto", pool_claims_busy_within_s=50.0), NOW,
                    demand=[(NOW, 5)], ends_in=ends).proposals == ()
    assert plan_mig(gpus, [], PlannerSettings(mode="auto"), NOW, demand=[(NOW, 5)], ends_in=ends).proposals == ()
    # the GPU claimed a plan ago is still draining (not in service): its slices count, no second claim
    draining = [gpus[0], gpus[2]]
    assert plan_mig(draining, [], knobs, NOW, demand=[(NOW, 5)], ends_in=ends, under_way=7).proposals == ()
    (again,) = plan_mig(draining, [], knobs, NOW, demand=[(NOW, 5)], ends_in=ends).proposals
    assert again.key == ("n1", 2)  # without counting it, the planner claims one more


def test_a_protected_pool_is_not_turned_whole_for_training_only_what_is_above_it() -> None:
    gpus = [mig("n1", i, ("7g.80gb", 0, None)) for i in range(2)]
    knobs = PlannerSettings(mode="auto", pool_release_slices=0)
    # t needs both GPUs (14 slices) but only 7 are above the pool: unmet; the idle GPU above the pool goes whole
    plan = plan_mig(gpus, [train("t", 2)], knobs, NOW, demand=[(NOW, 7)])
    (proposal,) = plan.proposals
    assert proposal.enables == () and "pool" in dict(plan.unmet)["t"]
    (proposal,) = plan_mig(gpus, [train("t", 1)], knobs, NOW, demand=[(NOW, 7)]).proposals
    assert proposal.target is None and proposal.enables == ("t",)
    unprotected = PlannerSettings(mode="auto", pool_protected=False)
    assert len(plan_mig(gpus, [train("t", 2)], unprotected, NOW, demand=[(NOW, 7)]).proposals) == 2


def test_whole_gpu_demand_takes_the_mig_gpu_that_frees_soonest() -> None:
    gpus = [mig("n1", 0, ("7g.80gb", 0, "long")), mig("n1", 1, ("7g.80gb", 0, "batch"))]
    plan = plan_mig(gpus, [train("t", 1, waiting=0.0)], ADVISE, NOW, ends_in={"long": 1800.0, "batch": 30.0})
    (proposal,) = plan.proposals
    assert proposal.key == ("n1", 1) and proposal.drains == ("batch",) and proposal.target is None


# -- properties ---------------------------------------------------------------------------------------------------

PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


@st.composite
def gpu_states(draw, node: str, index: int) -> GpuState:
    recent = tuple(NOW - draw(st.floats(0, 2 * HOUR_S)) for _ in range(draw(st.integers(0, 3))))
    if draw(st.booleans()):
        jobs = (f"w-{node}-{index}",) if draw(st.booleans()) else ()
        return whole(node, index, *jobs, reconfigured_at=recent)
    layout: list[Slot] = []
    for name in draw(st.lists(st.sampled_from(PROFILES), max_size=7)):
        spec = next(p for p in MIG_H100_80GB if p.name == name)
        start = draw(st.sampled_from(spec.starts))
        if layout_refusal(MIG_H100_80GB, [*layout, Slot(name, start)]) is None:
            layout.append(Slot(name, start))
    instances = tuple((s.profile, s.start, f"m-{node}-{index}-{s.start}" if draw(st.booleans()) else None)
                      for s in layout)
    return mig(node, index, *instances, reconfigured_at=recent)


@st.composite
def scenarios(draw):
    gpus = [draw(gpu_states(f"n{n}", i)) for n in range(draw(st.integers(1, 3))) for i in range(draw(st.integers(1, 3)))]
    queue = []
    for k in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 3)) == 0:
            queue.append(train(f"t{k}", draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.floats(0, 600))))
        else:
            queue.append(small(f"s{k}", *draw(st.lists(st.sampled_from(PROFILES), min_size=1, max_size=3, unique=True)),
                               peak=draw(st.none() | st.integers(1000, 80000)), waiting=draw(st.floats(0, 600))))
    running = sorted({j for g in gpus for j in g.running_jobs()})
    drained = frozenset(draw(st.lists(st.sampled_from(running), unique=True)) if running else [])
    knobs = PlannerSettings(mode="auto", max_per_hour=draw(st.integers(1, 3)), max_drain_jobs=draw(st.integers(0, 3)),
                            min_interval_s=draw(st.sampled_from([0.0, 600.0])),
                            slice_gathered_after_s=draw(st.sampled_from([None, 300.0])),
                            pool_margin_slices=draw(st.integers(0, 7)), pool_release_slices=draw(st.integers(0, 14)),
                            pool_protected=draw(st.booleans()),
                            pool_claims_busy_within_s=draw(st.sampled_from([None, 900.0])))
    demand = [(NOW - draw(st.floats(0, 3600)), draw(st.integers(0, 40))) for _ in range(draw(st.integers(0, 4)))]
    ends_in = {j: draw(st.floats(0, 7200)) for j in running if draw(st.booleans())}
    return gpus, queue, drained, knobs, demand, ends_in


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_plans_are_valid_disturb_only_what_they_drain_and_respect_caps(scenario) -> None:
    gpus, queue, drained, knobs, demand, ends_in = scenario
    plan = plan_mig(gpus, queue, knobs, NOW, drained, demand, ends_in)
    by_key = {g.key: g for g in gpus}
    target = pool_target(demand, knobs, NOW)
    assert len({p.key for p in plan.proposals}) == len(plan.proposals)  # one proposal per GPU
    for proposal in plan.proposals:
        gpu = by_key[proposal.key]
        # valid under NVIDIA's rules (profiles, placements, memory and compute slices, instance counts)
        if proposal.target is not None:
            assert layout_refusal(mig_table_for(gpu.model), proposal.target) is None
        assert proposal.target != proposal.current
        # no running instance destroyed unless its job was drained or the proposal waits for it
        running = set(gpu.running_jobs(drained))
        assert running == set(proposal.drains) and len(running) <= knobs.max_drain_jobs
        assert not set(proposal.drains) & drained
        # the cap (counting this change) and hysteresis
        assert sum(1 for t in gpu.reconfigured_at if NOW - t < HOUR_S) + 1 <= knobs.max_per_hour
        assert not gpu.reconfigured_at or NOW - max(gpu.reconfigured_at) >= knobs.min_interval_s
        # it serves someone that waited out the batching window, or turns idle slices whole while whole-GPU
        # jobs wait (and no MIG job does)
        assert all(any(j.job_id == e and j.waiting_s >= (knobs.min_pending_whole_s if j.whole_gpus
                                                        else knobs.min_pending_s) for j in queue)
                   for e in proposal.enables)
        if not proposal.enables and proposal.target is None:  # idle slices back to a whole GPU
            assert not proposal.drains and "slices unused" in proposal.reason
            assert any(j.whole_gpus and j.job_id in {u for u, _ in plan.unmet} for j in queue) or (
                target is not None and "pool" in proposal.reason)
        elif not proposal.enables:  # the warm pool grows: from a free whole GPU, or a busy one whose work is
            # expected to end within the claim window (its jobs drained first)
            assert target is not None and gpu.layout is None and "warm pool" in proposal.reason
            if proposal.drains:
                assert knobs.pool_claims_busy_within_s is not None
                assert all(ends_in.get(j, HOUR_S) <= knobs.pool_claims_busy_within_s for j in proposal.drains)
        # a whole GPU is partitioned only when it is free, or claimed for the pool
        if gpu.layout is None and proposal.target is not None and proposal.drains:
            assert not proposal.enables and "warm pool" in proposal.reason
    # unless inference waited long enough to slice gathered GPUs, the last free whole GPU a waiting 1-GPU whole
    # job could take is never sliced
    unmet = {j for j, _ in plan.unmet}
    if knobs.slice_gathered_after_s is None and any(
            j.whole_gpus == 1 and j.nodes == 1 and (j.job_id in unmet or j.waiting_s < knobs.min_pending_s)
            for j in queue):
        free_whole = [g.key for g in gpus if g.in_service and g.layout is None and not g.running_jobs(drained)]
        sliced = {p.key for p in plan.proposals if p.current is None and p.target is not None}
        assert not free_whole or set(free_whole) - sliced
    served = {e for p in plan.proposals for e in p.enables}
    assert not served & {j for j, _ in plan.unmet}
    # a protected pool: MIG GPUs turned whole never take the MIG capacity below the pool (nor below what there was,
    # when short of it); re-laying a MIG GPU for waiting MIG jobs may change its compute slices
    if target is not None and knobs.pool_protected:
        def capacity(layouts) -> int:
            sizes = {p.name: p.compute_slices for p in MIG_H100_80GB}
            return sum(sizes[s.profile] for layout in layouts for s in layout or ())
        before = {g.key: g.layout for g in gpus if g.in_service}
        after = {**before, **{p.key: p.target for p in plan.proposals if p.target is None}}
        assert capacity(after.values()) >= min(target, capacity(before.values()))
