"""cgroups v2 limits: what this machine offers is detected; the per-job files are written and read as specified.

This machine may not have a writable cgroup2 hierarchy (then detection must say so and jobs run without limits);
the per-job cgroup logic is exercised on a stand-in directory with the same file names, including the path
through the supervisor (the job moves itself into ``cgroup.procs``; ``memory.events`` ``oom_kill`` -> host_oom).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpuorch_contracts import JobFailed, JobStarted

from gpuorch_executor.backends.cgroups import CgroupV2, is_cgroup2_mount
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
