"""The container backend's command line (no Docker engine here), and its flow through a stand-in ``docker``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from gpuorch_contracts import ContainerRun, JobFailed, JobFinished, JobStarted, StopJob

from gpuorch_executor.backends.base import JobLaunch
from gpuorch_executor.backends.container import (
    DOCKER_CLIENT_PATH,
    ContainerBackend,
    docker_run_argv,
    resolve_docker,
)
from gpuorch_executor.domain.allowlist import AllowList, Mount, TenantPolicy

from .conftest import NODE, Harness, container_job, launch_job

IMAGE = "registry.example/team/trainer@sha256:" + "b" * 64
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == name]


def test_docker_run_argv_isolates_the_container() -> None:
    command = container_job(IMAGE, ["python", "train.py", "--epochs", "3"], gpus=UUIDS, memory_mib=2048)
    argv = docker_run_argv(command, docker="/usr/bin/docker", env_file="/state/p/container.env",
                           mounts=(Mount("/data/sets", "/data", True),), checkpoint_dir="/state/p/checkpoint",
                           cidfile="/state/p/container.id", user="61003:61003")
    assert argv[:3] == ["/usr/bin/docker", "run", "--rm"]
    assert option(argv, "--gpus") == ['"device=' + ",".join(UUIDS) + '"']  # exactly its own GPU/MIG UUIDs
    assert option(argv, "--cpus") == ["1"]
    assert option(argv, "--memory") == ["2048m"] and option(argv, "--memory-swap") == ["2048m"]
    assert option(argv, "--security-opt") == ["no-new-privileges"]
    assert option(argv, "--cap-drop") == ["ALL"]
    assert option(argv, "--pids-limit") == ["4096"]
    assert option(argv, "--user") == ["61003:61003"]
    assert "--read-only" in argv and option(argv, "--tmpfs") == ["/tmp:rw,nosuid,nodev,size=1g"]
    assert option(argv, "--network") == ["none"]
    assert option(argv, "--name") == [f"gpuorch-{command.placement_id}"]
    assert option(argv, "--cidfile") == ["/state/p/container.id"]
    assert option(argv, "--mount") == ["type=bind,source=/data/sets,target=/data,readonly",
                                       "type=bind,source=/state/p/checkpoint,target=/gpuorch/checkpoint"]
    assert option(argv, "--env-file") == ["/state/p/container.env"]  # values never on the command line
    assert "-e" not in argv and "--env" not in argv
    assert "--privileged" not in argv and "-v" not in argv and "--volume" not in argv
    assert not any(arg.startswith(("--pid=", "--ipc", "--userns", "--device", "--network=")) for arg in argv)
    assert "--pid" not in argv
    image_at = argv.index(IMAGE)
    assert argv[image_at + 1:] == ["python", "train.py", "--epochs", "3"]


def test_docker_run_argv_never_root_never_host_network() -> None:
    command = container_job(IMAGE, [])
    assert option(docker_run_argv(command), "--user") == ["65534:65534"]
    with pytest.raises(ValueError, match="root"):
        docker_run_argv(command, user="0:0")
    with pytest.raises(ValueError, match="never allowed"):
        docker_run_argv(command, network="host")
    assert option(docker_run_argv(command, network="bridge"), "--network") == ["bridge"]


def test_a_job_without_gpus_gets_no_gpus_option() -> None:
    argv = docker_run_argv(container_job(IMAGE, []))
    assert "--gpus" not in argv and argv[-1] == IMAGE


def test_a_single_gpu() -> None:
    argv = docker_run_argv(container_job(IMAGE, [], gpus=UUIDS[:1]))
    assert option(argv, "--gpus") == [f'"device={UUIDS[0]}"']


HOSTILE_ENV = {"TOKEN": "s3cret", "PATH": "/tmp/evil-bin", "LD_PRELOAD": "/tmp/evil.so",
               "DOCKER_HOST": "tcp://evil.example:2375", "DOCKER_CONFIG": "/tmp/evil-config",
               "NVIDIA_VISIBLE_DEVICES": "all"}


def test_prepare_keeps_the_jobs_environment_away_from_the_docker_client(tmp_path: Path) -> None:
    command = launch_job([], run=ContainerRun(image=IMAGE, argv=["run"], env=HOSTILE_ENV), gpus=UUIDS[:1])
    job = JobLaunch(launch=command, placement_dir=tmp_path, log_path=tmp_path / "log",
                    checkpoint_file=tmp_path / "checkpoint" / "confirmed",
                    executor_env={"PATH": "/usr/bin", "DOCKER_HOST": "unix:///run/d.sock", "HOME": "/root",
                                  "GPUORCH_AMQP_URL": "amqp://secret", "LD_PRELOAD": "/executor.so"})
    docker = shim_docker(tmp_path)
    supervised = ContainerBackend(docker).prepare(job)
    assert supervised.argv[0] == supervised.executable == docker
    assert "s3cret" not in " ".join(supervised.argv)
    # the client's environment is fixed: the executor's docker connection, a fixed PATH, nothing of the job's
    assert supervised.env == {"PATH": DOCKER_CLIENT_PATH, "DOCKER_HOST": "unix:///run/d.sock", "HOME": "/root"}
    env_file = tmp_path / "container.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    inside = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert inside["TOKEN"] == "s3cret" and inside["PATH"] == "/tmp/evil-bin"  # the container's own business
    assert inside["GPUORCH_CHECKPOINT_FILE"] == "/gpuorch/checkpoint/confirmed"
    assert inside["NVIDIA_VISIBLE_DEVICES"] == inside["CUDA_VISIBLE_DEVICES"] == UUIDS[0]  # not "all"
    assert "GPUORCH_AMQP_URL" not in inside
    assert supervised.container_name == f"gpuorch-{command.placement_id}"


def shim_docker(directory: Path) -> str:
    shim = directory / "docker"
    shim.write_text("#!/bin/sh\n")
    shim.chmod(0o755)
    return str(shim)


def test_the_docker_client_is_an_absolute_path_fixed_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        resolve_docker("docker", path=str(tmp_path))
    with pytest.raises(ValueError, match="not found"):
        resolve_docker(str(tmp_path / "docker"))
    shim = shim_docker(tmp_path)
    assert resolve_docker(shim) == shim
    assert resolve_docker("docker", path=f"/nonexistent:{tmp_path}") == shim


def test_a_value_with_a_line_break_cannot_reach_a_container(tmp_path: Path) -> None:
    command = launch_job([], run=ContainerRun(image=IMAGE, argv=["run"], env={"X": "a\nY=b"}))
    job = JobLaunch(launch=command, placement_dir=tmp_path, log_path=tmp_path / "log",
                    checkpoint_file=tmp_path / "checkpoint" / "confirmed", executor_env={})
    with pytest.raises(ValueError, match="line break"):
        ContainerBackend(shim_docker(tmp_path)).prepare(job)


FAKE_DOCKER = """#!{python}
import json, os, signal, sys, time
calls = {calls!r}
with open(calls, "a") as f:
    env_file = sys.argv[sys.argv.index("--env-file") + 1] if "--env-file" in sys.argv else None
    f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "executable": sys.argv[0],
                        "env_file": open(env_file).read() if env_file else None}}) + "\\n")
if sys.argv[1] == "kill":
    sys.exit(0)
args = sys.argv[1:]
open(args[args.index("--cidfile") + 1], "w").write("c0ffee")
print("container says hi", flush=True)
if "sleep" in args:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    time.sleep(30)
sys.exit(int(args[-1]) if args[-1].isdigit() else 0)
"""


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[Path, Path]:
    import sys

    calls = tmp_path / "docker-calls.jsonl"
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable, calls=str(calls)))
    docker.chmod(docker.stat().st_mode | stat.S_IEXEC)
    return docker, calls


async def test_container_job_flows_through_the_supervisor(tmp_path: Path, fake_docker: tuple[Path, Path]) -> None:
    docker, calls = fake_docker
    harness = Harness(tmp_path / "state", docker=str(docker))
    evil_bin = tmp_path / "evil-bin"  # a 'docker' the job's PATH would find first
    evil_bin.mkdir()
    (evil_bin / "docker").write_text(f"#!/bin/sh\ntouch {tmp_path / 'evil-ran'}\nexit 0\n")
    (evil_bin / "docker").chmod(0o755)
    command = launch_job([], run=ContainerRun(image=IMAGE, argv=["train", "0"], env={
        **HOSTILE_ENV, "PATH": f"{evil_bin}:/usr/bin:/bin"}), gpus=UUIDS[:1], tenant="images")
    await harness.executor.handle(command)
    [started] = harness.publisher.of_type(JobStarted)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    assert started.container_id in ("c0ffee", f"gpuorch-{command.placement_id}")
    [call] = [json.loads(line) for line in calls.read_text().splitlines()]
    assert call["argv"][0] == "run" and call["executable"] == str(docker)  # the configured client ran
    assert not (tmp_path / "evil-ran").exists()
    for name, value in HOSTILE_ENV.items():  # nothing of the job's environment reached the client
        assert call["env"].get(name) != value, name
    assert call["env"]["PATH"] == DOCKER_CLIENT_PATH and "LD_PRELOAD" not in call["env"]
    assert "TOKEN=s3cret" in call["env_file"].splitlines()  # the container gets it, through the env file
    assert option(call["argv"], "--gpus") == [f'"device={UUIDS[0]}"']
    assert "container says hi" in Path(started.log_path or "").read_text()


async def test_container_docker_errors_are_launch_errors(tmp_path: Path, fake_docker: tuple[Path, Path]) -> None:
    docker, _ = fake_docker
    harness = Harness(tmp_path / "state", docker=str(docker))
    command = container_job(IMAGE, ["125"])
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "launch_error"


async def test_container_stop_goes_through_docker_kill(tmp_path: Path, fake_docker: tuple[Path, Path]) -> None:
    docker, calls = fake_docker
    harness = Harness(tmp_path / "state", docker=str(docker))
    command = container_job(IMAGE, ["sleep"])
    await harness.executor.handle(command)
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id,
                                          grace_s=0.2))
    await harness.until(lambda: any(json.loads(line)["argv"][0] == "kill"
                                    for line in calls.read_text().splitlines()))
    kills = [json.loads(line)["argv"] for line in calls.read_text().splitlines()
             if json.loads(line)["argv"][0] == "kill"]
    assert kills[0] == ["kill", "--signal=SIGTERM", f"gpuorch-{command.placement_id}"]
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed"


async def test_container_refused_for_images_not_listed(tmp_path: Path, fake_docker: tuple[Path, Path]) -> None:
    docker, calls = fake_docker
    harness = Harness(tmp_path / "state", docker=str(docker))
    command = container_job("docker.io/evil/miner@sha256:" + "c" * 64, [])
    await harness.executor.handle(command)
    [outcome] = harness.publisher.of_type(JobFailed)
    assert outcome.cause == "refused" and "evil/miner" in outcome.reason
    assert not calls.exists()
    assert os.path.exists(harness.executor.store.placement_dir(command.placement_id) / "record.json")


def test_a_container_session_publishes_its_port_on_loopback_and_mounts_its_work_directory() -> None:
    command = container_job(IMAGE, ["serve"])
    argv = docker_run_argv(command, network="bridge", session_port=41234, session_dir="/state/sessions/j1")
    assert option(argv, "--publish") == ["127.0.0.1:41234:41234"]  # the host's loopback only
    assert "type=bind,source=/state/sessions/j1,target=/state/sessions/j1" in option(argv, "--mount")
    assert option(argv, "--workdir") == ["/state/sessions/j1"]
    with pytest.raises(ValueError, match="needs a network to publish its port"):
        docker_run_argv(command, session_port=41234, session_dir="/state/sessions/j1")


async def test_a_container_session_runs_with_its_port_and_work_directory(
        tmp_path: Path, fake_docker: tuple[Path, Path]) -> None:
    docker, calls = fake_docker
    allow = AllowList({"images": TenantPolicy(images=("registry.example/team/",), network="bridge")})
    harness = Harness(tmp_path / "state", docker=str(docker), allow_list=allow)
    command = container_job(IMAGE, ["--port", "$(GPUORCH_PORT)", "0"])
    command = command.model_copy(update={"spec": command.spec.model_copy(update={"tier": "interactive"})})
    await harness.executor.handle(command)
    assert isinstance(await harness.until_ended(command.placement_id), JobFinished)
    [call] = [json.loads(line) for line in calls.read_text().splitlines()]
    inside = dict(line.split("=", 1) for line in call["env_file"].splitlines())
    port, work_dir = inside["GPUORCH_PORT"], inside["GPUORCH_WORK_DIR"]
    assert option(call["argv"], "--publish") == [f"127.0.0.1:{port}:{port}"]
    assert call["argv"][-3:] == ["--port", port, "0"]  # $(GPUORCH_PORT) expanded
    assert option(call["argv"], "--workdir") == [work_dir] and Path(work_dir).is_dir()
    assert f"type=bind,source={work_dir},target={work_dir}" in option(call["argv"], "--mount")
