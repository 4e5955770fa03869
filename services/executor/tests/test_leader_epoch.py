"""Commands of a superseded scheduler leader are refused (``gpuorch_contracts.leader_epoch``): the rule as a table, then the
executor applying it to real launches and stops, and remembering the newest epoch across a restart."""

from __future__ import annotations

import pytest
from gpuorch_contracts import JobFailed, JobStarted, StopJob
from gpuorch_contracts.leader_epoch import judge_leader_epoch

from .conftest import NODE, Harness, launch_job, terminal


@pytest.mark.parametrize(("epoch", "newest", "admitted", "newest_after"), [
    (0, 0, True, 0),   # no epochs on either side
    (0, 7, True, 7),   # a sender without epochs is never refused and changes nothing
    (1, 0, True, 1),   # the first epoch seen
    (7, 7, True, 7),   # the current leader
    (8, 7, True, 8),   # a new leader
    (6, 7, False, 7),  # a superseded leader
])
def test_judge_leader_epoch(epoch: int, newest: int, admitted: bool, newest_after: int) -> None:
    verdict = judge_leader_epoch(epoch, newest)
    assert (verdict.admitted, verdict.newest_seen) == (admitted, newest_after)


async def test_a_command_of_an_older_leader_is_refused_and_the_newest_epoch_survives_a_restart(
    harness: Harness, tmp_path
) -> None:
    current = launch_job(["python", "-c", "import time; time.sleep(30)"]).model_copy(update={"leader_epoch": 3})
    await harness.executor.handle(current)
    await harness.until(lambda: bool(harness.publisher.of_type(JobStarted)))
    stale_launch = launch_job(["python", "-c", "pass"]).model_copy(update={"leader_epoch": 2})
    await harness.executor.handle(stale_launch)
    stale_stop = StopJob(node_id=NODE, job_id=current.job_id, placement_id=current.placement_id, grace_s=0,
                         leader_epoch=2)
    await harness.executor.handle(stale_stop)
    # the stale launch never ran; it is reported lost, for a leader that still counts on it to requeue the job
    [lost] = terminal(harness.publisher, stale_launch.placement_id)
    assert isinstance(lost, JobFailed) and lost.cause == "lost" and "epoch 2" in lost.reason
    assert stale_launch.placement_id not in {s.placement_id for s in harness.publisher.of_type(JobStarted)}
    await harness.executor.handle(stale_launch)  # a redelivery is not reported again
    assert len(terminal(harness.publisher, stale_launch.placement_id)) == 1
    assert harness.executor.records[current.placement_id].state == "running"  # the stale stop did nothing
    assert Harness(harness.state_dir).executor.newest_leader_epoch == 3  # kept in the state directory
    await harness.executor.handle(StopJob(node_id=NODE, job_id=current.job_id, placement_id=current.placement_id,
                                          grace_s=0, leader_epoch=3))
    outcome = await harness.until_ended(current.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed"
