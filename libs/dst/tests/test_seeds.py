"""The simulation as CI runs it: every invariant holds for the CI seeds; with a guard switched off the same seeds
find the violation the guard prevents; the seeds that found bugs are kept (docs/RELIABILITY.md)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
from gpuorch_dst import SimConfig, run_seed
from gpuorch_dst.cli import main, replay_command

CI_SEEDS = 200
"""Seeds run by ``make test`` (about 18 s of CPU here; ``make sim SEEDS=N`` runs more)."""


def _first_failure(config: SimConfig, seeds: range) -> int | None:
    for seed in seeds:
        if not run_seed(seed, config).ok:
            return seed
    return None


CHUNK = 50
"""Seeds per test (each well inside the per-test timeout on a busy machine)."""


@pytest.mark.parametrize("first", range(0, CI_SEEDS, CHUNK))
def test_every_invariant_holds_for_the_ci_seeds(first: int) -> None:
    outcomes = [run_seed(seed) for seed in range(first, min(first + CHUNK, CI_SEEDS))]
    failed = [o for o in outcomes if not o.ok]
    assert not failed, "\n".join(f"{o.describe()}\n  replay: {replay_command(o.seed, [])}" for o in failed)


def test_switching_off_epoch_fencing_is_caught_within_the_ci_seeds() -> None:
    """A replaced leader that wakes up between deciding a step and committing it: with neither the database's
    commit fence nor the executors' epoch check, its stale decisions land in the log beside the new leader's."""
    found = _first_failure(SimConfig().without_epoch_fencing(), range(CI_SEEDS))
    assert found is not None, "no CI seed noticed that epoch fencing was switched off"
    outcome = run_seed(found, SimConfig().without_epoch_fencing())
    assert outcome.invariant in ("the leader's state is not the fold of the log", "a job runs in two places at once",
                                 "a GPU is over-allocated"), outcome.describe()


def test_switching_off_the_commit_fence_alone_is_caught_within_the_ci_seeds() -> None:
    """The executors' epoch check does not make up for a database that takes a replaced leader's commit."""
    assert _first_failure(replace(SimConfig(), fence_commits=False), range(CI_SEEDS)) is not None


def test_a_launch_queued_for_a_lost_node_does_not_start_when_it_returns() -> None:
    """Seed 51 (regression): node-0 powered off with a LaunchJob in its queue; declared lost, the job was placed
    on node-1; when node-0 came back its executor started the queued launch: the job ran twice. Executors now
    refuse a LaunchJob decided before their last recovery (``stale_commands.predates_recovery``)."""
    without = run_seed(51, replace(SimConfig(), refuse_launches_before_recovery=False))
    assert not without.ok and without.invariant == "a job runs in two places at once", without.describe()
    assert run_seed(51).ok


def test_a_gang_whose_rank_is_lost_does_not_run_twice() -> None:
    """Seed 21 (regression; gangs are in the CI config since): a new leader (fresh lease grace) placed a two-node
    gang on node-0 and node-1 while node-1 was powered off; back, node-1's executor refused the stale launch and
    reported its rank lost; the scheduler requeued the job and placed it on node-0 and node-2 while rank 0 of the
    first placement still ran on node-0 (nothing stopped it). The scheduler now stops the other ranks and holds
    their capacity until each ended before it requeues a gang (``gpuorch_scheduling.decisions.rank_ended``)."""
    config = SimConfig()
    assert config.gang_p > 0
    outcome = run_seed(21, config)
    assert outcome.ok, outcome.describe()


def test_a_seed_replays_exactly() -> None:
    traces: list[str] = []
    for _ in range(2):
        lines: list[str] = []
        run_seed(5, trace=lines.append)
        traces.append(hashlib.sha256("\n".join(lines).encode()).hexdigest())
    assert traces[0] == traces[1]


def test_a_failing_seed_prints_the_command_that_replays_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "1", "--start", "51", "--no-launch-recovery-check"]) == 1
    err = capsys.readouterr().err
    assert "FAIL seed 51: a job runs in two places at once" in err
    assert "replay: uv run python -m gpuorch_dst --seed 51 --no-launch-recovery-check --trace" in err
