"""Calling NVML so that a failing call never crashes the agent.

``NvmlReader.call(name, *args)`` returns the call's result, or ``None`` when it raised. Every failure except the
expected ones (``NOT_SUPPORTED``, and any code in ``quiet``) is recorded in ``failures`` as ``"function: error"``
for the next heartbeat and counted in ``gpuorch_node_agent_nvml_errors_total{function}``; ``GPU_IS_LOST`` also
sets ``lost``. Works with the real ``pynvml`` module and with ``SimulatedNvml`` alike (both expose ``NVMLError``
with ``.value``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
MAX_FAILURES = 64
NVML_ERRORS = Counter("gpuorch_node_agent_nvml_errors_total",
                      "NVML calls that failed unexpectedly (not NOT_SUPPORTED), by NVML function", ["function"])


class NvmlReader:
    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.failures: list[str] = []
        self.lost = False

    def call(self, name: str, *args: Any, quiet: Iterable[int] = ()) -> Any:
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == NVML_ERROR_GPU_IS_LOST:
                self.lost = True
            if code == NVML_ERROR_NOT_SUPPORTED or code in tuple(quiet):
                return None
            self._record(name, f"{name}: {_describe(exc)}")
        except Exception as exc:
            self._record(name, f"{name}: {type(exc).__name__}: {exc}")
        return None

    def _record(self, function: str, failure: str) -> None:
        NVML_ERRORS.labels(function).inc()
        if len(self.failures) < MAX_FAILURES and failure not in self.failures:
            self.failures.append(failure)

    def take_failures(self) -> list[str]:
        failures, self.failures = self.failures, []
        return failures


def _describe(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:
        return f"NVML error {getattr(exc, 'value', '?')}"


def text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
