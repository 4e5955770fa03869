"""The share watchdog: a share job that holds more GPU memory than its share is stopped, alone.

Called by the watch (``watch.PlacementWatch``) on every tick for each running placement that is not already
stopping; samples it at most every ``NodeSettings.share_sample_s`` through the node's ``GpuMemoryProbe``
(``gpu_memory``) and applies the rule of ``domain.share_memory`` (over ``limit + tolerance`` for ``sustain_s``).
The verdict makes the watch stop that placement like any stop (checkpoint signal, grace, SIGKILL) with reason
``gpu_memory_exceeded``; its neighbours on the GPU are other placements and are not touched.

A container job is sampled too: its id comes from the ``--cidfile`` in the placement directory, and the NVML probe
counts the processes whose cgroup names it (``domain.container_processes``); until Docker wrote the id, and always
under the declared probe (the simulated fleet runs no container engine), its samples are skipped.

What a sample says is kept in memory only: after an executor restart a placement's sustain window starts again
(at most ``sustain_s`` later than it would have). Placements without a share memory limit are never sampled.
"""

from __future__ import annotations

import uuid

from gpuorch_observability import get_logger
from prometheus_client import Counter

from gpuorch_executor.backends.container import read_container_id
from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.domain.share_memory import Exceeded, ShareMemoryWatch, share_memory_limit, tolerance_mib
from gpuorch_executor.node import NodeContext

log = get_logger(__name__)

SHARES_EXCEEDED = Counter("gpuorch_executor_shares_exceeded_total",
                          "Share placements stopped for holding more GPU memory than their share", ["node_id"])


class ShareWatchdog:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.watches: dict[uuid.UUID, ShareMemoryWatch] = {}
        self.next_sample: dict[uuid.UUID, float] = {}

    def check(self, record: PlacementRecord) -> Exceeded | None:
        """Sample ``record`` if it is due; the verdict when its share was exceeded long enough, else None."""
        settings = self.node.settings
        if settings.gpu_memory is None or record.launch is None or record.state != "running" \
                or record.stop is not None:
            return None
        limit = share_memory_limit(record.launch)
        if limit is None:
            return None
        now = self.node.monotonic()
        if now < self.next_sample.get(record.placement_id, 0.0):
            return None
        self.next_sample[record.placement_id] = now + settings.share_sample_s
        container_id = read_container_id(self.node.store.placement_dir(record.placement_id)) \
            if record.runtime == "container" else None
        used = settings.gpu_memory.job_memory_mib(record, container_id)
        if used is None:
            return None
        watch = self.watches.get(record.placement_id)
        if watch is None:
            watch = self.watches[record.placement_id] = ShareMemoryWatch(
                limit, tolerance_mib(limit, settings.share_tolerance_pct), settings.share_sustain_s)
        verdict = watch.observe(used, now)
        if verdict is not None:
            SHARES_EXCEEDED.labels(self.node.node_id).inc()
            log.warning("job.share_exceeded", placement_id=str(record.placement_id), job_id=str(record.job_id),
                        used_mib=verdict.used_mib, limit_mib=verdict.limit_mib, probe=settings.gpu_memory.name)
        return verdict

    def forget(self, placement_id: uuid.UUID) -> None:
        self.watches.pop(placement_id, None)
        self.next_sample.pop(placement_id, None)
