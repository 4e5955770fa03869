"""An NVML call that fails unexpectedly is recorded for the heartbeat and counted per function (the node agent's
NVML errors metric); NOT_SUPPORTED is neither."""

from __future__ import annotations

from typing import Any

from gpuorch_node_agent.nvml.reader import NVML_ERROR_NOT_SUPPORTED, NvmlReader
from prometheus_client import REGISTRY


class _Error(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class _Nvml:
    NVMLError = _Error

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:  # noqa: N802 - NVML's naming
        raise _Error(999)

    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:  # noqa: N802 - NVML's naming
        raise _Error(NVML_ERROR_NOT_SUPPORTED)


def errors(function: str) -> float:
    return REGISTRY.get_sample_value("gpuorch_node_agent_nvml_errors_total", {"function": function}) or 0.0


def test_unexpected_nvml_failures_are_counted_per_function() -> None:
    reader = NvmlReader(_Nvml())
    power, fan = errors("nvmlDeviceGetPowerUsage"), errors("nvmlDeviceGetFanSpeed")
    assert reader.call("nvmlDeviceGetPowerUsage", None) is None
    assert reader.call("nvmlDeviceGetPowerUsage", None) is None
    assert reader.call("nvmlDeviceGetFanSpeed", None) is None
    assert errors("nvmlDeviceGetPowerUsage") == power + 2 and errors("nvmlDeviceGetFanSpeed") == fan
    assert reader.take_failures() == ["nvmlDeviceGetPowerUsage: NVML error 999"]
