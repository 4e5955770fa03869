"""The agent's NVML code against the real nvidia-ml-py on a real GPU (skipped where NVML cannot start)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def real_nvml():
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver here: {exc}")
    yield pynvml
    pynvml.nvmlShutdown()


def test_real_discovery_and_readings(real_nvml):
    from gpuorch_node_agent.agent import NodeAgent

    agent = NodeAgent("gpu-test-node", real_nvml, cpu_milli=1000, memory_mib=1024)
    agent.start()
    inventory = agent.inventory
    assert inventory is not None
    assert len(inventory.gpus) == real_nvml.nvmlDeviceGetCount() > 0
    gpu = inventory.gpus[0]
    assert gpu.uuid.startswith("GPU-") and gpu.memory_total_mib > 0 and gpu.compute_capability
    assert gpu.health == "healthy"
    heartbeat = agent.heartbeat_messages()[-1]
    assert heartbeat.gpus[0].memory_used_mib is not None and heartbeat.gpus[0].temperature_c is not None
    sample = agent.usage_message()[-1].samples[0]
    assert sample.memory_total_mib == gpu.memory_total_mib
    assert sample.sm_clock_mhz is not None


def test_real_event_watcher_starts_and_stops(real_nvml):
    from gpuorch_node_agent.nvml.discovery import device_handles
    from gpuorch_node_agent.nvml.events import HealthEventWatcher
    from gpuorch_node_agent.nvml.reader import NvmlReader

    failures: list[str] = []
    watcher = HealthEventWatcher(real_nvml, device_handles(real_nvml, NvmlReader(real_nvml)),
                                 lambda *event: None, failures.append, wait_ms=100)
    watcher.start()
    assert watcher.ready.wait(10)
    watcher.stop()
    assert watcher.registered > 0 or failures  # registered, or said why not (e.g. no permission)


def test_real_mig_profiles_if_mig_capable(real_nvml):
    from gpuorch_node_agent.nvml.discovery import device_handles, read_mig_offers
    from gpuorch_node_agent.nvml.reader import NvmlReader

    reader = NvmlReader(real_nvml)
    handle = device_handles(real_nvml, reader)[0]
    offers = read_mig_offers(real_nvml, reader, handle)
    if not offers:
        pytest.skip("GPU 0 has no MIG support")
    seven = [o for o in offers if o.compute_slices == 7]
    assert seven and seven[0].starts == (0,) and seven[0].placement_size == 8
    ones = [o for o in offers if o.profile_id == 19]
    assert ones and ones[0].starts == (0, 1, 2, 3, 4, 5, 6)
