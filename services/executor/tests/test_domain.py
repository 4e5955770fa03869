"""Pure logic: classification, allow-list, fencing, lifecycle, job environment, configuration."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from gpuorch_contracts import ArrayTask, ContainerRun, ProcessRun

from gpuorch_executor.config import ConfigError, ExecutorConfig
from gpuorch_executor.domain.allowlist import (
    DEFAULT_ALLOW_LIST,
    AllowListError,
    image_repository,
    load_allow_list,
)
from gpuorch_executor.domain.environment import job_environment
from gpuorch_executor.domain.fencing import LeaseFence, predates_recovery
from gpuorch_executor.domain.lifecycle import IllegalTransition, check_transition, event_id
from gpuorch_executor.domain.outcome import ExitReport, classify

from .conftest import launch_job

DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(("report", "stop", "kind", "cause"), [
    (ExitReport(exit_code=0), None, "finished", None),
    (ExitReport(exit_code=2), None, "failed", "nonzero_exit"),
    (ExitReport(signal=15), None, "failed", "killed"),
    (ExitReport(signal=9, oom_kills=1, memory_limited=True), None, "failed", "host_oom"),
    (ExitReport(signal=9), None, "failed", "killed"),
    (ExitReport(exit_code=137, container=True, memory_limited=True), None, "failed", "host_oom"),
    (ExitReport(exit_code=137, container=True, memory_limited=False), None, "failed", "nonzero_exit"),
    (ExitReport(exit_code=125, container=True, output_tail="docker: no such image"), None, "failed",
     "launch_error"),
    (ExitReport(exit_code=1, output_tail="... CUDA out of memory ..."), None, "failed", "gpu_oom"),
    (ExitReport(signal=6, output_tail="CUDA_ERROR_OUT_OF_MEMORY"), None, "failed", "gpu_oom"),
    (ExitReport(exit_code=0, output_tail="CUDA out of memory (recovered)"), None, "finished", None),
    (ExitReport(launch_error="FileNotFoundError"), None, "failed", "launch_error"),
    (ExitReport(exit_code=0), "max_runtime", "failed", "max_runtime"),
    (ExitReport(signal=9), "fenced", "failed", "lost"),
    (ExitReport(exit_code=0), "preempt", "failed", "killed"),
    (ExitReport(signal=9, oom_kills=1), "cancel", "failed", "killed"),
])
def test_classification(report: ExitReport, stop: str | None, kind: str, cause: str | None) -> None:
    outcome = classify(report, stop)  # type: ignore[arg-type]
    assert (outcome.kind, outcome.cause) == (kind, cause)


def test_signal_exit_code_follows_the_shell_convention() -> None:
    assert classify(ExitReport(signal=9)).exit_code == 137


def test_default_allow_list_runs_python_scripts_for_the_default_tenant_only() -> None:
    run = ProcessRun(argv=["python", "train.py", "--epochs", "3"])
    assert DEFAULT_ALLOW_LIST.check_process("default", run, "/usr/bin/python") is None
    assert DEFAULT_ALLOW_LIST.check_process("other", run, "/usr/bin/python") is not None
    inline = DEFAULT_ALLOW_LIST.check_process("default", ProcessRun(argv=["python", "-c", "print(42)"]),
                                              "/usr/bin/python")
    assert inline is not None and "inline code" in inline.reason
    assert DEFAULT_ALLOW_LIST.check_process("default", ProcessRun(argv=["sh", "x.sh"]), "/bin/sh") is not None


def test_bare_names_do_not_allow_paths(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    refusal = DEFAULT_ALLOW_LIST.check_process("default", ProcessRun(argv=[str(fake)]), str(fake))
    assert refusal is not None and "not allowed" in refusal.reason


def test_absolute_entries_match_the_resolved_path(tmp_path: Path) -> None:
    binary = tmp_path / "train"
    binary.write_text("")
    allow = load_allow_list(json.dumps({"tenants": {"ml": {"commands": [str(binary)]}}}))
    assert allow.check_process("ml", ProcessRun(argv=[str(binary)]), str(binary)) is None
    assert allow.check_process("ml", ProcessRun(argv=["train"]), str(binary)) is not None


@pytest.mark.parametrize("argv", [["sh", "-c", "x"], ["bash", "-ec", "x"], ["/bin/zsh", "-c", "x"],
                                  ["dash", "--command", "x"]])
def test_shell_strings_are_refused_unless_allowed(argv: list[str]) -> None:
    denied = load_allow_list('{"tenants": {"t": {"commands": ["sh", "bash", "zsh", "dash", "/bin/zsh"]}}}')
    allowed = load_allow_list('{"tenants": {"t": {"commands": ["sh", "bash", "zsh", "dash", "/bin/zsh"], '
                              '"allow_shell": true}}}')
    refusal = denied.check_process("t", ProcessRun(argv=argv), argv[0])
    assert refusal is not None and "inline code" in refusal.reason
    assert allowed.check_process("t", ProcessRun(argv=argv), argv[0]) is None


INTERPRETERS = ["python", "python3", "python3.11", "node", "perl", "ruby", "sh", "bash", "php", "Rscript"]


@pytest.mark.parametrize("argv", [
    ["python", "-c", "x"], ["python3", "-Bc", "x"], ["python3.11", "-u", "-c", "x"], ["python", "-cimport os"],
    ["python3", "-W", "ignore", "-c", "x"], ["node", "-e", "x"], ["node", "--eval=x"], ["node", "-p", "1"],
    ["perl", "-e", "x"], ["perl", "-lne", "x"], ["ruby", "-e", "x"], ["sh", "-c", "x"], ["bash", "-c", "x"],
    ["php", "-r", "x"], ["Rscript", "-e", "x"],
])
def test_inline_interpreter_code_is_refused_by_default_and_allowed_by_a_tenants_entry(argv: list[str]) -> None:
    denied = load_allow_list(json.dumps({"tenants": {"t": {"commands": INTERPRETERS}}}))
    allowed = load_allow_list(json.dumps({"tenants": {"t": {"commands": INTERPRETERS, "inline_code": True}}}))
    refusal = denied.check_process("t", ProcessRun(argv=argv), f"/usr/bin/{argv[0]}")
    assert refusal is not None and "inline code" in refusal.reason and '"inline_code": true' in refusal.reason
    assert allowed.check_process("t", ProcessRun(argv=argv), f"/usr/bin/{argv[0]}") is None


@pytest.mark.parametrize("argv", [
    ["python", "train.py", "-c", "config.yaml"], ["python", "-u", "run.py"], ["python3", "-W", "error", "script.py"],
    ["node", "server.js"], ["perl", "script.pl"],
])
def test_scripts_are_not_inline_code(argv: list[str]) -> None:
    denied = load_allow_list(json.dumps({"tenants": {"t": {"commands": INTERPRETERS}}}))
    assert denied.check_process("t", ProcessRun(argv=argv), f"/usr/bin/{argv[0]}") is None


def test_modules_run_only_when_listed() -> None:
    allow = load_allow_list(json.dumps({"tenants": {"t": {"commands": INTERPRETERS, "modules": ["pkg"]}}}))
    assert allow.check_process("t", ProcessRun(argv=["python3", "-m", "pkg", "-c", "x"]), "/usr/bin/python3") is None
    refused = allow.check_process("t", ProcessRun(argv=["python3", "-m", "other"]), "/usr/bin/python3")
    assert refused is not None and "not in tenant 't'" in refused.reason


def test_container_network_and_user_come_from_the_tenants_entry() -> None:
    allow = load_allow_list(json.dumps({"tenants": {
        "web": {"images": ["x"], "network": "bridge", "container_user": "1000:1000"}, "t": {"images": ["x"]}}}))
    web, plain = allow.policy_for("web"), allow.policy_for("t")
    assert web is not None and (web.network, web.container_user) == ("bridge", "1000:1000")
    assert plain is not None and (plain.network, plain.container_user) == ("none", None)
    for bad in ({"network": "host"}, {"container_user": "0:0"}, {"container_user": "root"}):
        with pytest.raises(AllowListError):
            load_allow_list(json.dumps({"tenants": {"t": {"images": ["x"], **bad}}}))


def test_images_by_repository_and_prefix() -> None:
    allow = load_allow_list(json.dumps({"tenants": {
        "t": {"images": ["ghcr.io/acme/trainer", "registry.local:5000/team/"]}, "*": {"images": ["busybox"]}}}))
    ok = [f"ghcr.io/acme/trainer@{DIGEST}", f"ghcr.io/acme/trainer:v1@{DIGEST}",
          f"registry.local:5000/team/x/y@{DIGEST}"]
    for image in ok:
        assert allow.check_container("t", ContainerRun(image=image)) is None, image
    for image in [f"ghcr.io/acme/trainer2@{DIGEST}", f"ghcr.io/acme@{DIGEST}", f"registry.local:5000/other@{DIGEST}"]:
        assert allow.check_container("t", ContainerRun(image=image)) is not None, image
    assert allow.check_container("someone", ContainerRun(image=f"busybox@{DIGEST}")) is None
    assert image_repository(f"registry.local:5000/team/app:tag@{DIGEST}") == "registry.local:5000/team/app"


def test_tags_are_refused_by_the_contract() -> None:
    with pytest.raises(ValueError, match="sha256"):
        ContainerRun(image="python:3.11")


@pytest.mark.parametrize("mount", [
    {"source": "/", "target": "/host"}, {"source": "/var/run/docker.sock", "target": "/s"},
    {"source": "data", "target": "/data"}, {"source": "/data/../etc", "target": "/data"},
    {"source": "/data", "target": "/d,readonly=false"},
])
def test_dangerous_mounts_are_refused_at_configuration(mount: dict[str, str]) -> None:
    with pytest.raises(AllowListError):
        load_allow_list(json.dumps({"tenants": {"t": {"mounts": [mount]}}}))


def test_allow_list_from_a_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "allow.json"
    path.write_text('{"tenants": {"ml": {"commands": ["python3"]}}}')
    assert load_allow_list(str(path)).policy_for("ml") is not None
    with pytest.raises(AllowListError):
        load_allow_list('{"tenants": {"ml": {"comands": []}}}')
    with pytest.raises(AllowListError):
        load_allow_list("{not json")


def test_fence_fires_once_grace_before_the_deadline_and_recovers() -> None:
    fence = LeaseFence(deadline_s=60, grace_s=10)
    assert fence.observe(0, 0).action == "none"
    assert fence.observe(0, 49.9).action == "none"
    decision = fence.observe(100, 150)
    assert decision.action == "fence" and decision.kill_by == 160  # the deadline counts from the last renewal
    assert fence.observe(100, 155).action == "none"  # once per lapse
    assert fence.observe(170, 170).action == "recovered"
    assert fence.observe(171, 171).action == "none"
    assert fence.observe(200, 240).action == "none"  # a new lapse starts a new count
    assert fence.observe(200, 250).action == "fence"


def test_renewals_within_the_deadline_never_fence() -> None:
    fence = LeaseFence(deadline_s=60, grace_s=10)
    for now in range(0, 1000, 7):
        assert fence.observe(now - 49, now).action == "none"


@pytest.mark.parametrize(("decided", "recovered", "refused"), [
    (10.0, None, False), (10.0, 12.0, True), (12.0, 12.0, False), (13.0, 12.0, False)])
def test_a_launch_decided_before_the_last_recovery_is_stale(decided: float, recovered: float | None,
                                                            refused: bool) -> None:
    assert predates_recovery(decided, recovered) is refused


def test_grace_is_clamped_to_the_deadline() -> None:
    fence = LeaseFence(deadline_s=5, grace_s=50)
    assert fence.stop_after_s == 0
    assert fence.observe(10, 10).action == "fence"
    with pytest.raises(ValueError):
        LeaseFence(deadline_s=0, grace_s=0)


def test_lifecycle_refuses_going_back() -> None:
    check_transition("launching", "running")
    check_transition("running", "stopping")
    check_transition("stopping", "ended")
    for current, target in [("ended", "running"), ("stopping", "running"), ("running", "launching")]:
        with pytest.raises(IllegalTransition):
            check_transition(current, target)


def test_event_ids_are_deterministic_per_placement() -> None:
    placement = uuid.uuid4()
    assert event_id(placement, "outcome", "n1") == event_id(placement, "outcome", "n1")
    assert event_id(placement, "outcome", "n1") != event_id(placement, "started", "n1")
    assert event_id(placement, "outcome", "n1") != event_id(uuid.uuid4(), "outcome", "n1")
    # a gang's ranks are one placement on several nodes: each node's outcome is an event of its own
    assert event_id(placement, "outcome", "n1") != event_id(placement, "outcome", "n2")


def test_environment_reserved_variables_win_and_only_basics_are_inherited() -> None:
    command = launch_job(["python"], gpus=["GPU-a"], env={"CUDA_VISIBLE_DEVICES": "0,1,2", "PATH": "/opt/bin",
                                                          "GPUORCH_JOB_ID": "forged"})
    env = job_environment(command, "/ck", {"PATH": "/usr/bin", "HOME": "/root", "GPUORCH_AMQP_URL": "amqp://x"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a" and env["GPUORCH_JOB_ID"] == str(command.job_id)
    assert env["PATH"] == "/opt/bin" and env["HOME"] == "/root" and "GPUORCH_AMQP_URL" not in env


def test_an_array_task_learns_its_array_its_index_and_the_count() -> None:
    array_id = uuid.uuid4()
    command = launch_job(["python"]).model_copy(update={
        "array_task": ArrayTask(array_job_id=array_id, task_id=7, task_count=12)})
    env = job_environment(command, "/ck", {})
    assert (env["GPUORCH_ARRAY_JOB_ID"], env["GPUORCH_ARRAY_TASK_ID"], env["GPUORCH_ARRAY_TASK_COUNT"]) == (
        str(array_id), "7", "12")
    assert "GPUORCH_ARRAY_TASK_ID" not in job_environment(launch_job(["python"]), "/ck", {})


def test_config_from_env() -> None:
    config = ExecutorConfig.from_env({"GPUORCH_NODE_IDS": "node-1, node-2,node-3",
                                      "GPUORCH_EXECUTOR_STATE_DIR": "/var/lib/gx", "GPUORCH_FENCING_DEADLINE_S": "8"})
    assert config.node_ids == ("node-1", "node-2", "node-3")
    assert config.state_dir("node-2") == Path("/var/lib/gx/node-2")
    assert config.fencing_deadline_s == 8 and config.fencing_grace_s == 4
    assert config.heartbeat_s == 4 / 3  # a third of deadline - grace when not set
    assert config.runtimes == ("process",)
    with pytest.raises(ConfigError):
        ExecutorConfig.from_env({"GPUORCH_NODE_IDS": "a,a"})
    with pytest.raises(ConfigError):
        ExecutorConfig.from_env({"GPUORCH_NODE_ID": "a", "GPUORCH_EXECUTOR_BACKEND": "vm"})


def test_a_failure_reason_quoting_hostile_output_still_makes_a_valid_event() -> None:
    """A launch error or output line with ESC, OSC, CR and NUL must not stop the job's end from being reported."""
    import uuid as _uuid

    from gpuorch_executor.domain.outcome import Outcome
    from gpuorch_executor.domain.placement import PlacementRecord
    from gpuorch_executor.domain.reports import lost_event, outcome_event

    hostile = "docker run exited 1: \x1b[31mred\x1b]0;title\x07 done\r overwrite \x00 nul" + "x" * 3000
    record = PlacementRecord(placement_id=_uuid.uuid4(), job_id=_uuid.uuid4(), node_id="n1")
    event = outcome_event(record, Outcome("failed", "launch_error", hostile, 1, 0.5), "executor/n1")
    lost = lost_event(record, hostile, "executor/n1")
    for reason in (event.reason, lost.reason):  # type: ignore[attr-defined]
        assert "\x1b" not in reason and "\x00" not in reason and "\r" not in reason
        assert "overwrite" in reason and 0 < len(reason) <= 1024  # a CR redraw keeps the last frame, as a terminal


def test_config_problems_are_named_and_a_file_may_hold_the_settings(tmp_path: Path) -> None:
    from gpuorch_executor.logs_http import LogEndpointSettings

    with pytest.raises(ConfigError, match="GPUORCH_EXECUTOR_POLL_S: Input should be greater than 0"):
        ExecutorConfig.from_env({"GPUORCH_NODE_ID": "a", "GPUORCH_EXECUTOR_POLL_S": "0"})
    with pytest.raises(ConfigError, match="GPUORCH_EXECUTOR_HEARTBEAT_S must be positive and at most half"):
        ExecutorConfig.from_env({"GPUORCH_NODE_ID": "a", "GPUORCH_EXECUTOR_HEARTBEAT_S": "40"})
    file = tmp_path / "executor.toml"
    file.write_text('GPUORCH_NODE_IDS = "n1,n2"\nGPUORCH_METRICS_PORT = 9101\n')
    config = ExecutorConfig.from_env({"GPUORCH_METRICS_PORT": "9200"}, file)
    assert config.node_ids == ("n1", "n2") and config.metrics_port == 9200
    assert LogEndpointSettings.from_env({}) is None
    with pytest.raises(ConfigError, match="GPUORCH_LOGS_TOKEN is not"):
        LogEndpointSettings.from_env({"GPUORCH_LOGS_PORT": "9300"})
    with pytest.raises(ConfigError, match="GPUORCH_LOGS_PORT: Input should be a valid integer"):
        LogEndpointSettings.from_env({"GPUORCH_LOGS_PORT": "http", "GPUORCH_LOGS_TOKEN": "t"})
