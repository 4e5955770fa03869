"""On a real GPU node: a job sees exactly the GPUs it was given, through CUDA's own device count."""

from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import pytest
from gpuorch_contracts import JobFinished, JobStarted

from .conftest import Harness, launch_job

pytestmark = pytest.mark.gpu

COUNT_CUDA_DEVICES = """
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
count = ctypes.c_int(0)
init = cuda.cuInit(0)
if init == 0:
    cuda.cuDeviceGetCount(ctypes.byref(count))
print(json.dumps({"init": init, "count": count.value}))
"""


def gpu_uuids() -> list[str]:
    try:
        ctypes.CDLL("libcuda.so.1")
        listing = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                                 text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no NVIDIA driver here")
    return [line.strip() for line in listing.splitlines() if line.strip()]


@pytest.mark.parametrize("given", [1, 0])
async def test_cuda_sees_only_the_given_gpus(harness: Harness, given: int) -> None:
    uuids = gpu_uuids()
    command = launch_job(["python", "-c", COUNT_CUDA_DEVICES], gpus=uuids[:given])
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    seen = json.loads(Path(started.log_path or "").read_text().strip().splitlines()[-1])
    assert seen["count"] == given
