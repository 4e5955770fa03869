"""A failing NVML never crashes the agent: fields become unknown and the failures are reported."""

from __future__ import annotations

import pynvml
from gpuorch_contracts import NodeHeartbeat, NodeRegistered
from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.sim.nvml import SimulatedNvml
from gpuorch_node_agent.sim.processes import StaticProcessTable
from gpuorch_node_agent.sim.profiles import device_profile


def _agent(**fail) -> tuple[NodeAgent, SimulatedNvml]:
    nvml = SimulatedNvml("flaky", device_profile("a100"), 4, processes=StaticProcessTable())
    nvml.fail_calls(**fail)
    return NodeAgent("flaky", nvml, cpu_milli=8000, memory_mib=65536), nvml


def test_every_call_failing_including_init():
    agent, nvml = _agent(error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert agent.start() == []
    messages = agent.heartbeat_messages()
    registered = [m for m in messages if isinstance(m, NodeRegistered)]
    heartbeat = messages[-1]
    assert isinstance(heartbeat, NodeHeartbeat)
    assert registered and registered[0].inventory.gpus == []
    assert any(e.startswith("nvmlInit:") and "Driver Not Loaded" in e for e in heartbeat.nvml_errors)
    assert agent.usage_message() == []
    nvml.restore_calls()  # the driver comes back: the next refresh finds the GPUs
    agent.refresh_inventory()
    assert agent.inventory is not None and len(agent.inventory.gpus) == 4


def test_every_device_call_failing_leaves_fields_unknown():
    keep = ("nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex")
    agent, nvml = _agent(keep=keep)
    agent.start()
    messages = agent.heartbeat_messages()
    inventory = next(m for m in messages if isinstance(m, NodeRegistered)).inventory
    assert len(inventory.gpus) == 4
    gpu = inventory.gpus[0]
    assert gpu.uuid == "GPU-unknown-0" and gpu.model == "unknown" and gpu.health == "unknown"
    assert gpu.compute_capability is None and gpu.pci_bus_id is None and gpu.memory_total_mib == 0
    assert inventory.topology == []
    heartbeat = messages[-1]
    assert all(g.utilization_pct is None and g.memory_used_mib is None and g.temperature_c is None
               for g in heartbeat.gpus)
    failed = {e.split(":")[0] for e in heartbeat.nvml_errors}
    assert {"nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"} <= failed
    sample = agent.usage_message()[-1].samples[0]
    assert sample.sm_clock_mhz is None and sample.ecc_uncorrected is None and sample.processes == []
    nvml.restore_calls()
    agent.refresh_inventory()
    assert agent.inventory is not None and agent.inventory.gpus[0].uuid.startswith("GPU-")
    assert agent.heartbeat_messages()[0].type == "node.registered"  # the inventory changed: re-sent


def test_single_failing_call_only_blanks_its_field():
    agent, _ = _agent(names=["nvmlDeviceGetTemperature"], error=pynvml.NVML_ERROR_UNKNOWN)
    agent.start()
    heartbeat = agent.heartbeat_messages()[-1]
    assert all(g.temperature_c is None and g.utilization_pct is not None for g in heartbeat.gpus)
    assert heartbeat.nvml_errors == ["nvmlDeviceGetTemperature: Unknown Error"]
    assert agent.heartbeat_messages()[-1].nvml_errors == ["nvmlDeviceGetTemperature: Unknown Error"]


def test_unimplemented_function_raises_function_not_found():
    nvml = SimulatedNvml("n", device_profile("t4"), 1)
    try:
        nvml.nvmlDeviceGetBAR1MemoryInfo(None)
    except pynvml.NVMLError_FunctionNotFound:
        pass
    else:  # pragma: no cover
        raise AssertionError("expected NVMLError_FunctionNotFound")
