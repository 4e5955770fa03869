"""On a real GPU node: two share jobs on one GPU; the one allocating past its share is stopped, the other runs on.

Plain CUDA through ``ctypes`` on the driver library (``libcuda.so.1``): no torch needed. Skipped where there is no
NVIDIA driver. Never starts, stops or configures MPS: where the node's MPS daemon already runs, the greedy job's own
allocation fails under ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (a ``gpu_oom``) instead of the watchdog stopping it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from gpuorch_contracts import GpuAllocation, GpuRequest, JobFailed, JobFinished, JobSpec, LaunchJob, ProcessRun

from gpuorch_executor.gpu_memory import NvmlGpuMemory

from .conftest import NODE, Harness, terminal
from .test_gpu import gpu_uuids

pytestmark = pytest.mark.gpu

SHARE_MIB = 2048

ALLOCATE = """
import ctypes, sys, time
mib, seconds = int(sys.argv[1]), float(sys.argv[2])
cuda = ctypes.CDLL("libcuda.so.1")
def check(result, what):
    if result != 0:
        print(("CUDA_ERROR_OUT_OF_MEMORY" if result == 2 else f"CUDA error {result}") + f" in {what}", flush=True)
        sys.exit(3)
check(cuda.cuInit(0), "cuInit")
device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20)), "cuMemAlloc")
print(f"holding {mib} MiB", flush=True)
time.sleep(seconds)
"""


def share_job(gpu: str, allocate_mib: int, seconds: float) -> LaunchJob:
    spec = JobSpec(run=ProcessRun(argv=["python", "-c", ALLOCATE, str(allocate_mib), str(seconds)]),
                   resources=GpuRequest(gpu_milli=250, gpu_memory_mib=SHARE_MIB))
    return LaunchJob(node_id=NODE, job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=spec,
                     gpus=[GpuAllocation(gpu_uuid=gpu, gpu_index=0, milli=250, memory_mib=SHARE_MIB)])


async def test_the_share_allocating_past_its_memory_is_stopped_and_its_neighbour_keeps_running(
        tmp_path: Path) -> None:
    gpu = gpu_uuids()[0]
    import pynvml

    pynvml.nvmlInit()
    harness = Harness(tmp_path / "state", gpu_memory=NvmlGpuMemory(pynvml), share_sustain_s=1.0,
                      share_sample_s=0.2)
    greedy = share_job(gpu, 4 * SHARE_MIB, 60)  # four times its share, with its context on top
    neighbour = share_job(gpu, 64, 8)  # its context and 64 MiB: well inside its share
    await harness.executor.handle(neighbour)
    await harness.executor.handle(greedy)
    record = harness.executor.records[greedy.placement_id]
    log = Path(record.log_path or "")
    await harness.until(lambda: "holding" in log.read_text() or bool(terminal(harness.publisher, greedy.placement_id)),
                        timeout_s=60)
    if not terminal(harness.publisher, greedy.placement_id):
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
        if record.job_pid not in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}:
            pytest.skip("NVML reports other pids than ours here (a container's pid namespace): nothing to watch")
    outcome = await harness.until_ended(greedy.placement_id)
    assert isinstance(outcome, JobFailed), outcome
    if outcome.stop_reason is None:  # an MPS daemon runs here: the driver refused the allocation itself
        assert outcome.cause == "gpu_oom", outcome
    else:
        assert outcome.stop_reason == "gpu_memory_exceeded" and outcome.reason.startswith("gpu_memory_exceeded: used")
        assert (outcome.gpu_memory_peak_mib or 0) > SHARE_MIB
    assert harness.executor.records[neighbour.placement_id].state == "running"
    assert isinstance(await harness.until_ended(neighbour.placement_id), JobFinished)
