"""One node's agent: discovery, health, heartbeats, usage samples and MIG changes over one NVML object.

Contract:
- ``start`` never raises: if ``nvmlInit`` or any later call fails, the agent keeps an inventory with unknown fields
  and reports the failed calls in the next heartbeat's ``nvml_errors`` (and retries them on the next refresh);
- ``heartbeat_messages`` returns ``GpuHealthChanged`` for health changes seen while reading, then
  ``NodeRegistered`` if the inventory hash changed since the last one sent, then ``NodeHeartbeat``;
- ``on_nvml_event`` turns one NVML event into a ``GpuHealthChanged`` to publish at once (or ``None``);
- every method runs on one thread (the event loop's); the NVML event thread only forwards events to it.

Per heartbeat (a fleet process runs thousands: issue 25) the agent hashes an inventory once (not on every beat),
builds the GPUs' ``GpuLive`` models only for a heartbeat that carries them, and reuses a GPU's model while its
reading is unchanged; what is sent is the same.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpuorch_contracts import (
    ApplyMigLayout,
    GpuHealthChanged,
    GpuLive,
    GpuUsageSampled,
    Message,
    NodeInventory,
)

from gpuorch_node_agent.domain.hardware import GpuReading, NodeHardware
from gpuorch_node_agent.domain.health import GpuHealthState, HealthBook, HealthChange
from gpuorch_node_agent.domain.heartbeat import HeartbeatState, LazyGpus
from gpuorch_node_agent.domain.inventory import build_gpu_live, build_gpu_sample, build_inventory, inventory_hash
from gpuorch_node_agent.domain.mig_layout import MigProfileOffer
from gpuorch_node_agent.domain.xid import EVENT_XID, GPU_LOST, classify_event
from gpuorch_node_agent.host_processes import HostProcessSampler
from gpuorch_node_agent.nvml.discovery import (
    device_handles,
    read_hardware,
    read_live,
    read_mig_offers,
    read_sample,
)
from gpuorch_node_agent.nvml.mig import MigApplyResult, apply_mig_layout
from gpuorch_node_agent.nvml.reader import NvmlReader


class NodeAgent:
    def __init__(
        self, node_id: str, nvml: Any, *, cpu_milli: int, memory_mib: int, hostname: str = "",
        labels: Mapping[str, str] | None = None, producer: str | None = None, inventory_refresh_s: float = 60.0,
        model_overrides: Mapping[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.nvml = nvml
        self.cpu_milli = cpu_milli
        self.memory_mib = memory_mib
        self.hostname = hostname
        self.labels = dict(labels or {})
        self.producer = producer or f"node-agent/{node_id}"
        self.inventory_refresh_s = inventory_refresh_s
        self.model_overrides = dict(model_overrides or {})
        self.reader = NvmlReader(nvml)
        self.health = HealthBook()
        self.heartbeat = HeartbeatState(node_id, producer=self.producer)
        self.handles: list[Any] = []
        self.offers: dict[int, list[MigProfileOffer]] = {}
        self.hardware: NodeHardware | None = None
        self.inventory: NodeInventory | None = None
        self._hashed: tuple[NodeInventory, str] | None = None
        """The inventory last hashed and its hash: hashed once per inventory object (a rebuild makes a new one)."""
        self._live: dict[int, tuple[tuple[Any, ...], GpuLive]] = {}
        """Per GPU index: the last ``GpuLive`` built and the reading it was built from (an unchanged reading reuses it:
        the models are immutable)."""
        self._topology: dict[tuple[int, int], str] | None = None
        self._inventory_stale = True
        self._refreshed_at = -1e18
        self._initialized = False
        self.host_processes = HostProcessSampler()

    # -- discovery -------------------------------------------------------------------------------------------

    def start(self) -> list[Message]:
        """Initialise NVML and discover; returns health changes found (to publish). Never raises."""
        return self._health_messages(self.refresh_inventory())

    def _ensure_initialized(self) -> None:
        if self._initialized and self.handles:
            return
        before = len(self.reader.failures)
        self.reader.call("nvmlInit")
        self._initialized = len(self.reader.failures) == before
        if self._initialized:
            self.handles = device_handles(self.nvml, self.reader)

    def refresh_inventory(self) -> list[HealthChange]:
        """Read the hardware again; rebuild the inventory if anything changed. Returns health changes."""
        self._ensure_initialized()
        for index, handle in enumerate(self.handles):
            if index not in self.offers and handle is not None:
                before = len(self.reader.failures)
                offers = read_mig_offers(self.nvml, self.reader, handle)
                if len(self.reader.failures) == before:
                    self.offers[index] = offers
        before = len(self.reader.failures)
        hardware = read_hardware(self.nvml, self.reader, self.handles, offers=self.offers, topology=self._topology)
        if self._topology is None and len(self.reader.failures) == before:
            self._topology = dict(hardware.topology)
        changes = [c for c in (self.health.observe(g) for g in hardware.gpus) if c is not None]
        if hardware != self.hardware:
            self.hardware = hardware
            self._inventory_stale = True
        self._refreshed_at = time.monotonic()
        self._rebuild_inventory_if_stale()
        return changes

    def _rebuild_inventory_if_stale(self) -> None:
        if not self._inventory_stale and self.inventory is not None:
            return
        hardware = self.hardware or NodeHardware(gpus=())
        self.inventory = build_inventory(
            self.node_id, hardware, self.health.states, hostname=self.hostname, cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib, labels=self.labels, model_overrides=self.model_overrides,
        )
        self._inventory_stale = False

    def uuid_of(self, index: int) -> str | None:
        if self.hardware is None or index >= len(self.hardware.gpus):
            return None
        return self.hardware.gpus[index].uuid

    def gpu_uuids(self) -> dict[str, int]:
        if self.hardware is None:
            return {}
        return {g.uuid: g.index for g in self.hardware.gpus if g.uuid}

    # -- heartbeats and samples -------------------------------------------------------------------------------

    def heartbeat_messages(self, *, now: float | None = None) -> list[Message]:
        now = time.monotonic() if now is None else now
        changes: list[HealthChange] = []
        if now - self._refreshed_at >= self.inventory_refresh_s or self.hardware is None or not self._initialized:
            changes += self.refresh_inventory()
        readings = [read_live(self.nvml, self.reader, i, h, self.uuid_of(i)) for i, h in enumerate(self.handles)]
        changes += self._lost_changes(readings)
        self._rebuild_inventory_if_stale()
        assert self.inventory is not None
        states = [self.health.state(r.index) for r in readings]
        live = LazyGpus(  # the GpuLive models are built only for a heartbeat that carries them
            judged=tuple((r.index, r.utilization_pct, s.health) for r, s in zip(readings, states, strict=True)),
            build=lambda: [self._gpu_live(r, s) for r, s in zip(readings, states, strict=True)])
        return self._health_messages(changes) + self.heartbeat.messages(
            self.inventory, live, nvml_errors=self.reader.take_failures(), digest=self.inventory_digest())

    def _gpu_live(self, reading: GpuReading, state: GpuHealthState) -> GpuLive:
        """``build_gpu_live(reading, state)``, or the equal model built last time for the same values."""
        key = (reading.utilization_pct, reading.memory_used_mib, reading.temperature_c, reading.power_w, state.health)
        cached = self._live.get(reading.index)
        if cached is not None and cached[0] == key:
            return cached[1]
        live = build_gpu_live(reading, state)
        self._live[reading.index] = (key, live)
        return live

    def inventory_digest(self) -> str:
        """``inventory_hash`` of the current inventory, computed once per inventory object."""
        assert self.inventory is not None
        if self._hashed is None or self._hashed[0] is not self.inventory:
            self._hashed = (self.inventory, inventory_hash(self.inventory))
        return self._hashed[1]

    def usage_message(self) -> list[Message]:
        """A ``GpuUsageSampled`` for every GPU (plus health changes seen while reading); empty without GPUs."""
        mig_uuids: dict[tuple[int, int], str] = {}
        readings: list[GpuReading] = []
        for index, handle in enumerate(self.handles):
            gpu = self.hardware.gpus[index] if self.hardware and index < len(self.hardware.gpus) else None
            mig_uuids = {(m.gpu_instance_id, m.compute_instance_id): m.uuid for m in gpu.mig_instances} if gpu else {}
            readings.append(read_sample(self.nvml, self.reader, index, handle, self.uuid_of(index), mig_uuids))
        messages = self._health_messages(self._lost_changes(readings))
        if readings:
            samples = [build_gpu_sample(r) for r in readings]
            facts = self.host_processes.sample(p.pid for s in samples for p in s.processes)
            samples = [s.model_copy(update={"processes": [
                p.model_copy(update=vars(facts[p.pid])) if p.pid in facts else p for p in s.processes]})
                for s in samples]
            messages.append(GpuUsageSampled(node_id=self.node_id, samples=samples, producer=self.producer))
        return messages

    def _lost_changes(self, readings: list[GpuReading]) -> list[HealthChange]:
        changes = []
        for reading in readings:
            if reading.lost:
                change = self.health.apply(reading.index, GPU_LOST)
                if change is not None:
                    changes.append(change)
        return changes

    # -- health events ----------------------------------------------------------------------------------------

    def on_nvml_event(self, uuid: str | None, event_type: int, event_data: int) -> GpuHealthChanged | None:
        index = self.gpu_uuids().get(uuid) if uuid else None
        verdict = classify_event(event_type, event_data)
        if index is None or verdict is None:
            return None
        change = self.health.apply(index, verdict, xid=int(event_data) if event_type & EVENT_XID else None)
        if change is None:
            return None
        return self._health_messages([change])[0]  # type: ignore[return-value]

    def _health_messages(self, changes: list[HealthChange]) -> list[Message]:
        if any(c.action != "fail_job" for c in changes):
            self._inventory_stale = True
        return [
            GpuHealthChanged(
                node_id=self.node_id, gpu_uuid=self.uuid_of(c.index) or f"GPU-unknown-{c.index}",
                gpu_index=c.index, health=c.health, reason=c.reason[:1024], xid=c.xid, action=c.action,
                producer=self.producer,
            )
            for c in changes
        ]

    # -- MIG --------------------------------------------------------------------------------------------------

    def apply_mig_layout(self, command: ApplyMigLayout) -> list[MigApplyResult]:
        """Apply each GPU's layout (each GPU independently); rediscover afterwards."""
        results = []
        for layout in command.layouts:
            if layout.gpu_index >= len(self.handles) or self.handles[layout.gpu_index] is None:
                results.append(MigApplyResult(layout.gpu_index, False, f"no GPU {layout.gpu_index} on this node"))
                continue
            if self.health.state(layout.gpu_index).health == "unhealthy":
                results.append(MigApplyResult(layout.gpu_index, False,
                                              f"GPU {layout.gpu_index} is unhealthy: reset it first"))
                continue
            results.append(apply_mig_layout(self.nvml, layout.gpu_index, self.handles[layout.gpu_index],
                                            list(layout.profiles)))
        for result in results:
            self.offers.pop(result.gpu_index, None)  # read the profile table again (MIG mode may have changed)
        if any(r.applied for r in results):
            self._topology = None  # NVLink P2P is off for MIG-enabled GPUs
            self.refresh_inventory()
        return results
