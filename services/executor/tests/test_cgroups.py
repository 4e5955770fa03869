"""cgroups v2 limits: what this machine offers is detected; the per-job files are written and read as specified.

This machine may not have a writable cgroup2 hierarchy (then detection must say so and jobs run without limits);
the per-job cgroup logic is exercised on a stand-in directory with the same file names, including the path
through the supervisor (the job moves itself into ``cgroup.procs``; ``memory.events`` ``oom_kill`` -> host_oom).
cgroup v1 ``memory`` and ``cpu`` hierarchies, where this machine has them writable, are tested against the kernel
(a real OOM kill under the limit; the job in both cgroups); elsewhere those tests skip with the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_contracts import JobFailed, JobStarted

from gpuorch_executor.backends.cgroups import CgroupV1, CgroupV2, is_cgroup2_mount
from gpuorch_executor.backends.process import ProcessBackend

from .conftest import Harness, launch_job


def test_detection_matches_this_machine(tmp_path: Path) -> None:
    root = Path("/sys/fs/cgroup/gpuorch-test-executor")
    cgroups, reason = CgroupV2.detect(root)
    if is_cgroup2_mount(Path("/sys/fs/cgroup")) and os.access("/sys/fs/cgroup", os.W_OK):
        assert cgroups is not None or "controllers" in reason or "cannot" in reason
        if cgroups is not None:
            job = cgroups.create("probe", cpu_milli=500, memory_mib=64)
            assert (job / "memory.max").read_text().strip() == str(64 * 1024 * 1024)
            assert (job / "cpu.max").read_text().split() == ["50000", "100000"]
            cgroups.remove(job)
            os.rmdir(root)
    else:
        assert cgroups is None and "cgroup2" in reason


def fake_cgroup_root(tmp_path: Path) -> Path:
    parent = tmp_path / "cgroupfs"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return parent / "gpuorch"


def test_limits_are_written_per_job(tmp_path: Path) -> None:
    cgroups, reason = CgroupV2.detect(fake_cgroup_root(tmp_path), check_mount=False)
    assert cgroups is not None, reason
    assert (cgroups.root / "cgroup.subtree_control").read_text() == "+memory +cpu"
    job = cgroups.create("p1", cpu_milli=2500, memory_mib=1024)
    assert (job / "memory.max").read_text() == str(1024 * 1024 * 1024)
    assert (job / "cpu.max").read_text() == "250000 100000"
    unlimited = cgroups.create("p2", cpu_milli=0, memory_mib=0)
    assert (unlimited / "memory.max").read_text() == "max"
    assert (unlimited / "cpu.max").read_text() == "max 100000"


def test_missing_controllers_are_reported(tmp_path: Path) -> None:
    parent = tmp_path / "cgroupfs"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("pids\n")
    cgroups, reason = CgroupV2.detect(parent / "gpuorch", check_mount=False)
    assert cgroups is None and "memory" in reason and "cpu" in reason


@pytest.fixture
def cgroup_harness(tmp_path: Path) -> Harness:
    cgroups, _ = CgroupV2.detect(fake_cgroup_root(tmp_path), check_mount=False)
    harness = Harness(tmp_path / "state")
    harness.executor.settings.backends = {"process": ProcessBackend(cgroups)}
    return harness


async def test_the_job_enters_its_cgroup_and_an_oom_kill_is_host_oom(cgroup_harness: Harness) -> None:
    command = launch_job(["python", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                         memory_mib=128)
    record_cgroup = Path(cgroup_harness.executor.settings.backends["process"].cgroups.root,  # type: ignore[attr-defined]
                         str(command.placement_id))
    record_cgroup.mkdir()
    (record_cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    await cgroup_harness.executor.handle(command)
    [started] = cgroup_harness.publisher.of_type(JobStarted)
    outcome = await cgroup_harness.until_ended(command.placement_id)
    assert (record_cgroup / "cgroup.procs").read_text() == str(started.pid)  # the job itself, before exec
    assert isinstance(outcome, JobFailed) and outcome.cause == "host_oom" and outcome.exit_code == 137
    assert started.pid is not None


@pytest.fixture
def cgroup_v1() -> Iterator[CgroupV1]:
    memory_root = Path(f"/sys/fs/cgroup/memory/gpuorch-test-{os.getpid()}")
    cpu_root = Path(f"/sys/fs/cgroup/cpu/gpuorch-test-{os.getpid()}")
    cgroups, reason = CgroupV1.detect(memory_root, cpu_root)
    if cgroups is None:
        pytest.skip(f"no writable cgroup v1 memory and cpu hierarchies here ({reason})")
    yield cgroups
    for root in (memory_root, cpu_root):
        for child in root.glob("*/"):
            if child.is_dir():
                os.rmdir(child)
        os.rmdir(root)


FILLS_MEMORY = """
print("ready", flush=True)
ballast = b"x" * (512 * 1024 * 1024)
print("survived", len(ballast), flush=True)
"""
READS_ITS_CGROUPS = """
import json
cgroups = dict(line.split(":", 2)[1:] for line in open("/proc/self/cgroup").read().splitlines())
memory = cgroups["memory"].strip()
cpu = next(path for names, path in cgroups.items() if "cpu" in names.split(",") and names != "cpuset").strip()
print(json.dumps({
    "memory": memory, "cpu": cpu,
    "limit": open(f"/sys/fs/cgroup/memory{memory}/memory.limit_in_bytes").read().strip(),
    "quota": open(f"/sys/fs/cgroup/cpu{cpu}/cpu.cfs_quota_us").read().strip(),
}), flush=True)
"""


async def test_cgroup_v1_limits_are_enforced_by_the_kernel(tmp_path: Path, cgroup_v1: CgroupV1) -> None:
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(cgroup_v1)})
    command = launch_job(["python", "-c", FILLS_MEMORY], memory_mib=64)
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    [started] = harness.publisher.of_type(JobStarted)
    assert "survived" not in Path(started.log_path or "").read_text()
    assert isinstance(outcome, JobFailed) and outcome.cause == "host_oom", outcome
    record = harness.executor.records[command.placement_id]
    assert record.cgroup == str(cgroup_v1.root / str(command.placement_id))
    await harness.until(lambda: not Path(record.cgroup or "").exists())  # removed once the job ended


async def test_cgroup_v1_jobs_join_their_memory_and_cpu_cgroups(tmp_path: Path, cgroup_v1: CgroupV1) -> None:
    """What the job itself sees from inside (no race with the supervisor removing its cgroups when it ends)."""
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(cgroup_v1)})
    command = launch_job(["python", "-c", READS_ITS_CGROUPS], memory_mib=256)
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert outcome.exit_code == 0, outcome
    [started] = harness.publisher.of_type(JobStarted)
    seen = json.loads(Path(started.log_path or "").read_text().strip().splitlines()[-1])
    assert seen["memory"].endswith(f"/{cgroup_v1.root.name}/{command.placement_id}")
    assert seen["cpu"].endswith(f"/{cgroup_v1.cpu_root.name}/{command.placement_id}")
    assert seen["limit"] == str(256 * 1024 * 1024)
    assert seen["quota"] == str(command.spec.cpu_milli * 100)
