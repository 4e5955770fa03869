"""The process backend with real processes: launch, finish, stop, checkpoint, max runtime, classification."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpuorch_contracts import Checkpoint, JobCheckpointed, JobFailed, JobFinished, JobLost, JobStarted, StopJob
from gpuorch_messaging import PublishError
from gpuorch_messaging.testing import RecordingPublisher

from gpuorch_executor.domain.lifecycle import event_id
from gpuorch_executor.domain.placement import PlacementRecord

from .conftest import NODE, Harness, launch_job, terminal

PRINT_ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ["
             "'CUDA_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES', 'GPUORCH_JOB_ID', 'GPUORCH_PLACEMENT_ID', "
             "'GPUORCH_CHECKPOINT_FILE', 'GPUORCH_GANG_RANK', 'GPUORCH_GANG_SIZE', 'MY_VAR', 'GPUORCH_AMQP_URL']}))")

# Writes the checkpoint confirmation when it gets SIGUSR1, then exits 0.
CHECKPOINTING_JOB = """
import os, signal, sys, time
def on_signal(signum, frame):
    open(os.environ['GPUORCH_CHECKPOINT_FILE'], 'w').write('step=42')
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_signal)
print('ready', flush=True)
while True:
    time.sleep(0.05)
"""
IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print('ready', flush=True)
while True:
    time.sleep(0.05)
"""


def log_text(started: JobStarted) -> str:
    assert started.log_path is not None
    return Path(started.log_path).read_text()


async def test_launch_runs_the_job_with_its_gpus_and_reports_its_exit(harness: Harness) -> None:
    gpus = ["GPU-11111111-2222-3333-4444-555555555555", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]
    command = launch_job(["python", "-c", PRINT_ENV], gpus=gpus, env={"MY_VAR": "hello",
                                                                     "CUDA_VISIBLE_DEVICES": "all"})
    os.environ["GPUORCH_AMQP_URL"] = "amqp://secret@broker/"
    try:
        await harness.executor.handle(command)
    finally:
        del os.environ["GPUORCH_AMQP_URL"]
    [started] = harness.publisher.of_type(JobStarted)
    assert started.placement_id == command.placement_id and started.node_id == NODE
    assert started.pid is not None and started.pid > 0
    assert started.message_id == event_id(command.placement_id, "started", command.node_id)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    assert outcome.exit_code == 0 and outcome.duration_s > 0
    assert outcome.message_id == event_id(command.placement_id, "outcome", command.node_id)
    seen = json.loads(log_text(started).strip().splitlines()[-1])
    assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(gpus)  # the spec's env cannot widen GPU visibility
    assert seen["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpus)
    assert seen["GPUORCH_JOB_ID"] == str(command.job_id)
    assert seen["GPUORCH_PLACEMENT_ID"] == str(command.placement_id)
    assert seen["GPUORCH_CHECKPOINT_FILE"].endswith("/checkpoint/confirmed")
    assert (seen["GPUORCH_GANG_RANK"], seen["GPUORCH_GANG_SIZE"]) == ("0", "1")
    assert seen["MY_VAR"] == "hello"
    assert seen["GPUORCH_AMQP_URL"] is None  # the executor's own environment does not leak into jobs
    assert started.log_path.endswith(f"logs/{command.job_id}/{command.placement_id}.log")


async def test_cpu_only_job_sees_no_gpu(harness: Harness) -> None:
    command = launch_job(["python", "-c", PRINT_ENV])
    await harness.executor.handle(command)
    await harness.until_ended(command.placement_id)
    seen = json.loads(log_text(harness.publisher.of_type(JobStarted)[0]).strip())
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["NVIDIA_VISIBLE_DEVICES"] == "void"


async def test_job_runs_in_its_own_process_group_and_workdir(harness: Harness, tmp_path: Path) -> None:
    script = "import os; print(os.getpgid(0) == os.getpid(), os.getcwd())"
    command = launch_job(["python", "-c", script], workdir=str(tmp_path))
    await harness.executor.handle(command)
    await harness.until_ended(command.placement_id)
    assert log_text(harness.publisher.of_type(JobStarted)[0]).strip() == f"True {tmp_path}"


async def test_redelivered_launch_starts_nothing(harness: Harness, tmp_path: Path) -> None:
    marker = tmp_path / "runs"
    script = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(0.3)"
    command = launch_job(["python", "-c", script])
    await harness.executor.handle(command)
    await harness.executor.handle(command)  # redelivered while it runs
    outcome = await harness.until_ended(command.placement_id)
    await harness.executor.handle(command)  # redelivered after it ended
    await harness.until(lambda: True)
    assert isinstance(outcome, JobFinished)
    assert marker.read_text() == "x"
    assert len(harness.publisher.of_type(JobStarted)) == 1
    assert len(terminal(harness.publisher, command.placement_id)) == 1


async def test_redelivery_after_a_lost_confirm_republishes_with_the_same_id(harness: Harness) -> None:
    command = launch_job(["python", "-c", "import time; time.sleep(5)"])
    await harness.executor.handle(command)
    record = harness.executor.records[command.placement_id]
    record.outbox = [harness.publisher.of_type(JobStarted)[0].model_dump(mode="json")]  # as if unconfirmed
    await harness.executor.handle(command)
    first, second = harness.publisher.of_type(JobStarted)
    assert first == second
    assert len([p for p in psutil.process_iter(["cmdline"])
                if str(command.placement_id) in " ".join(p.info["cmdline"] or [])]) == 1  # one supervisor


async def test_stop_sends_checkpoint_signal_and_reports_confirmation(harness: Harness) -> None:
    command = launch_job(["python", "-c", CHECKPOINTING_JOB], checkpoint=Checkpoint(signal="SIGUSR1", grace_s=30))
    await harness.executor.handle(command)
    started = harness.publisher.of_type(JobStarted)[0]
    await harness.until(lambda: "ready" in log_text(started))
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id,
                                          reason="preempt"))
    outcome = await harness.until_ended(command.placement_id)
    [checkpointed] = harness.publisher.of_type(JobCheckpointed)
    assert checkpointed.placement_id == command.placement_id
    published = [m.TYPE for _, _, m in harness.publisher.published]
    assert published.index("job.checkpointed") < published.index("job.failed")
    assert isinstance(outcome, JobFailed)
    assert outcome.cause == "killed" and outcome.exit_code == 0
    assert "preempt" in outcome.reason and "checkpoint confirmed" in outcome.reason
    assert outcome.stop_reason == "preempt"
    assert not harness.executor.records[command.placement_id].stop.killed  # it left before the grace ran out


async def test_stop_kills_the_process_group_when_the_grace_expires(harness: Harness) -> None:
    child = "import time; time.sleep(60)"
    script = IGNORES_SIGTERM.replace("print('ready'", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                                     f"'-c', {child!r}]); print('ready'")
    command = launch_job(["python", "-c", script])
    await harness.executor.handle(command)
    started = harness.publisher.of_type(JobStarted)[0]
    await harness.until(lambda: "ready" in log_text(started))
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == started.pid]
    assert len(group) == 2  # the job and its child
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id,
                                          reason="cancel", grace_s=0.3))
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed"
    assert "SIGKILL" in outcome.reason and "cancel" in outcome.reason
    assert not harness.publisher.of_type(JobCheckpointed)
    await harness.until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group))


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


async def test_max_runtime_stops_the_job(harness: Harness) -> None:
    command = launch_job(["python", "-c", "import time; time.sleep(60)"], max_runtime_s=0.3,
                         checkpoint=Checkpoint(grace_s=5))
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "max_runtime"
    assert outcome.stop_reason == "max_runtime"
    assert "SIGTERM" in outcome.reason  # the checkpoint signal ended it, within its grace


@pytest.mark.parametrize(("argv", "cause", "exit_code", "words"), [
    (["python", "-c", "import sys; sys.exit(3)"], "nonzero_exit", 3, "exited 3"),
    (["python", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], "killed", 128 + 11, "SIGSEGV"),
    (["python", "-c", "import sys; print('RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB', "
                      "file=sys.stderr); sys.exit(1)"], "gpu_oom", 1, "GPU out of memory"),
    (["python", "-c", "import sys; print('CUDA_ERROR_OUT_OF_MEMORY'); sys.exit(1)"], "gpu_oom", 1, "GPU"),
])
async def test_failures_are_classified(harness: Harness, argv: list[str], cause: str, exit_code: int,
                                       words: str) -> None:
    command = launch_job(argv)
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed)
    assert (outcome.cause, outcome.exit_code) == (cause, exit_code)
    assert outcome.stop_reason is None  # it ended by itself
    assert words in outcome.reason


async def test_a_job_killed_from_outside_is_reported_killed(harness: Harness) -> None:
    command = launch_job(["python", "-c", "print('ready', flush=True); import time; time.sleep(60)"])
    await harness.executor.handle(command)
    started = harness.publisher.of_type(JobStarted)[0]
    await harness.until(lambda: "ready" in log_text(started))
    os.kill(started.pid, signal.SIGKILL)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed" and outcome.exit_code == 137


async def test_exec_failure_is_a_launch_error(harness: Harness, tmp_path: Path) -> None:
    command = launch_job(["python", "-c", "pass"], workdir=str(tmp_path / "missing"))
    await harness.executor.handle(command)
    [outcome] = terminal(harness.publisher, command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "launch_error"
    assert "missing" in outcome.reason
    assert not harness.publisher.of_type(JobStarted)


@pytest.mark.parametrize(("argv", "tenant", "words"), [
    (["sh", "-c", "echo hi"], "shells", "inline code"),
    (["bash", "-lc", "echo hi"], "default", "not allowed"),
    (["python -c 'print(1)'"], "default", "shell string"),
    (["perl", "-e", "print 1"], "default", "not allowed"),
    (["python", "-c", "pass"], "nobody", "may not run anything"),
])
async def test_refused_launch_reports_why_and_the_executor_keeps_working(
    harness: Harness, argv: list[str], tenant: str, words: str
) -> None:
    refused = launch_job(argv, tenant=tenant)
    await harness.executor.handle(refused)
    [outcome] = terminal(harness.publisher, refused.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "refused" and words in outcome.reason
    assert not harness.publisher.of_type(JobStarted)
    await harness.executor.handle(refused)  # redelivered: still one refusal, nothing started
    assert len(terminal(harness.publisher, refused.placement_id)) == 1
    allowed = launch_job(["python", "-c", "print(42)"])
    await harness.executor.handle(allowed)
    assert isinstance(await harness.until_ended(allowed.placement_id), JobFinished)
    assert log_text(harness.publisher.of_type(JobStarted)[0]).strip() == "42"


async def test_a_shell_running_a_script_file_is_allowed_when_listed(harness: Harness, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("echo from-script\n")
    command = launch_job(["sh", str(script)], tenant="shells")
    await harness.executor.handle(command)
    assert isinstance(await harness.until_ended(command.placement_id), JobFinished)


async def test_stop_before_launch_means_the_launch_never_runs(harness: Harness) -> None:
    command = launch_job(["python", "-c", "pass"])
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id))
    await harness.executor.handle(command)
    [outcome] = terminal(harness.publisher, command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed" and outcome.stop_reason == "cancel"
    assert not harness.publisher.of_type(JobStarted)


async def test_reconcile_adopts_running_jobs_and_reports_those_that_ended(tmp_path: Path) -> None:
    first = Harness(tmp_path / "state")
    quick = launch_job(["python", "-c", "import time; time.sleep(0.2); raise SystemExit(4)"])
    slow = launch_job(["python", "-c", "print('ready', flush=True); import time; time.sleep(0.8)"])
    await first.executor.handle(quick)
    await first.executor.handle(slow)
    # The first executor is dropped here without watching anything: its jobs end or run without it.
    second = Harness(tmp_path / "state")
    await second.until(lambda: (Path(first.executor.store.placement_dir(quick.placement_id)) / "exit.json").exists())
    counts = await second.executor.reconcile()
    assert counts["ended"] == 1 and counts["adopted"] == 1
    [quick_outcome] = terminal(second.publisher, quick.placement_id)
    assert isinstance(quick_outcome, JobFailed) and quick_outcome.exit_code == 4
    slow_outcome = await second.until_ended(slow.placement_id)
    assert isinstance(slow_outcome, JobFinished)
    assert not second.publisher.of_type(JobStarted)  # both were already reported started


async def test_a_reused_pid_is_not_adopted_and_never_signalled(harness: Harness) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        command = launch_job(["python", "-c", "pass"])
        real_start = psutil.Process(stranger.pid).create_time()
        record = PlacementRecord(
            placement_id=command.placement_id, job_id=command.job_id, node_id=NODE, state="running",
            launch=command, supervisor_pid=stranger.pid, supervisor_create_time=real_start - 100,
            job_pid=stranger.pid, job_create_time=real_start - 100, started_at=real_start - 100,
        )
        harness.executor.store.save(record)
        counts = await harness.executor.reconcile()
        assert counts["adopted"] == 0
        [outcome] = terminal(harness.publisher, command.placement_id)
        assert isinstance(outcome, JobLost) and "vanished" in outcome.reason
        await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id,
                                              placement_id=command.placement_id, grace_s=0))
        assert stranger.poll() is None  # the process that merely reuses the pid was left alone
    finally:
        stranger.kill()
        stranger.wait()


async def test_fence_stops_every_job_and_reports_them_lost(harness: Harness) -> None:
    import time

    commands = [launch_job(["python", "-c", IGNORES_SIGTERM]) for _ in range(2)]
    for command in commands:
        await harness.executor.handle(command)
    assert await harness.executor.fence(time.monotonic() + 0.3) == 2
    for command in commands:
        outcome = await harness.until_ended(command.placement_id)
        assert isinstance(outcome, JobFailed) and outcome.cause == "lost" and "fenced" in outcome.reason
        assert outcome.stop_reason == "fenced"


async def test_the_record_on_disk_follows_the_lifecycle(harness: Harness) -> None:
    command = launch_job(["python", "-c", "pass"])
    await harness.executor.handle(command)
    await harness.until_ended(command.placement_id)
    stored = harness.executor.store.load(command.placement_id)
    assert stored is not None and stored.state == "ended" and stored.outbox == []
    assert stored.outcome_type == "job.finished"


def test_unknown_placement_id_has_no_record(harness: Harness) -> None:
    assert harness.executor.store.load(uuid.uuid4()) is None


async def test_a_launch_recorded_but_never_started_is_started_by_the_redelivery(harness: Harness) -> None:
    command = launch_job(["python", "-c", "print('once')"])
    # The executor died after making the record durable and before starting the supervisor.
    record = PlacementRecord(placement_id=command.placement_id, job_id=command.job_id, node_id=NODE,
                             launch=command, log_path=str(harness.executor.store.log_path(command.job_id,
                                                                                          command.placement_id)))
    harness.executor.store.save(record)
    counts = await harness.executor.reconcile()
    assert counts["forgotten"] == 1 and not harness.publisher.published
    await harness.executor.handle(command)  # the LaunchJob was never acked: it comes again
    assert isinstance(await harness.until_ended(command.placement_id), JobFinished)
    assert len(harness.publisher.of_type(JobStarted)) == 1


async def test_a_job_whose_supervisor_died_is_watched_then_reported_lost(harness: Harness) -> None:
    command = launch_job(["python", "-c", "print('ready', flush=True); import time; time.sleep(60)"])
    await harness.executor.handle(command)
    started = harness.publisher.of_type(JobStarted)[0]
    record = harness.executor.records[command.placement_id]
    assert record.supervisor_pid is not None
    os.kill(record.supervisor_pid, signal.SIGKILL)
    await harness.until(lambda: record.orphaned)
    assert not terminal(harness.publisher, command.placement_id)  # the job still runs: nothing to report yet
    os.kill(started.pid, signal.SIGKILL)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobLost) and "supervisor died" in outcome.reason


async def test_ended_placements_are_pruned_after_their_retention(harness: Harness) -> None:
    command = launch_job(["python", "-c", "pass"])
    await harness.executor.handle(command)
    await harness.until_ended(command.placement_id)
    assert harness.executor.prune() == 0  # still within its retention
    harness.executor.settings.record_retention_s = -1.0
    assert harness.executor.prune() == 1
    assert command.placement_id not in harness.executor.records
    assert harness.executor.store.load(command.placement_id) is None
    assert Path(harness.publisher.of_type(JobStarted)[0].log_path or "").exists()  # the log stays


class FlakyPublisher(RecordingPublisher):
    """Records every attempt; the first attempt at each outcome raises, as a lost confirm would."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[uuid.UUID] = set()

    async def publish(self, message: Any, *, headers: Any = None) -> None:
        await super().publish(message, headers=headers)
        if message.TYPE in ("job.finished", "job.failed") and message.message_id not in self.refused:
            self.refused.add(message.message_id)
            raise PublishError("confirm lost")


async def test_an_unconfirmed_outcome_is_published_again_with_the_same_id(harness: Harness) -> None:
    harness.publisher = harness.executor.publisher = FlakyPublisher()  # type: ignore[misc]
    command = launch_job(["python", "-c", "raise SystemExit(7)"])
    await harness.executor.handle(command)
    await harness.until(lambda: len(terminal(harness.publisher, command.placement_id)) == 2)
    first, second = terminal(harness.publisher, command.placement_id)
    assert first == second and first.exit_code == 7  # the same message: consumers dedupe it
    await harness.until(lambda: not harness.executor.records[command.placement_id].outbox)


async def test_outcomes_are_counted_for_prometheus(harness: Harness) -> None:
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("gpuorch_executor_outcomes_total",
                                         {"node_id": NODE, "outcome": "failed", "cause": "nonzero_exit"}) or 0.0

    before = count()
    command = launch_job(["python", "-c", "raise SystemExit(2)"])
    await harness.executor.handle(command)
    await harness.until_ended(command.placement_id)
    assert count() == before + 1


async def test_a_stray_sigterm_to_the_supervisor_does_not_orphan_the_job(harness: Harness) -> None:
    command = launch_job(["python", "-c", "import signal, time; print(signal.getsignal(signal.SIGTERM) == "
                                          "signal.SIG_DFL, flush=True); time.sleep(0.5)"])
    await harness.executor.handle(command)
    record = harness.executor.records[command.placement_id]
    assert record.supervisor_pid is not None
    await harness.until(lambda: bool(log_text(harness.publisher.of_type(JobStarted)[0])))
    os.kill(record.supervisor_pid, signal.SIGTERM)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)  # the supervisor stayed and reported the real exit
    assert log_text(harness.publisher.of_type(JobStarted)[0]).strip() == "True"  # the job has default handlers


async def _launch_cancelled_while_starting(harness: Harness, command: Any) -> PlacementRecord:
    """Start handling ``command`` and cancel the handler while it waits for the job to start, as the broker
    adapter's delivery task is cancelled when the connection drops mid-launch."""
    handling = asyncio.create_task(harness.executor.handle(command))
    await asyncio.sleep(0)  # the handler runs up to its first wait: the supervisor is spawned, the job not started
    record = harness.executor.records[command.placement_id]
    assert record.state == "launching" and record.supervisor_pid is not None
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling
    return record


async def test_a_launch_interrupted_while_starting_is_finished_by_the_watch_loop(harness: Harness) -> None:
    command = launch_job(["python", "-c", "print('ran')"])
    await _launch_cancelled_while_starting(harness, command)
    outcome = await harness.until_ended(command.placement_id)  # no redelivery: the watch loop alone
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    assert started.placement_id == command.placement_id


async def test_a_launch_interrupted_while_starting_is_finished_by_its_redelivery(harness: Harness) -> None:
    command = launch_job(["python", "-c", "import time; time.sleep(0.5)"])
    await _launch_cancelled_while_starting(harness, command)
    await harness.executor.handle(command)  # the unacked LaunchJob comes back after the reconnect
    [started] = harness.publisher.of_type(JobStarted)  # published before the redelivery is acked
    assert started.placement_id == command.placement_id
    assert isinstance(await harness.until_ended(command.placement_id), JobFinished)
    assert len(harness.publisher.of_type(JobStarted)) == 1
    assert len([p for p in psutil.process_iter(["cmdline"])
                if str(command.placement_id) in " ".join(p.info["cmdline"] or [])]) <= 1  # one supervisor at most
