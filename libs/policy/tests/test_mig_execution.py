"""The MIG execution state machine: drain, checkpoint handshake, apply, resume; failures and timeouts."""

from __future__ import annotations

from gpuorch_policy.mig_execution import (
    Alert,
    ExecutionSettings,
    MigExecution,
    Preempt,
    Resume,
    SendApplyMigLayout,
    StopPlacements,
)
from gpuorch_policy.mig_geometry import Slot
from gpuorch_policy.mig_planner import MigProposal
from hypothesis import given, settings
from hypothesis import strategies as st

KEY = ("n1", 0)
TO_SLICES = MigProposal("n1", 0, "H100-80GB", None, (Slot("3g.40gb", 0), Slot("3g.40gb", 4)), ("a", "b"), ("p",),
                        "1 waiting MIG job(s) need 3g.40gb")
KNOBS = ExecutionSettings(drain_wait_s=600, drain_give_up_s=3600, apply_timeout_s=300)


def test_happy_path_drains_preempts_after_the_wait_applies_and_resumes() -> None:
    ex = MigExecution(KNOBS)
    (stop,) = ex.start(TO_SLICES, 0)
    assert isinstance(stop, StopPlacements) and "MIG mode change" in stop.reason and ex.phase(KEY) == "draining"
    assert ex.start(TO_SLICES, 1) == []                                   # already under way
    assert ex.tick({KEY: {"a", "b"}}, {"a"}, 100) == []                   # jobs may still end on their own
    assert [a.job_id for a in ex.tick({KEY: {"a", "b"}}, {"a"}, 600) if isinstance(a, Preempt)] == ["a"]
    assert ex.tick({KEY: {"a", "b"}}, {"a"}, 700) == []                   # preempted once; b is not preemptible
    (send,) = ex.tick({KEY: set()}, set(), 900)
    assert send == SendApplyMigLayout("n1", 0, ("3g.40gb", "3g.40gb"), TO_SLICES.reason)
    assert ex.phase(KEY) == "applying"
    ex.sent(KEY, "cmd-1")
    assert ex.applied(KEY, "other", True, "", 950) == []                  # an answer to another command
    assert ex.applied(KEY, "cmd-1", True, "applied", 960) == [Resume(KEY, True, 960)]
    assert ex.phase(KEY) == "in_service"


def test_a_refused_layout_resumes_the_old_one_with_an_alert() -> None:
    ex = MigExecution(KNOBS)
    ex.start(TO_SLICES, 0)
    ex.tick({}, set(), 10)
    resume, alert = ex.applied(KEY, "cmd", False, "GPU 0 runs 1 process(es)", 20)
    assert resume == Resume(KEY, False, 20) and isinstance(alert, Alert) and "runs 1 process" in alert.message


def test_no_answer_times_out_and_a_stuck_drain_is_abandoned() -> None:
    ex = MigExecution(KNOBS)
    ex.start(TO_SLICES, 0)
    ex.tick({}, set(), 10)
    assert ex.tick({}, set(), 200) == []
    resume, alert = ex.tick({}, set(), 310)
    assert resume == Resume(KEY, False, 310) and "no answer" in alert.message
    ex.start(TO_SLICES, 400)
    resume, alert = ex.tick({KEY: {"b"}}, set(), 4000)
    assert resume == Resume(KEY, False, 4000) and "abandoned" in alert.message and ex.phase(KEY) == "in_service"


events = st.lists(st.tuples(st.sampled_from(["tick", "end", "answer", "start"]), st.floats(0, 900),
                            st.booleans()), max_size=30)


@settings(max_examples=100, deadline=None)
@given(events, st.sets(st.sampled_from(["a", "b"])))
def test_never_applies_under_running_work_never_preempts_early_and_always_resumes(script, preemptible) -> None:
    ex = MigExecution(KNOBS)
    running = {"a", "b"}
    now = 0.0
    started_at = None
    stopped = False
    preempted: list[str] = []
    for what, dt, flag in script:
        now += dt
        if what == "start":
            actions = ex.start(TO_SLICES, now)
        elif what == "tick":
            actions = ex.tick({KEY: set(running)}, preemptible, now)
        elif what == "end":
            running.discard("a" if flag else "b")
            actions = []
        else:
            actions = ex.applied(KEY, "cmd", flag, "why", now)
        for action in actions:
            if isinstance(action, StopPlacements):
                assert not stopped
                stopped, started_at = True, now
            elif isinstance(action, Preempt):
                assert action.job_id in preemptible and action.job_id in running and action.job_id not in preempted
                assert started_at is not None and now - started_at >= KNOBS.drain_wait_s
                preempted.append(action.job_id)
            elif isinstance(action, SendApplyMigLayout):
                assert not running and stopped
            elif isinstance(action, Resume):
                assert stopped
                stopped, preempted = False, []
        assert stopped == (ex.phase(KEY) != "in_service")
