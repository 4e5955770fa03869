"""The share watchdog: a share job over its GPU memory is stopped alone; its neighbour on the GPU keeps running."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

from gpuorch_contracts import GpuAllocation, GpuRequest, JobFailed, JobFinished, JobSpec, LaunchJob, ProcessRun

from gpuorch_executor.backends.base import JobLaunch
from gpuorch_executor.backends.mps import MpsControl
from gpuorch_executor.backends.process import ProcessBackend
from gpuorch_executor.domain.outcome import ExitReport, classify
from gpuorch_executor.domain.share_memory import Exceeded, ShareMemoryWatch, share_memory_limit, tolerance_mib
from gpuorch_executor.gpu_memory import DeclaredGpuMemory, NvmlGpuMemory

from .conftest import NODE, Harness

GPU = "GPU-5a4e0000-0000-0000-0000-000000000001"
SLEEP = "import time, sys; time.sleep(float(sys.argv[1]))"


def share_job(usage: str, seconds: float, resources: GpuRequest | None = None) -> LaunchJob:
    resources = resources or GpuRequest(gpu_milli=250, gpu_memory_mib=4096)
    spec = JobSpec(run=ProcessRun(argv=["python", "-c", SLEEP, str(seconds)], env={"GPUORCH_SIM_USAGE": usage}),
                   resources=resources)
    return LaunchJob(node_id=NODE, job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=spec,
                     gpus=[GpuAllocation(gpu_uuid=GPU, gpu_index=0, milli=250, memory_mib=4096)])


def test_the_rule_needs_the_share_exceeded_past_the_tolerance_for_the_sustain_time() -> None:
    watch = ShareMemoryWatch(limit_mib=4096, tolerance_mib=tolerance_mib(4096, 10), sustain_s=3.0)
    assert watch.tolerance_mib == 409
    assert watch.observe(4400, 0.0) is None  # within the tolerance
    assert watch.observe(30720, 1.0) is None  # over, not yet long
    assert watch.observe(2000, 2.0) is None  # a spike: the window starts again
    assert watch.observe(30000, 3.0) is None
    assert watch.observe(30720, 5.9) is None
    assert watch.observe(29000, 6.0) == Exceeded(30720, 4096)
    assert Exceeded(30720, 4096).reason == "gpu_memory_exceeded: used 30720 MiB of 4096"


def test_only_a_share_with_a_memory_size_has_a_limit() -> None:
    assert share_memory_limit(share_job("", 1)) == 4096
    whole = share_job("", 1, GpuRequest(gpus=1))
    mig = share_job("", 1, GpuRequest(mig_profiles=["1g.10gb"]))
    assert share_memory_limit(whole) is None and share_memory_limit(mig) is None  # hardware / nobody to protect


def test_classification_names_the_peak_and_the_share() -> None:
    outcome = classify(ExitReport(signal=15), "gpu_memory_exceeded", exceeded=Exceeded(30720, 4096))
    assert outcome.cause == "gpu_oom" and outcome.stop_reason == "gpu_memory_exceeded"
    assert outcome.reason.startswith("gpu_memory_exceeded: used 30720 MiB of 4096; stopped by the executor")
    assert outcome.gpu_memory_peak_mib == 30720


async def test_the_job_over_its_share_is_stopped_and_its_neighbour_runs_to_success(tmp_path: Path) -> None:
    harness = Harness(tmp_path / "state", gpu_memory=DeclaredGpuMemory(), share_sustain_s=0.3, share_sample_s=0.1)
    greedy = share_job("util=40,mem_mib=3000,mem_mib_from=0.5:30720", 30)  # grows past its share after 0.5 s
    neighbour = share_job("util=40,mem_mib=3000", 2.5)
    await harness.executor.handle(greedy)
    await harness.executor.handle(neighbour)
    outcome = await harness.until_ended(greedy.placement_id)
    assert isinstance(outcome, JobFailed)
    assert outcome.stop_reason == "gpu_memory_exceeded" and outcome.cause == "gpu_oom"
    assert outcome.reason.startswith("gpu_memory_exceeded: used 30720 MiB of 4096")
    assert outcome.gpu_memory_peak_mib == 30720
    assert harness.executor.records[neighbour.placement_id].state == "running"  # untouched
    assert isinstance(await harness.until_ended(neighbour.placement_id), JobFinished)


def test_a_share_starts_as_an_mps_client_with_its_limits_only_while_the_daemon_runs(tmp_path: Path) -> None:
    pipes = tmp_path / "mps"
    backend = ProcessBackend(mps=MpsControl(str(pipes)))

    def env_of(launch: LaunchJob) -> dict[str, str]:
        job = JobLaunch(launch=launch, placement_dir=tmp_path / "p", log_path=tmp_path / "log",
                        checkpoint_file=tmp_path / "ckpt", executor_env={}, executable=sys.executable)
        return backend.prepare(job).env

    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env_of(share_job("", 1))  # no daemon: the watchdog alone
    pipes.mkdir()
    os.mkfifo(pipes / "control")
    env = env_of(share_job("", 1))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipes)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env_of(share_job("", 1, GpuRequest(gpus=1)))  # whole GPU


async def test_nvml_memory_counts_only_the_jobs_own_processes(tmp_path: Path) -> None:
    class FakeNvml:
        """NVML's two calls the probe makes: the job's process and a neighbour's hold memory on the GPU."""

        def __init__(self) -> None:
            self.job_pid = 0

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802 - NVML's name
            return uuid

        def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:  # noqa: N802
            return [SimpleNamespace(pid=self.job_pid, usedGpuMemory=3000 << 20),
                    SimpleNamespace(pid=1, usedGpuMemory=30720 << 20)]

    nvml = FakeNvml()
    harness = Harness(tmp_path / "state")
    job = share_job("", 5)
    await harness.executor.handle(job)
    record = harness.executor.records[job.placement_id]
    nvml.job_pid = record.job_pid or 0
    assert NvmlGpuMemory(nvml).job_memory_mib(record) == 3000
    await harness.executor.settings.backends["process"].kill(record)
