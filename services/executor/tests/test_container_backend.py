"""The container backend's command line (no Docker engine here), and its flow through a stand-in ``docker``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from gpuorch_contracts import ContainerRun, JobFailed, JobFinished, JobStarted, StopJob

from gpuorch_executor.backends.base import JobLaunch
from gpuorch_executor.backends.container import ContainerBackend, docker_run_argv
from gpuorch_executor.domain.allowlist import Mount

from .conftest import NODE, Harness, container_job, launch_job

IMAGE = "registry.example/team/trainer@sha256:" + "b" * 64
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == name]


def test_docker_run_argv_isolates_the_container() -> None:
    command = container_job(IMAGE, ["python", "train.py", "--epochs", "3"], gpus=UUIDS, memory_mib=2048)
    argv = docker_run_argv(command, env_names=["GPUORCH_JOB_ID", "TOKEN"],
                           mounts=(Mount("/data/sets", "/data", True),), checkpoint_dir="/state/p/checkpoint",
                           cidfile="/state/p/container.id")
    assert argv[:3] == ["docker", "run", "--rm"]
    assert option(argv, "--gpus") == ['"device=' + ",".join(UUIDS) + '"']
    assert option(argv, "--cpus") == ["1"]
    assert option(argv, "--memory") == ["2048m"] and option(argv, "--memory-swap") == ["2048m"]
    assert option(argv, "--security-opt") == ["no-new-privileges"]
    assert option(argv, "--cap-drop") == ["ALL"]
    assert option(argv, "--name") == [f"gpuorch-{command.placement_id}"]
    assert option(argv, "--cidfile") == ["/state/p/container.id"]
    assert option(argv, "--mount") == ["type=bind,source=/data/sets,target=/data,readonly",
                                       "type=bind,source=/state/p/checkpoint,target=/gpuorch/checkpoint"]
    assert option(argv, "-e") == ["GPUORCH_JOB_ID", "TOKEN"]  # names only: values never on the command line
    assert "--privileged" not in argv and "-v" not in argv and "--volume" not in argv
    assert not any(arg.startswith(("--network", "--pid=", "--ipc", "--userns", "--device")) for arg in argv)
    assert "--pid" not in argv
    image_at = argv.index(IMAGE)
    assert argv[image_at + 1:] == ["python", "train.py", "--epochs", "3"]


def test_a_job_without_gpus_gets_no_gpus_option() -> None:
    argv = docker_run_argv(container_job(IMAGE, []), env_names=[])
    assert "--gpus" not in argv and argv[-1] == IMAGE


def test_a_single_gpu() -> None:
    argv = docker_run_argv(container_job(IMAGE, [], gpus=UUIDS[:1]), env_names=[])
    assert option(argv, "--gpus") == [f'"device={UUIDS[0]}"']


def test_prepare_passes_values_through_the_docker_client_environment(tmp_path: Path) -> None:
    command = launch_job([], run=ContainerRun(image=IMAGE, argv=["run"], env={"TOKEN": "s3cret"}), gpus=UUIDS[:1])
    job = JobLaunch(launch=command, placement_dir=tmp_path, log_path=tmp_path / "log",
                    checkpoint_file=tmp_path / "checkpoint" / "confirmed",
                    executor_env={"PATH": "/usr/bin", "DOCKER_HOST": "unix:///run/d.sock",
                                  "GPUORCH_AMQP_URL": "amqp://secret"})
    supervised = ContainerBackend("/usr/bin/docker").prepare(job)
    assert supervised.argv[0] == "/usr/bin/docker"
    assert "s3cret" not in " ".join(supervised.argv)
    assert supervised.env["TOKEN"] == "s3cret" and supervised.env["DOCKER_HOST"] == "unix:///run/d.sock"
    assert supervised.env["GPUORCH_CHECKPOINT_FILE"] == "/gpuorch/checkpoint/confirmed"
    assert "GPUORCH_AMQP_URL" not in supervised.env
    assert supervised.container_name == f"gpuorch-{command.placement_id}"


FAKE_DOCKER = """#!{python}
import json, os, signal, sys, time
calls = {calls!r}
with open(calls, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "TOKEN": os.environ.get("TOKEN")}}) + "\\n")
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
    command = launch_job([], run=ContainerRun(image=IMAGE, argv=["train", "0"], env={"TOKEN": "s3cret"}),
                         gpus=UUIDS[:1], tenant="images")
    await harness.executor.handle(command)
    [started] = harness.publisher.of_type(JobStarted)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFinished)
    assert started.container_id in ("c0ffee", f"gpuorch-{command.placement_id}")
    [call] = [json.loads(line) for line in calls.read_text().splitlines()]
    assert call["argv"][0] == "run" and call["TOKEN"] == "s3cret"
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
