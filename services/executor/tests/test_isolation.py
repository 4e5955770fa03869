"""Jobs isolated on their node, with real processes: from the executor, from each other, from GPUs not given.

Needs root (the supervisor switches each job to a uid of the pool) and a Python any uid may run
(``/usr/bin/python3``: this checkout's interpreter may live under a home directory other users cannot enter); the
device tests need a writable cgroup v1 ``devices`` hierarchy. Each missing capability skips with its reason.
Each test session takes a random block of uids, so that two runs side by side never end each other's jobs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpuorch_contracts import GpuAllocation, JobFailed, JobFinished, JobIsolation, JobStarted

from gpuorch_executor.backends.base import JobLaunch
from gpuorch_executor.backends.container import container_user
from gpuorch_executor.backends.devices import (
    DeviceCgroupV1,
    DeviceCgroupV2,
    DeviceConfinement,
    GpuDeviceNodes,
    cgroup2_mount_point,
    device_filter_program,
)
from gpuorch_executor.backends.mig_devices import MigCapabilities, MigLocation
from gpuorch_executor.backends.process import ProcessBackend
from gpuorch_executor.config import ConfigError, ExecutorConfig
from gpuorch_executor.domain.allowlist import AllowList, TenantPolicy
from gpuorch_executor.domain.job_users import JobUidsError, JobUserPool, parse_job_uids
from gpuorch_executor.entrypoint import build_backends, build_job_users, prepare_state_root
from gpuorch_executor.gpu_memory import DeclaredGpuMemory

from .conftest import NODE, Harness, launch_job, terminal

SYSTEM_PYTHON = "/usr/bin/python3"
ALLOW = AllowList({"default": TenantPolicy(commands=frozenset({"python3"}), inline_code=True)})
"""This test configuration's allow-list: the jobs below are ``python3 -c`` (inline code, allowed explicitly)."""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the supervisor switches each job to a uid of its own"
    if not (os.path.isfile(SYSTEM_PYTHON) and os.stat(SYSTEM_PYTHON).st_mode & 0o001):
        return f"needs {SYSTEM_PYTHON} executable by every user (the jobs' interpreter)"
    return None


needs_job_users = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def uid_block() -> int:
    return random.randrange(200_000, 2_000_000, 64)


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A state root every uid may traverse (pytest's tmp_path is 0700: no job could reach its own files there)."""
    root = Path(tempfile.mkdtemp(prefix="gpuorch-isolation-", dir="/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def isolated(shared_root: Path, uid_block: int) -> AsyncIterator[Harness]:
    pool = JobUserPool(uid_block, uid_block + 7)
    harness = Harness(shared_root / "state", job_users=pool, allow_list=ALLOW,
                      executor_env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                                    "GPUORCH_AMQP_URL": "amqp://executor:s3cret@broker/"})
    yield harness
    for record in harness.executor.active_placements():
        await harness.executor.settings.backends["process"].kill(record)


def job(code: str, *args: str, **kwargs: Any) -> Any:
    return launch_job(["python3", "-c", code, *args], **kwargs)


def started_of(harness: Harness, placement_id: object) -> JobStarted:
    return next(s for s in harness.publisher.of_type(JobStarted) if s.placement_id == placement_id)


def log_of(started: JobStarted) -> str:
    assert started.log_path is not None
    return Path(started.log_path).read_text()


def last_json(started: JobStarted) -> dict[str, Any]:
    return json.loads(log_of(started).strip().splitlines()[-1])  # type: ignore[no-any-return]


PROBE = """
import json, os, sys
def attempt(what, fn):
    try:
        fn()
        return "allowed"
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
    except ProcessLookupError:
        return "gone"
targets = json.loads(sys.argv[1])
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "home": os.environ.get("HOME"),
       "cwd": os.getcwd()}
for name, path in targets.get("read", {}).items():
    out["read:" + name] = attempt(name, lambda p=path: open(p, "rb").read(1))
for name, path in targets.get("list", {}).items():
    out["list:" + name] = attempt(name, lambda p=path: os.listdir(p))
for name, path in targets.get("write", {}).items():
    out["write:" + name] = attempt(name, lambda p=path: open(p, "w").write("x"))
for name, (pid, signum) in targets.get("signal", {}).items():
    out["signal:" + name] = attempt(name, lambda p=pid, s=signum: os.kill(p, s))
checkpoint = os.environ["GPUORCH_CHECKPOINT_FILE"]
out["own:checkpoint"] = attempt("checkpoint", lambda: open(checkpoint + ".probe", "w").write("x"))
out["own:home"] = attempt("home", lambda: open(os.path.join(os.environ["HOME"], "f"), "w").write("x"))
print(json.dumps(out), flush=True)
"""

WAITS = """
import sys, time
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@needs_job_users
async def test_each_job_runs_as_a_uid_of_its_own_without_groups(isolated: Harness, uid_block: int) -> None:
    first, second = job(WAITS), job(PROBE, "{}")
    await isolated.executor.handle(first)
    await isolated.executor.handle(second)
    await isolated.until_ended(second.placement_id)
    started_first, started_second = started_of(isolated, first.placement_id), started_of(isolated, second.placement_id)
    seen = last_json(started_second)
    first_uid = psutil.Process(started_first.pid or 0).uids().real
    assert uid_block <= first_uid < uid_block + 8 and uid_block <= seen["uid"] < uid_block + 8
    assert seen["uid"] != first_uid and seen["uid"] != os.getuid()  # never the executor's, never shared
    assert seen["gid"] == seen["uid"] and seen["groups"] == []  # no supplementary group (docker...), ever
    home = str(isolated.executor.store.home_dir(second.placement_id))
    assert seen["home"] == home and seen["cwd"] == home
    assert (seen["own:checkpoint"], seen["own:home"]) == ("allowed", "allowed")


@needs_job_users
async def test_a_job_cannot_read_the_executors_environment_state_or_credentials(isolated: Harness) -> None:
    store = isolated.executor.store
    credentials = store.state_dir / "broker.credentials"  # stands for the executor's credentials file
    fd = os.open(credentials, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"amqp://executor:s3cret@broker/")
    os.close(fd)
    lock_fd = store.lock()
    isolated.executor.lease = (time.monotonic(), 3600.0, 10.0)  # a fresh lease: lease.json exists
    waiting = job(WAITS)
    await isolated.executor.handle(waiting)
    probe = job(PROBE, "")
    targets = {
        "read": {"executor_environ": f"/proc/{os.getpid()}/environ", "credentials": str(credentials),
                 "lease": str(store.lease_path), "lock": str(store.state_dir / "executor.lock"),
                 "other_record": str(store.placement_dir(waiting.placement_id) / "record.json"),
                 "own_record": str(store.placement_dir(probe.placement_id) / "record.json"),
                 "own_launch": str(store.placement_dir(probe.placement_id) / "launch.json")},
        "list": {"state_dir": str(store.state_dir), "placements": str(store.placements_dir),
                 "logs": str(store.logs_dir)},
    }
    probe.spec.run.argv[-1] = json.dumps(targets)
    await isolated.executor.handle(probe)
    await isolated.until_ended(probe.placement_id)
    os.close(lock_fd)
    started = started_of(isolated, probe.placement_id)
    seen = last_json(started)
    for key in ("read:executor_environ", "read:credentials", "read:lease", "read:lock", "read:other_record",
                "read:own_record", "read:own_launch", "list:state_dir", "list:placements", "list:logs"):
        assert seen[key] == "denied", (key, seen[key])
    assert "s3cret" not in log_of(started)
    env = json.loads((store.placement_dir(probe.placement_id) / "launch.json").read_text())["env"]
    assert "GPUORCH_AMQP_URL" not in env  # nor is the executor's environment handed to the job


@needs_job_users
async def test_a_job_cannot_read_another_jobs_files_nor_signal_it(isolated: Harness) -> None:
    victim = job(WAITS)
    await isolated.executor.handle(victim)
    [started_victim] = isolated.publisher.of_type(JobStarted)
    await isolated.until(lambda: "ready" in log_of(started_victim))
    record = isolated.executor.records[victim.placement_id]
    victim_dir = isolated.executor.store.placement_dir(victim.placement_id)
    attacker = job(PROBE, "")
    targets = {
        "read": {"log": started_victim.log_path, "started": str(victim_dir / "started.json"),
                 "launch": str(victim_dir / "launch.json"), "record": str(victim_dir / "record.json"),
                 "supervisor_log": str(victim_dir / "supervisor.log")},
        "list": {"checkpoint": str(victim_dir / "checkpoint"), "home": str(victim_dir / "home")},
        "write": {"checkpoint": str(victim_dir / "checkpoint" / "confirmed"), "exit": str(victim_dir / "exit.json"),
                  "log": started_victim.log_path},
        # SIGTERM to the other job; signal 0 (the same permission check, nothing sent) to the supervisor and executor
        "signal": {"job": [record.job_pid, signal.SIGTERM], "supervisor": [record.supervisor_pid, 0],
                   "executor": [os.getpid(), 0]},
    }
    attacker.spec.run.argv[-1] = json.dumps(targets)
    await isolated.executor.handle(attacker)
    await isolated.until_ended(attacker.placement_id)
    started = started_of(isolated, attacker.placement_id)
    seen = last_json(started)
    denied = [k for k in seen if k.split(":")[0] in ("read", "list", "write", "signal")]
    assert len(denied) == 13 and all(seen[k] == "denied" for k in denied), seen
    assert not (victim_dir / "exit.json").exists() and not (victim_dir / "checkpoint" / "confirmed").exists()
    await isolated.executor.tick()
    assert isolated.executor.records[victim.placement_id].state == "running"  # untouched
    log_path = Path(started_victim.log_path or "")
    assert (log_path.stat().st_mode & 0o777, log_path.stat().st_uid) == (0o640, os.getuid())
    assert log_path.stat().st_gid == record.job_uid  # its owner may read it; nobody else


READS_OWN_LOG = """
import os, sys
print("first line", flush=True)
print("read back:", open(sys.argv[1]).read().splitlines()[0], flush=True)
"""


@needs_job_users
async def test_a_job_reads_its_own_log(isolated: Harness) -> None:
    command = job(READS_OWN_LOG, "")
    log_path = isolated.executor.store.log_path(command.job_id, command.placement_id)
    command.spec.run.argv[-1] = str(log_path)
    await isolated.executor.handle(command)
    outcome = await isolated.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished), outcome
    assert "read back: first line" in log_path.read_text()


LEAVES_A_DAEMON = """
import os, time
read_end, write_end = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a daemon: its own session, its own process group, reparented to init
        os.write(write_end, str(os.getpid()).encode())
        os.close(write_end)
        time.sleep(600)
    os._exit(0)
os.wait()
os.close(write_end)
print("daemon", os.read(read_end, 32).decode(), flush=True)
"""


@needs_job_users
async def test_a_jobs_leftovers_are_killed_before_its_uid_is_lent_again(isolated: Harness) -> None:
    command = job(LEAVES_A_DAEMON)
    await isolated.executor.handle(command)
    outcome = await isolated.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = isolated.publisher.of_type(JobStarted)
    daemon_pid = int(next(line for line in log_of(started).splitlines() if line.startswith("daemon")).split()[1])
    await isolated.until(lambda: not psutil.pid_exists(daemon_pid) or
                         psutil.Process(daemon_pid).status() == psutil.STATUS_ZOMBIE)
    record, pool = isolated.executor.records[command.placement_id], isolated.executor.settings.job_users
    assert pool is not None and record.job_uid is not None and record.job_uid not in pool.in_use


@needs_job_users
async def test_a_workdir_the_jobs_uid_cannot_reach_is_a_launch_error(isolated: Harness, tmp_path: Path) -> None:
    private = tmp_path / "private"  # under pytest's 0700 directory: the executor (root) reaches it, the job not
    private.mkdir()
    command = job("print('ran')", workdir=str(private))
    await isolated.executor.handle(command)
    outcome = await isolated.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "launch_error"
    assert "ran" not in Path(isolated.executor.records[command.placement_id].log_path or "").read_text()


def test_a_state_directory_jobs_cannot_reach_is_refused_at_start(tmp_path: Path, shared_root: Path) -> None:
    pool = JobUserPool(61000, 61001)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="does not let other users pass"):
        prepare_state_root(closed / "executor", pool)
    prepare_state_root(closed / "executor", None)  # jobs run as the executor: nothing to reach
    prepare_state_root(shared_root / "executor", pool)
    assert (shared_root / "executor").stat().st_mode & 0o777 == 0o711


def test_a_container_runs_as_the_jobs_uid_else_the_tenants_else_nobody(tmp_path: Path) -> None:
    command = job("pass")
    base = {"launch": command, "placement_dir": tmp_path, "log_path": tmp_path / "log",
            "checkpoint_file": tmp_path / "c", "executor_env": {}}
    assert container_user(JobLaunch(**base, job_uid=61007)) == "61007:61007"  # type: ignore[arg-type]
    assert container_user(JobLaunch(**base, container_user="1000:1000")) == "1000:1000"  # type: ignore[arg-type]
    assert container_user(JobLaunch(**base)) == "65534:65534"  # type: ignore[arg-type]


LEAVES_FILES = """
import os, sys
open(sys.argv[1], "w").write("secret of the last job")
open(os.path.join(os.environ["HOME"], "notes"), "w").write("secret of the last job")
print("the last job's log", flush=True)
"""


@needs_job_users
async def test_the_next_job_lent_the_same_uid_finds_nothing_of_the_last(shared_root: Path, uid_block: int) -> None:
    uid = uid_block + 9
    harness = Harness(shared_root / "state", job_users=JobUserPool(uid, uid), allow_list=ALLOW,
                      executor_env={"PATH": "/usr/bin:/bin"})
    left_in_tmp = Path(f"/tmp/gpuorch-left-by-{uid}")
    first = job(LEAVES_FILES, str(left_in_tmp))
    await harness.executor.handle(first)
    assert isinstance(await harness.until_ended(first.placement_id), JobFinished)
    store = harness.executor.store
    first_log = store.log_path(first.job_id, first.placement_id)
    assert not left_in_tmp.exists() and not store.home_dir(first.placement_id).exists()
    assert (first_log.stat().st_uid, first_log.stat().st_gid, first_log.stat().st_mode & 0o777) == (0, 0, 0o600)
    assert store.checkpoint_file(first.placement_id).parent.stat().st_uid == 0
    second = job(PROBE, json.dumps({"read": {"last_log": str(first_log)},
                                    "list": {"last_checkpoint": str(store.checkpoint_file(first.placement_id).parent)}}))
    await harness.executor.handle(second)
    assert isinstance(await harness.until_ended(second.placement_id), JobFinished)
    seen = last_json(started_of(harness, second.placement_id))
    assert seen["uid"] == uid  # the same uid, lent again
    assert (seen["read:last_log"], seen["list:last_checkpoint"]) == ("denied", "denied")


@needs_job_users
async def test_an_exhausted_pool_is_a_launch_error(shared_root: Path, uid_block: int) -> None:
    harness = Harness(shared_root / "state", job_users=JobUserPool(uid_block + 8, uid_block + 8), allow_list=ALLOW,
                      executor_env={"PATH": "/usr/bin:/bin"})
    try:
        first = job(WAITS)
        await harness.executor.handle(first)
        second = job("pass")
        await harness.executor.handle(second)
        [outcome] = terminal(harness.publisher, second.placement_id)
        assert isinstance(outcome, JobFailed) and outcome.cause == "launch_error" and "uids" in outcome.reason
    finally:
        for record in harness.executor.active_placements():
            await harness.executor.settings.backends["process"].kill(record)


# -- devices: the cgroup device controller, against the kernel ---------------------------------------------------

def _device_cgroup_root() -> tuple[Path, DeviceCgroupV1 | None, str]:
    root = Path(f"/sys/fs/cgroup/devices/gpuorch-test-{os.getpid()}")
    cgroup, why = DeviceCgroupV1.detect(root)
    return root, cgroup, why


def _remove_tree(root: Path) -> None:
    for child in root.glob("*/"):
        if child.is_dir():
            os.rmdir(child)
    os.rmdir(root)


@pytest.fixture
def device_cgroup() -> Iterator[DeviceCgroupV1]:
    root, cgroup, why = _device_cgroup_root()
    if cgroup is None:
        pytest.skip(f"no writable cgroup v1 devices hierarchy here ({why})")
    yield cgroup
    _remove_tree(root)


@pytest.fixture(params=["cgroup_v2", "cgroup_v1"])
def any_device_cgroup(request: pytest.FixtureRequest) -> Iterator[DeviceCgroupV1 | DeviceCgroupV2]:
    """Each device controller this host offers (v2: an eBPF program; v1: devices.deny), tested against the kernel."""
    cgroup: DeviceCgroupV1 | DeviceCgroupV2 | None
    if request.param == "cgroup_v2":
        mount = cgroup2_mount_point()
        if mount is None:
            pytest.skip("no cgroup2 hierarchy here")
        root = mount / f"gpuorch-test-{os.getpid()}"
        cgroup, why = DeviceCgroupV2.detect(root)
        if cgroup is None:
            pytest.skip(f"cannot attach an eBPF device filter here ({why})")
    else:
        root, cgroup, why = _device_cgroup_root()
        if cgroup is None:
            pytest.skip(f"no writable cgroup v1 devices hierarchy here ({why})")
    yield cgroup
    _remove_tree(root)


def test_the_device_filter_program_is_one_rule_per_denied_device() -> None:
    program = device_filter_program([("c", 195, 0), ("b", 7, 3)])
    assert len(program) == 8 * (4 + 5 * 2 + 2)
    assert program[-16:] == bytes([0xB7, 0, 0, 0, 1, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])  # allow the rest


OPENS = """
import json
out = {}
for path in ("/dev/full", "/dev/zero", "/dev/null"):
    try:
        open(path, "rb").close()
        out[path] = "open"
    except PermissionError:
        out[path] = "denied"
print(json.dumps(out), flush=True)
"""
STAND_IN_GPUS = {"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"],
                 "GPU-bbbbbbbb-0000-0000-0000-000000000000": ["/dev/zero"]}
"""Two stand-in GPUs whose device nodes any user may open, so that only the device controller can refuse them."""


@pytest.mark.parametrize(("gpus", "expected"), [
    (["GPU-aaaaaaaa-0000-0000-0000-000000000000"], {"/dev/full": "open", "/dev/zero": "denied"}),
    (["GPU-bbbbbbbb-0000-0000-0000-000000000000"], {"/dev/full": "denied", "/dev/zero": "open"}),
    ([], {"/dev/full": "denied", "/dev/zero": "denied"}),
    (list(STAND_IN_GPUS), {"/dev/full": "open", "/dev/zero": "open"}),
])
async def test_the_device_controller_denies_the_gpus_a_job_was_not_given(
        tmp_path: Path, any_device_cgroup: DeviceCgroupV1 | DeviceCgroupV2, gpus: list[str],
        expected: dict[str, str]) -> None:
    confinement = DeviceConfinement(any_device_cgroup, GpuDeviceNodes(STAND_IN_GPUS))
    assert confinement.kind == any_device_cgroup.kind
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(None, confinement)})
    command = launch_job(["python", "-c", OPENS], gpus=gpus, env={"CUDA_VISIBLE_DEVICES": ""})
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    assert last_json(started) == {**expected, "/dev/null": "open"}  # whatever its environment says
    record = harness.executor.records[command.placement_id]
    if len(gpus) < len(STAND_IN_GPUS):
        assert record.device_cgroup is not None
        await harness.until(lambda: not Path(record.device_cgroup or "").exists())  # removed when it ended
    else:
        assert record.device_cgroup is None  # nothing to deny: no cgroup at all


async def test_a_mig_job_opens_its_parent_gpu_and_no_other(
        tmp_path: Path, any_device_cgroup: DeviceCgroupV1 | DeviceCgroupV2) -> None:
    """A MIG instance has a UUID of its own (``MIG-...``), not in the device map: its parent GPU (by index) is what
    it must open; denying every node but the given UUIDs' would lock it out of its own slice."""
    confinement = DeviceConfinement(any_device_cgroup, GpuDeviceNodes(STAND_IN_GPUS))
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(None, confinement)})
    command = launch_job(["python", "-c", OPENS], env={"CUDA_VISIBLE_DEVICES": ""})
    command = command.model_copy(update={"gpus": [GpuAllocation(
        gpu_uuid="MIG-cccccccc-0000-0000-0000-000000000000", gpu_index=1, mig_profile="1g.10gb")]})
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    assert last_json(started) == {"/dev/full": "denied", "/dev/zero": "open", "/dev/null": "open"}


def test_mig_instances_map_to_their_parent_gpu_nodes() -> None:
    nodes = GpuDeviceNodes(STAND_IN_GPUS)
    mig = ("MIG-cccccccc-0000-0000-0000-000000000000", 0, True)
    assert nodes.given([mig]) == ["GPU-aaaaaaaa-0000-0000-0000-000000000000"]
    assert nodes.denied_for(nodes.given([mig])) == ["/dev/zero"]
    assert nodes.given([("GPU-bbbbbbbb-0000-0000-0000-000000000000", 1, False)]) == [
        "GPU-bbbbbbbb-0000-0000-0000-000000000000"]
    with pytest.raises(OSError, match="lacks"):
        nodes.given([("MIG-x", 7, True)])


MIG_C, MIG_D = "MIG-cccccccc-0000-0000-0000-000000000000", "MIG-dddddddd-0000-0000-0000-000000000000"


def _mig_capabilities(tmp_path: Path, caps_are_devices: bool = True) -> MigCapabilities:
    """A driver stand-in: GPU minor 0 holds GPU instances 1 (``MIG_C``, compute instance 0) and 2 (``MIG_D``).
    The ``nvidia-caps`` major is 1 (the kernel's ``mem`` devices) so each capability is a node anyone may open:
    MIG_C's are /dev/random (1:8) and /dev/urandom (1:9), MIG_D's /dev/zero (1:5) and /dev/kmsg (1:11),
    mig/config 1:1 and mig/monitor 1:2."""
    proc = tmp_path / "capabilities"
    for relative, minor in (("gpu0/mig/gi1/access", 8), ("gpu0/mig/gi1/ci0/access", 9),
                            ("gpu0/mig/gi2/access", 5), ("gpu0/mig/gi2/ci0/access", 11),
                            ("mig/config", 1), ("mig/monitor", 2)):
        (proc / relative).parent.mkdir(parents=True, exist_ok=True)
        (proc / relative).write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n  1 mem\n" + ("  1 nvidia-caps\n" if caps_are_devices else "")
                       + "195 nvidia-frontend\n")
    return MigCapabilities(lambda: [MigLocation(MIG_C, 0, 1, 0), MigLocation(MIG_D, 0, 2, 0)],
                           proc=proc, dev=Path("/dev/nvidia-caps-test"), proc_devices=devices)


def test_mig_capability_nodes_are_read_from_the_driver(tmp_path: Path) -> None:
    caps = _mig_capabilities(tmp_path)
    assert caps.available
    node = "/dev/nvidia-caps-test/nvidia-cap{}".format
    assert caps.instances() == {MIG_C: [node(8), node(9)], MIG_D: [node(5), node(11)]}
    assert caps.all_nodes() == {node(m): ("c", 1, m) for m in (1, 2, 5, 8, 9, 11)}
    nodes = GpuDeviceNodes({"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"]}, mig=caps).now()
    given = nodes.given([(MIG_C, 0, True)])
    assert given == ["GPU-aaaaaaaa-0000-0000-0000-000000000000", MIG_C]
    assert nodes.denied_for(given) == [node(1), node(11), node(2), node(5)]  # the other slice, config, monitor
    with pytest.raises(OSError, match="cannot be confined"):
        nodes.given([("MIG-eeeeeeee-0000-0000-0000-000000000000", 0, True)])  # not on this GPU now
    (tmp_path / "capabilities" / "gpu0/mig/gi2/ci0/access").unlink()  # its compute instance is gone
    assert MIG_D not in caps.instances()
    unconfined = _mig_capabilities(tmp_path / "proc-mode", caps_are_devices=False)
    assert not unconfined.available and unconfined.all_nodes() == {}
    plain = GpuDeviceNodes({"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"]}, mig=unconfined)
    assert not plain.confines_mig and plain.now() is plain
    assert plain.given([(MIG_C, 0, True)]) == ["GPU-aaaaaaaa-0000-0000-0000-000000000000"]


MIG_OPENS = OPENS.replace('("/dev/full", "/dev/zero", "/dev/null")', '("/dev/full", "/dev/zero", "/dev/random")')


@pytest.mark.parametrize(("mig", "expected"), [
    (MIG_C, {"/dev/full": "open", "/dev/random": "open", "/dev/zero": "denied"}),
    (MIG_D, {"/dev/full": "open", "/dev/random": "denied", "/dev/zero": "open"}),
])
async def test_a_mig_job_opens_its_own_slice_and_no_other_slice_of_the_gpu(
        tmp_path: Path, any_device_cgroup: DeviceCgroupV1 | DeviceCgroupV2, mig: str,
        expected: dict[str, str]) -> None:
    """Two slices of one GPU: the job given one may open the GPU's node and its slice's capability nodes; the
    kernel refuses the other slice's (and mig/config, mig/monitor), whatever CUDA_VISIBLE_DEVICES says."""
    devices = GpuDeviceNodes({"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"]},
                             mig=_mig_capabilities(tmp_path))
    confinement = DeviceConfinement(any_device_cgroup, devices)
    harness = Harness(tmp_path / "state", backends={"process": ProcessBackend(None, confinement)})
    command = launch_job(["python", "-c", MIG_OPENS], env={"CUDA_VISIBLE_DEVICES": MIG_C + "," + MIG_D})
    command = command.model_copy(update={"gpus": [GpuAllocation(gpu_uuid=mig, gpu_index=0, mig_profile="1g.10gb")]})
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    [started] = harness.publisher.of_type(JobStarted)
    assert last_json(started) == expected


async def test_a_mig_slice_not_on_the_node_now_is_a_launch_error(
        tmp_path: Path, any_device_cgroup: DeviceCgroupV1 | DeviceCgroupV2) -> None:
    devices = GpuDeviceNodes({"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"]},
                             mig=_mig_capabilities(tmp_path))
    harness = Harness(tmp_path / "state", backends={
        "process": ProcessBackend(None, DeviceConfinement(any_device_cgroup, devices))})
    command = launch_job(["python", "-c", MIG_OPENS])
    command = command.model_copy(update={"gpus": [GpuAllocation(
        gpu_uuid="MIG-eeeeeeee-0000-0000-0000-000000000000", gpu_index=0, mig_profile="1g.10gb")]})
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed)
    assert "cannot be confined" in outcome.reason


def test_gpu_device_nodes_from_the_driver_and_from_the_setting(tmp_path: Path) -> None:
    for minor, uuid_ in ((0, "GPU-0"), (3, "GPU-3")):
        gpu = tmp_path / f"0000:0{minor}:00.0"
        gpu.mkdir()
        (gpu / "information").write_text(f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid_}\nDevice Minor: \t {minor}\n")
    nodes = GpuDeviceNodes.discover(tmp_path)
    assert nodes.nodes == {"GPU-0": ("/dev/nvidia0",), "GPU-3": ("/dev/nvidia3",)}
    assert nodes.denied_for(["GPU-3"]) == ["/dev/nvidia0"]
    assert nodes.denied_for(["MIG-unknown"]) == ["/dev/nvidia0", "/dev/nvidia3"]
    assert GpuDeviceNodes.from_setting(json.dumps(STAND_IN_GPUS)).denied_for([]) == ["/dev/full", "/dev/zero"]
    with pytest.raises(ValueError):
        GpuDeviceNodes.from_setting('{"GPU-0": ["/etc/passwd"]}')


# -- configuration and the report ------------------------------------------------------------------------------

def test_job_uid_pools_parse_and_never_hold_a_privileged_group() -> None:
    pool = parse_job_uids("61000-61003")
    assert pool is not None and (pool.first, pool.last, pool.size) == (61000, 61003, 4)
    assert [pool.take(), pool.take()] == [61000, 61001]
    pool.give_back(61000)
    assert pool.take() == 61000
    assert parse_job_uids("off") is None
    for bad in ("61000", "0-10", "999-2000", "5-3"):
        with pytest.raises(JobUidsError):
            parse_job_uids(bad)
    with pytest.raises(JobUidsError, match="docker"):
        parse_job_uids("61000-61063", forbidden_gids=frozenset({61010}))
    full = JobUserPool(61000, 61000)
    assert full.take() == 61000 and full.take() is None


def _config(**env: str) -> ExecutorConfig:
    return ExecutorConfig.from_env({"GPUORCH_NODE_ID": NODE, **env})


def test_the_default_pool_is_on_for_an_executor_that_may_switch_users() -> None:
    pool = build_job_users(_config())
    if os.geteuid() == 0:
        assert pool is not None and (pool.first, pool.last) == (61000, 61063)
    else:
        assert pool is None  # reported: job_users executor_uid
    assert build_job_users(_config(GPUORCH_EXECUTOR_JOB_UIDS="off")) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="only an executor that may not switch users refuses a pool")
def test_a_pool_the_executor_cannot_use_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="switch users"):
        build_job_users(_config(GPUORCH_EXECUTOR_JOB_UIDS="61000-61063"))


def test_the_executor_reports_what_it_does_not_enforce() -> None:
    off = {"GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT": "off", "GPUORCH_EXECUTOR_CGROUP_ROOT": "off"}
    _, isolation = build_backends(_config(**off), None)
    assert isinstance(isolation, JobIsolation)
    assert (isolation.job_users, isolation.devices, isolation.limits, isolation.containers) == (
        "executor_uid", "env_only", "none", "disabled")
    assert any("executor's user" in note for note in isolation.notes)
    assert any("not device-confined" in note for note in isolation.notes)
    _, isolated = build_backends(_config(**off), JobUserPool(61000, 61001))
    assert isolated.job_users == "per_job_uid"
    assert isolation.shares == "none"  # no GPU memory probe: share jobs are not held to their memory
    _, watched = build_backends(_config(**off, GPUORCH_EXECUTOR_MPS_PIPE_DIRECTORY="off"), None, DeclaredGpuMemory())
    assert watched.shares == "watchdog"


def test_a_device_cgroup_is_reported(any_device_cgroup: DeviceCgroupV1 | DeviceCgroupV2) -> None:
    _, isolation = build_backends(_config(GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT=str(any_device_cgroup.root),
                                          GPUORCH_EXECUTOR_CGROUP_ROOT="off"), None)
    assert isolation.devices == any_device_cgroup.kind
    assert isolation.mig_slices == "env_only"  # no GPU driver here: no MIG capability nodes to confine by
    assert any("MIG instances inside one GPU" in note for note in isolation.notes)
    stand_ins = json.dumps({"GPU-aaaaaaaa-0000-0000-0000-000000000000": ["/dev/full"], MIG_C: ["/dev/random"]})
    _, with_mig = build_backends(_config(GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT=str(any_device_cgroup.root),
                                         GPUORCH_EXECUTOR_CGROUP_ROOT="off",
                                         GPUORCH_EXECUTOR_GPU_DEVICES=stand_ins), None)
    assert with_mig.mig_slices == any_device_cgroup.kind
    assert not any("MIG instances inside one GPU" in note for note in with_mig.notes)


def test_heartbeats_carry_the_isolation(tmp_path: Path) -> None:
    from gpuorch_messaging.testing import RecordingPublisher

    from gpuorch_executor.lease import LeaseRenewer

    harness = Harness(tmp_path / "state")
    isolation = JobIsolation(job_users="per_job_uid", devices="cgroup_v1", limits="none", containers="gpus_flag")
    renewer = LeaseRenewer(RecordingPublisher(), [harness.executor], interval_s=1, fencing_deadline_s=60,
                           fencing_grace_s=10, isolation=isolation)
    [beat] = renewer.heartbeats()
    assert beat.isolation == isolation
