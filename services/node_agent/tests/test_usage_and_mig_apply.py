"""Usage follows real processes that name simulated UUIDs; MIG layouts are applied, or refused while work runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from gpuorch_contracts import ApplyMigLayout, GpuUsageSampled, MigGpuLayout, MigLayoutApplied, NodeRegistered
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.fleet import publish_batch
from gpuorch_node_agent.handlers import ApplyMigLayoutHandler
from gpuorch_node_agent.leader_epochs import LeaderEpochStore
from gpuorch_node_agent.sim.nvml import SimulatedNvml
from gpuorch_node_agent.sim.processes import ProcessTable, parse_usage
from gpuorch_node_agent.sim.profiles import device_profile


@pytest.fixture
def spawn() -> Iterator:
    started: list[subprocess.Popen] = []

    def start(env: dict[str, str]) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   env={**os.environ, **env})
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def _node(profile: str = "h100", gpus: int = 2, node_id: str = "usage-node") -> NodeAgent:
    nvml = SimulatedNvml(node_id, device_profile(profile), gpus, seed=5, processes=ProcessTable(max_age_s=0))
    agent = NodeAgent(node_id, nvml, cpu_milli=1000, memory_mib=1024)
    agent.start()
    return agent


def _samples(agent: NodeAgent):
    return next(m for m in agent.usage_message() if isinstance(m, GpuUsageSampled)).samples


def test_declared_usage_of_a_process_shows_on_its_gpu(spawn):
    agent = _node()
    gpu1 = agent.uuid_of(1)
    job = spawn({"CUDA_VISIBLE_DEVICES": gpu1, "GPUORCH_SIM_USAGE": "util=85,mem_mib=20000"})
    idle, busy = _samples(agent)
    assert idle.processes == [] and idle.utilization_pct == 0 and "gpu_idle" in idle.throttle_reasons
    assert busy.utilization_pct == 85
    assert busy.memory_used_mib == 20000
    assert [(p.pid, p.gpu_memory_mib, p.sm_util_pct) for p in busy.processes] == [(job.pid, 20000, 85.0)]
    assert busy.power_w > idle.power_w and busy.temperature_c > idle.temperature_c
    heartbeat = agent.heartbeat_messages()[-1]
    assert heartbeat.gpus[1].utilization_pct == 85 and heartbeat.gpus[1].memory_used_mib == 20000


def test_declared_memory_grows_while_the_process_runs(spawn):
    agent = _node(node_id="usage-node-3")
    job = spawn({"CUDA_VISIBLE_DEVICES": agent.uuid_of(0), "GPUORCH_SIM_USAGE": "mem_mib=3000,mem_mib_from=0.5:30720"})
    seen = [_samples(agent)[0].memory_used_mib]
    give_up = time.monotonic() + 30  # guards against a hang only: the step shows once the process is 0.5 s old
    while seen[-1] != 30720:
        assert seen[-1] in (0, 3000) and job.poll() is None and time.monotonic() < give_up, seen[-5:]
        seen.append(_samples(agent)[0].memory_used_mib)
    assert 3000 in seen or seen[0] == 30720  # on a slow machine the first scan may already be past the step


def test_undeclared_utilisation_is_idle_and_throttle_can_be_declared(spawn):
    agent = _node(node_id="usage-node-2")
    spawn({"NVIDIA_VISIBLE_DEVICES": agent.uuid_of(0), "GPUORCH_SIM_USAGE": "throttle=power"})
    sample = _samples(agent)[0]
    assert sample.utilization_pct == 0  # declares no util: looks idle (a sleeping notebook must)
    assert 0.25 * 81559 <= sample.memory_used_mib <= 0.75 * 81559
    assert sample.throttle_reasons == ["sw_power_cap"]


def test_parse_usage_format():
    usage = parse_usage("util=85, mem_mib=20000,throttle=thermal,bogus=1,mem_pct=x")
    assert (usage.util_pct, usage.mem_mib, usage.mem_pct, usage.throttle) == (85.0, 20000, None, "thermal")
    assert parse_usage("util=500").util_pct == 100


async def test_mig_apply_refused_while_work_runs_then_applied(spawn, tmp_path):
    agent = _node(node_id="mig-node")
    publisher = RecordingPublisher()
    handler = ApplyMigLayoutHandler({agent.node_id: agent}, lambda ms: publish_batch(publisher, ms),
                                    LeaderEpochStore(tmp_path))
    agent.heartbeat_messages()  # the initial inventory was sent
    job = spawn({"CUDA_VISIBLE_DEVICES": agent.uuid_of(0)})
    command = ApplyMigLayout(node_id=agent.node_id, layouts=[
        MigGpuLayout(gpu_index=0, profiles=["3g.40gb", "3g.40gb"]),
        MigGpuLayout(gpu_index=1, profiles=["4g.40gb", "2g.20gb", "1g.10gb"]),
    ])
    await handler(command)
    refused, applied = handler.outcomes[agent.node_id]
    assert not refused.applied and f"pid {job.pid}" in refused.reason and "drain" in refused.reason
    assert applied.applied
    answer = publisher.of_type(MigLayoutApplied)[-1]
    assert answer.command_id == str(command.message_id)
    assert [(o.gpu_index, o.applied) for o in answer.outcomes] == [(0, False), (1, True)]
    assert "drain" in answer.outcomes[0].reason
    inventory = publisher.of_type(NodeRegistered)[-1].inventory
    assert inventory.gpus[0].mig_enabled is False and inventory.gpus[0].mig_instances == []
    assert sorted(m.profile for m in inventory.gpus[1].mig_instances) == ["1g.10gb", "2g.20gb", "4g.40gb"]
    assert all(m.uuid.startswith("MIG-") for m in inventory.gpus[1].mig_instances)
    assert not any(a == 1 or b == 1 for a, b in inventory.nvlink_pairs)  # no NVLink P2P in MIG mode

    # a process on a MIG instance is work on that GPU too
    mig_uuid = inventory.gpus[1].mig_instances[0].uuid
    mig_job = spawn({"CUDA_VISIBLE_DEVICES": mig_uuid, "GPUORCH_SIM_USAGE": "mem_mib=1000"})
    sample = _samples(agent)[1]
    assert [(p.pid, p.gpu_instance_uuid, p.gpu_memory_mib) for p in sample.processes] == [
        (mig_job.pid, mig_uuid, 1000)]
    registrations = len(publisher.of_type(NodeRegistered))
    await handler(ApplyMigLayout(node_id=agent.node_id, layouts=[MigGpuLayout(gpu_index=1, profiles=[])]))
    assert not handler.outcomes[agent.node_id][0].applied
    assert not publisher.of_type(MigLayoutApplied)[-1].outcomes[0].applied  # a refusal is answered, not silent
    assert len(publisher.of_type(NodeRegistered)) == registrations  # nothing changed, no new inventory

    job.kill()
    job.wait()
    await handler(ApplyMigLayout(node_id=agent.node_id, layouts=[
        MigGpuLayout(gpu_index=0, profiles=["3g.40gb", "3g.40gb"])]))
    assert handler.outcomes[agent.node_id][0].applied
    gpu0 = publisher.of_type(NodeRegistered)[-1].inventory.gpus[0]
    assert gpu0.mig_enabled and [(m.profile, m.placement_start, m.placement_size) for m in gpu0.mig_instances] == [
        ("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]


async def test_mig_apply_refusals_without_work(tmp_path):
    agent = _node(profile="l4", gpus=1, node_id="no-mig")
    handler = ApplyMigLayoutHandler({agent.node_id: agent}, lambda ms: publish_batch(RecordingPublisher(), ms),
                                    LeaderEpochStore(tmp_path))
    await handler(ApplyMigLayout(node_id="no-mig", layouts=[MigGpuLayout(gpu_index=0, profiles=["1g.10gb"]),
                                                             MigGpuLayout(gpu_index=3, profiles=["1g.10gb"])]))
    no_support, no_gpu = handler.outcomes["no-mig"]
    assert "no MIG support" in no_support.reason and "no GPU 3" in no_gpu.reason
    h100 = _node(gpus=1, node_id="bad-layout")
    handler = ApplyMigLayoutHandler({h100.node_id: h100}, lambda ms: publish_batch(RecordingPublisher(), ms),
                                    LeaderEpochStore(tmp_path))
    await handler(ApplyMigLayout(node_id="bad-layout", layouts=[
        MigGpuLayout(gpu_index=0, profiles=["4g.40gb", "4g.40gb"])]))
    assert "allows 1" in handler.outcomes["bad-layout"][0].reason
    assert h100.inventory is not None and h100.inventory.gpus[0].mig_enabled is False
    h100.nvml.lose_gpu(0)
    h100.heartbeat_messages()
    await handler(ApplyMigLayout(node_id="bad-layout", layouts=[MigGpuLayout(gpu_index=0, profiles=["7g.80gb"])]))
    assert "unhealthy" in handler.outcomes["bad-layout"][0].reason


class _StrictCiNvml(SimulatedNvml):
    """Answers a compute-instance query for a profile larger than the GPU instance with INVALID_ARGUMENT, one of the
    codes NVML documents for an invalid ``profileId`` (NVIDIA's mig-parted skips both it and NOT_SUPPORTED)."""

    def nvmlGpuInstanceGetComputeInstances(self, gpu_instance, profile_id, instances_ref, count_ref):
        import pynvml

        slices = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}.get(profile_id)
        if slices is None or slices > self._gi(gpu_instance).spec.compute_slices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return super().nvmlGpuInstanceGetComputeInstances(gpu_instance, profile_id, instances_ref, count_ref)


async def test_a_layout_replaces_instances_when_nvml_calls_unsupported_compute_profiles_invalid(tmp_path):
    nvml = _StrictCiNvml("strict-ci", device_profile("h100"), 1, seed=5, processes=ProcessTable(max_age_s=0))
    agent = NodeAgent("strict-ci", nvml, cpu_milli=1000, memory_mib=1024)
    agent.start()
    handler = ApplyMigLayoutHandler({agent.node_id: agent}, lambda ms: publish_batch(RecordingPublisher(), ms),
                                    LeaderEpochStore(tmp_path))
    for profiles in (["3g.40gb", "3g.40gb"], ["1g.10gb"] * 7):
        await handler(ApplyMigLayout(node_id="strict-ci", layouts=[MigGpuLayout(gpu_index=0, profiles=profiles)]))
        (outcome,) = handler.outcomes["strict-ci"]
        assert outcome.applied, outcome.reason
    assert agent.inventory is not None
    assert [m.profile for m in agent.inventory.gpus[0].mig_instances] == ["1g.10gb"] * 7


async def test_mig_apply_of_a_superseded_leader_is_refused_and_answered(tmp_path):
    """The executor's rule (``gpuorch_contracts.leader_epoch``) on ApplyMigLayout: once epoch 3 was seen, an epoch-2
    command changes nothing and is answered refused; epoch 0 (a sender without epochs) is still admitted."""
    agent = _node(gpus=1, node_id="epoch-node")
    publisher = RecordingPublisher()
    handler = ApplyMigLayoutHandler({agent.node_id: agent}, lambda ms: publish_batch(publisher, ms),
                                    LeaderEpochStore(tmp_path))
    agent.heartbeat_messages()

    def layout(profiles: list[str], epoch: int) -> ApplyMigLayout:
        return ApplyMigLayout(node_id=agent.node_id, layouts=[MigGpuLayout(gpu_index=0, profiles=profiles)],
                              leader_epoch=epoch)

    await handler(layout(["7g.80gb"], 3))
    assert handler.outcomes[agent.node_id][0].applied
    registrations = len(publisher.of_type(NodeRegistered))
    stale = layout(["3g.40gb", "3g.40gb"], 2)
    await handler(stale)
    answer = publisher.of_type(MigLayoutApplied)[-1]
    assert answer.command_id == str(stale.message_id) and not answer.outcomes[0].applied
    assert "epoch 2, older than epoch 3" in answer.outcomes[0].reason
    assert len(publisher.of_type(NodeRegistered)) == registrations  # nothing changed on the GPU
    assert [m.profile for m in agent.inventory.gpus[0].mig_instances] == ["7g.80gb"]
    await handler(layout(["3g.40gb", "3g.40gb"], 0))
    assert handler.outcomes[agent.node_id][0].applied and handler.leader_epochs.newest_seen(agent.node_id) == 3


async def test_the_newest_leader_epoch_outlives_the_handler_and_an_unwritable_one_changes_nothing(tmp_path):
    """A second handler on the same state root (a restarted node-agent) still refuses epoch 2 after epoch 3; when
    the epoch cannot be recorded the handler raises before it touches a GPU (the command is redelivered)."""
    agent = _node(gpus=1, node_id="epoch-restart")
    agent.heartbeat_messages()

    def layout(profiles: list[str], epoch: int) -> ApplyMigLayout:
        return ApplyMigLayout(node_id=agent.node_id, layouts=[MigGpuLayout(gpu_index=0, profiles=profiles)],
                              leader_epoch=epoch)

    def handler(root) -> ApplyMigLayoutHandler:
        return ApplyMigLayoutHandler({agent.node_id: agent}, lambda ms: publish_batch(RecordingPublisher(), ms),
                                     LeaderEpochStore(root))

    await handler(tmp_path)(layout(["7g.80gb"], 3))
    restarted = handler(tmp_path)
    await restarted(layout(["3g.40gb", "3g.40gb"], 2))
    assert not restarted.outcomes[agent.node_id][0].applied
    assert [m.profile for m in agent.inventory.gpus[0].mig_instances] == ["7g.80gb"]

    (tmp_path / "not-a-directory").write_text("")
    unwritable = handler(tmp_path / "not-a-directory")
    with pytest.raises(OSError):
        await unwritable(layout(["3g.40gb", "3g.40gb"], 4))
    assert [m.profile for m in agent.inventory.gpus[0].mig_instances] == ["7g.80gb"]


def test_a_process_that_inherits_its_parents_declaration_is_not_listed(spawn):
    """A wrapper's helpers (a pyenv shim's, a shell's fork) inherit the job's declaration: only the process that
    declares its own holds memory (``simulated_usage``), as in the executor's declared probe."""
    gpu = "GPU-inherit-0000-0000-0000-000000000001"
    fork = ("import os, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", fork],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "GPUORCH_SIM_USAGE": "mem_mib=3000"})
    try:
        give_up = time.monotonic() + 30
        while not _children(parent.pid):
            assert time.monotonic() < give_up, "the child did not start"
            time.sleep(0.05)
        assert {p.pid for p in ProcessTable(max_age_s=0).snapshot().get(gpu, [])} == {parent.pid}
    finally:
        for child in _children(parent.pid):
            os.kill(child, 9)
        parent.kill()
        parent.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []
