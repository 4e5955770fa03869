"""On a real GPU node: a job sees exactly the GPUs it was given, through CUDA's own device count."""

from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import pytest
from gpuorch_contracts import GpuAllocation, JobFinished, JobStarted

from gpuorch_executor.backends.devices import DeviceConfinement, GpuDeviceNodes
from gpuorch_executor.backends.mig_devices import MigCapabilities, read_mig_instances
from gpuorch_executor.backends.process import ProcessBackend

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


OPEN_CAPS = """
import json, sys
out = {}
for path in sys.argv[1:]:
    try:
        open(path, "rb").close()
        out[path] = "open"
    except PermissionError:
        out[path] = "denied"
    except OSError as exc:
        out[path] = type(exc).__name__
print(json.dumps(out), flush=True)
"""


async def test_a_mig_job_is_denied_the_other_slices_capability_nodes(tmp_path: Path) -> None:
    """On a node whose GPUs are already in MIG mode with two or more instances (tests never change MIG mode): the
    job given one slice opens its own GPU and compute instance capability nodes and is refused every other one."""
    gpu_uuids()
    located = read_mig_instances()
    caps = MigCapabilities(read_mig_instances)
    if len(located) < 2 or not caps.available:
        pytest.skip("needs a GPU already in MIG mode with 2+ instances and /dev-based capabilities")
    devices = GpuDeviceNodes.discover()
    confinement = DeviceConfinement.detect("auto", devices)
    if confinement.cgroup is None:
        pytest.skip(f"no device controller here: {confinement.why_not}")
    instances = caps.instances()
    mine = located[0]
    index = next(i for i, uuid in enumerate(devices.by_index)
                 if devices.nodes[uuid] == (f"/dev/nvidia{mine.gpu_minor}",))
    existing = [node for node in caps.all_nodes() if Path(node).exists()]
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(None, confinement)})
    command = launch_job(["python", "-c", OPEN_CAPS, *existing])
    command = command.model_copy(update={"gpus": [GpuAllocation(gpu_uuid=mine.uuid, gpu_index=index,
                                                                mig_profile="1g.10gb")]})
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    seen = json.loads(Path(started.log_path or "").read_text().strip().splitlines()[-1])
    others = [node for node in existing if node not in instances[mine.uuid]]
    assert others and all(seen[node] == "denied" for node in others)
