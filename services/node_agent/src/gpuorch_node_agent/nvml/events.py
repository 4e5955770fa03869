"""A thread that waits on NVML health events (XID, ECC) and hands each to a callback at once.

Contract: ``on_event(uuid, event_type, event_data)`` is called from the watcher thread as soon as
``nvmlEventSetWait_v2`` returns an event (no polling delay); the callback must be thread-safe (the agent forwards to
its event loop with ``call_soon_threadsafe``). NVML failures (no event support, a GPU that cannot register) are
passed to ``on_failure`` and never end the agent; the watcher then keeps watching what it could register.
One watcher may serve many simulated nodes when their handles share an ``EventHub``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpuorch_node_agent.domain.xid import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_DRAM_RETIREMENT,
    EVENT_DRAM_RETIREMENT_FAILURE,
    EVENT_SINGLE_BIT_ECC_STORM,
    EVENT_XID,
)
from gpuorch_node_agent.nvml.reader import text

HEALTH_EVENTS = (EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC_STORM | EVENT_DRAM_RETIREMENT
                 | EVENT_DRAM_RETIREMENT_FAILURE)
NVML_ERROR_TIMEOUT = 10


class HealthEventWatcher:
    def __init__(self, nvml: Any, handles: Sequence[Any], on_event: Callable[[str | None, int, int], None],
                 on_failure: Callable[[str], None], *, wait_ms: int = 500) -> None:
        self.nvml = nvml
        self.handles = list(handles)
        self.on_event = on_event
        self.on_failure = on_failure
        self.wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-health-events", daemon=True)
        self.registered = 0
        self._uuids: dict[int, str | None] = {}
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:
            self.on_failure(f"nvmlEventSetCreate: {exc}")
            self.ready.set()
            return
        for handle in self.handles:
            if handle is None:
                continue
            try:
                types = nvml.nvmlDeviceGetSupportedEventTypes(handle) & HEALTH_EVENTS
                if types:
                    nvml.nvmlDeviceRegisterEvents(handle, types, event_set)
                    self._uuids[_handle_key(handle)] = text(nvml.nvmlDeviceGetUUID(handle))
                    self.registered += 1
            except Exception as exc:
                self.on_failure(f"nvmlDeviceRegisterEvents: {exc}")
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) != NVML_ERROR_TIMEOUT:
                        self.on_failure(f"nvmlEventSetWait_v2: {exc}")
                        self._stop.wait(self.wait_ms / 1000.0)
                    continue
                except Exception as exc:
                    self.on_failure(f"nvmlEventSetWait_v2: {type(exc).__name__}: {exc}")
                    self._stop.wait(self.wait_ms / 1000.0)
                    continue
                uuid = self._uuids.get(_handle_key(data.device))
                if uuid is None:
                    try:
                        uuid = text(nvml.nvmlDeviceGetUUID(data.device))
                    except Exception:
                        uuid = None
                try:
                    self.on_event(uuid, int(data.eventType), int(data.eventData))
                except Exception as exc:
                    self.on_failure(f"health event callback: {exc}")
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:
                pass


def _handle_key(handle: Any) -> int:
    """Identity of a device handle: the pointer value for ctypes handles (real NVML), else the object's id."""
    if isinstance(handle, ctypes._Pointer):  # type: ignore[attr-defined]
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    return id(handle)
