"""The simulation's parts on their own: the executors' stale-command rules, the broker's delivery semantics, the
database's commit fence."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import CancelJob, JobAccepted, JobSpec
from gpuorch_contracts.jobs import ProcessRun
from gpuorch_dst import EpochGuard, predates_recovery, refuses
from gpuorch_dst.broker import SimBroker
from gpuorch_dst.database import CommitRefused, SimDatabase
from gpuorch_dst.loop import SimLoop
from gpuorch_scheduling.step import Step


@pytest.mark.parametrize(("epoch", "newest", "refused"), [
    (None, 5, False), (5, 5, False), (6, 5, False), (4, 5, True), (1, 0, False)])
def test_an_executor_refuses_only_older_epochs(epoch: int | None, newest: int, refused: bool) -> None:
    assert refuses(epoch, newest) is refused


def test_the_epoch_guard_remembers_the_newest_epoch_and_can_be_switched_off() -> None:
    guard = EpochGuard()
    assert guard.admit(2) and guard.admit(3) and not guard.admit(2) and guard.newest_seen == 3
    assert guard.refused == 1
    off = EpochGuard(enabled=False)
    assert off.admit(3) and off.admit(1)


@pytest.mark.parametrize(("decided", "recovered", "refused"), [
    (10.0, None, False), (10.0, 12.0, True), (12.0, 12.0, False), (13.0, 12.0, False)])
def test_a_launch_decided_before_the_last_recovery_is_refused(decided: float, recovered: float | None,
                                                               refused: bool) -> None:
    assert predates_recovery(decided, recovered) is refused


def _cancel(k: int) -> CancelJob:
    return CancelJob(message_id=uuid.UUID(int=k), job_id=uuid.UUID(int=1000 + k), reason="x")


def test_a_dropped_connection_redelivers_what_it_held_and_loses_its_acks() -> None:
    loop = SimLoop(1)
    broker = SimBroker(loop)
    for k in range(3):
        broker.publish("q", _cancel(k), publisher="p")
    loop.run_until(1.0)
    first = broker.connect()
    held = broker.take("q", first, 2)
    assert [d.message.message_id.int for d in held] == [0, 1]  # one publisher: in order
    broker.drop(first)
    broker.ack("q", held[0], first)  # too late: the connection is gone
    second = broker.connect()
    again = broker.take("q", second, 10)
    assert [(d.message.message_id.int, d.redelivered) for d in again] == [(0, True), (1, True), (2, False)]
    for delivery in again:
        broker.ack("q", delivery, second)
    assert not broker.queue("q").ready and not broker.queue("q").unacked


def test_a_latest_wins_queue_keeps_one_message_per_key() -> None:
    loop = SimLoop(1)
    broker = SimBroker(loop)
    broker.queue("beats", latest_wins=lambda m: "one")
    for k in range(3):
        broker.publish("beats", _cancel(k), publisher="p")
    loop.run_until(1.0)
    assert [d.message.message_id.int for d in broker.queue("beats").ready] == [2]


def test_the_database_refuses_a_commit_from_a_replaced_leader() -> None:
    db = SimDatabase()
    first = db.try_acquire("a", 0.0, 3.0)
    assert first == 1 and db.try_acquire("b", 1.0, 3.0) is None
    second = db.try_acquire("b", 3.5, 3.0)
    assert second == 2 and not db.renew("a", 1, 3.6, 3.0)
    step = Step(4.0, 4.0)
    spec = JobSpec(run=ProcessRun(argv=["x"]))
    step.events.append((JobAccepted(message_id=uuid.UUID(int=7), job_id=uuid.UUID(int=8), spec=spec), {}))
    with pytest.raises(CommitRefused):
        db.commit(1, step)
    assert db.log == [] and db.commit(2, step) and len(db.log) == 1
    unfenced = SimDatabase(fence_commits=False)
    unfenced.try_acquire("a", 0.0, 3.0)
    unfenced.try_acquire("b", 5.0, 3.0)
    assert unfenced.commit(1, step)  # without the fence a replaced leader's step lands in the log
