"""The MIG planner's input as data: built from the scheduler's read models, or read from a snapshot file.

    nodes rows (node_id, liveness, inventory)  ─┐
    jobs rows (job_id, name, tier, state,       ├─► MigSnapshot(gpus: [GpuState], pending: [PendingJob])
      spec, assignments, submitted_at)          │        ▲  to_json / from_json (the snapshot file format)
    peaks by job name (telemetry's rollups)    ─┘

``from_read_models`` is pure: the caller fetched the rows (gpuctl does, read-only). A job counts as pending in
state ``queued``/``accepted``; as running on the GPUs (or MIG instances) its ``assignments`` name while in state
``placed``/``running``/``preempting``. Its observed peak is the largest peak memory that earlier jobs of the same
name used (``peaks``). A GPU is in service when its node is ``alive`` and the GPU is healthy or degraded. Recent
reconfiguration times are not in any read model yet (the scheduler does not carry plans out yet), so they are empty
unless a snapshot file gives them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from gpuorch_policy.mig_planner import GpuState, InstanceState, PendingJob

PENDING_STATES = ("queued", "accepted")
HOLDING_STATES = ("placed", "running", "preempting")


@dataclass(frozen=True)
class MigSnapshot:
    gpus: tuple[GpuState, ...]
    pending: tuple[PendingJob, ...]
    now: float

    def to_json(self) -> str:
        return json.dumps({"now": self.now, "gpus": [asdict(g) for g in self.gpus],
                           "pending": [asdict(j) for j in self.pending]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> MigSnapshot:
        """Read a snapshot file (the format ``to_json`` writes; lists for tuples). Raises ValueError if malformed."""
        try:
            data = json.loads(text)
            gpus = tuple(GpuState(**{**g, "instances": tuple(InstanceState(**i) for i in g.get("instances", ())),
                                     "whole_job_ids": tuple(g.get("whole_job_ids", ())),
                                     "reconfigured_at": tuple(g.get("reconfigured_at", ()))})
                         for g in data["gpus"])
            pending = tuple(PendingJob(**{**j, "mig_profiles": tuple(j.get("mig_profiles", ())),
                                          "gpu_models": tuple(j.get("gpu_models", ()))}) for j in data["pending"])
            return cls(gpus, pending, float(data.get("now", 0.0)))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a MIG planner snapshot: {exc}") from exc


def _seconds(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value or 0.0)


def from_read_models(nodes: Iterable[Mapping[str, Any]], jobs: Iterable[Mapping[str, Any]],
                     peaks: Mapping[str, int], now: datetime) -> MigSnapshot:
    """The planner's input from read-model rows (``inventory``, ``spec`` and ``assignments`` as parsed JSON)."""
    jobs = list(jobs)
    holders: dict[str, list[str]] = {}
    for job in jobs:
        if job["state"] in HOLDING_STATES:
            for assignment in job.get("assignments") or ():
                for gpu in assignment.get("gpus", ()):
                    holders.setdefault(gpu["gpu_uuid"], []).append(str(job["job_id"]))
    gpus = []
    for node in nodes:
        inventory = node["inventory"]
        for gpu in inventory.get("gpus", ()):
            instances = tuple(InstanceState(m["profile"], int(m["placement_start"]),
                                            next(iter(holders.get(m["uuid"], ())), None), m["uuid"])
                              for m in gpu.get("mig_instances", ()))
            whole = tuple(holders.get(gpu["uuid"], ()))
            gpus.append(GpuState(
                inventory.get("node_id", node["node_id"]), int(gpu["index"]), gpu["model"],
                bool(gpu.get("mig_enabled")), instances if gpu.get("mig_enabled") else (), whole,
                in_service=node["liveness"] == "alive" and gpu.get("health", "healthy") in ("healthy", "degraded")))
    pending = []
    for job in jobs:
        if job["state"] not in PENDING_STATES:
            continue
        resources = job["spec"].get("resources", {})
        pending.append(PendingJob(
            str(job["job_id"]), job["tier"], max(0.0, now.timestamp() - _seconds(job["submitted_at"])),
            whole_gpus=int(resources.get("gpus") or 0), nodes=int(job["spec"].get("gang", {}).get("nodes", 1)),
            mig_profiles=tuple(resources.get("mig_profiles") or ()), memory_mib=resources.get("gpu_memory_mib"),
            peak_memory_mib=peaks.get(job["name"]), gpu_models=tuple(resources.get("gpu_models") or ())))
    return MigSnapshot(tuple(gpus), tuple(p for p in pending if p.whole_gpus or p.mig_profiles), now.timestamp())
