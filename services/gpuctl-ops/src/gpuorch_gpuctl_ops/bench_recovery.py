"""``gpuctl bench recovery``: how long the real scheduler takes to restart from a long event log.

    scratch database ─> COPY a synthetic scheduler history into `events` (the rows the store's append writes)
    scratch vhost ─> gpuorch-scheduler (a process, GPUORCH_LOG_LEVEL=INFO) started --repeats times with no
        snapshot: timed until it logs `scheduler.recovered`; the last of these runs also stores a snapshot
        (the service's own, at its first tick) ─> started --repeats times again: recovery from that snapshot

Nothing of the scheduler is imported: the service is started as any operator would start it, and read from its
log. A run's recovery time is the ``seconds`` field of its ``scheduler.recovered`` line when the service reports
one, else the time between its ``scheduler.leader`` and ``scheduler.recovered`` lines (the service logs the first
just before it recovers); ``restart_s`` is from starting the process to the ``scheduler.recovered`` line
(interpreter start, migrations check and leadership included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuorch_gpuctl_ops.bench_e2e import GPUS_PER_NODE
from gpuorch_gpuctl_ops.bench_scratch import ScratchServers, progress

STREAM = "scheduler"


@dataclass
class HistoryShape:
    """A synthetic scheduler history: ``nodes`` h100x8 registrations, then one-GPU jobs going through
    accepted -> placed -> started -> finished, ``running`` of them at any moment, ``every_s`` apart."""

    events: int
    nodes: int = 1000
    running: int = 4000
    every_s: float = 2.5
    failed_every: int = 20
    """Every n-th job ends with exit code 1 (a failed job) instead of 0."""


def synthetic_history(shape: HistoryShape) -> Iterator[tuple[uuid.UUID, str, datetime, str, str]]:
    """Rows ``(message_id, type, occurred_at, payload JSON, headers JSON)`` as ``NewEvent.from_message`` would
    write them (the whole message, envelope included, as the payload), in log order. Payloads are built from one
    validated model per type with the varying fields replaced, so a million rows take seconds, not minutes."""
    from gpuorch_contracts import (
        GpuAllocation,
        GpuInfo,
        GpuRequest,
        JobAccepted,
        JobFinished,
        JobPlaced,
        JobSpec,
        JobStarted,
        NodeAssignment,
        NodeInventory,
        NodeRegistered,
        ProcessRun,
    )

    if shape.running > shape.nodes * GPUS_PER_NODE:
        raise ValueError("more running jobs than GPUs")
    clock = datetime.now(UTC) - timedelta(seconds=shape.events * shape.every_s)
    step = timedelta(seconds=shape.every_s)
    emitted = 0

    def row(payload: dict[str, Any], headers: dict[str, Any]) -> tuple[uuid.UUID, str, datetime, str, str]:
        nonlocal clock, emitted
        clock += step
        emitted += 1
        message_id = uuid.uuid4()
        payload["message_id"] = str(message_id)
        payload["occurred_at"] = clock.isoformat().replace("+00:00", "Z")
        return message_id, payload["type"], clock, json.dumps(payload), json.dumps(headers)

    nvlink = [(a, b) for a in range(GPUS_PER_NODE) for b in range(a + 1, GPUS_PER_NODE)]
    for n in range(min(shape.nodes, shape.events)):
        node_id = f"node-{n:05d}"
        gpus = [GpuInfo(uuid=f"GPU-{node_id}-{i}", index=i, model="H100-80GB", name="NVIDIA H100 80GB HBM3",
                        memory_total_mib=81559) for i in range(GPUS_PER_NODE)]
        inventory = NodeInventory(node_id=node_id, hostname=node_id, cpu_milli=128000, memory_mib=1048576,
                                  gpus=gpus, nvlink_pairs=nvlink, labels={"gpuorch.io/simulated": "true"})
        registered = NodeRegistered(inventory=inventory, inventory_hash=uuid.uuid4().hex, producer="node-agent/sim")
        yield row(registered.model_dump(mode="json"), {})

    spec = JobSpec(name="train-step", tenant="team-a", tier="batch", resources=GpuRequest(gpus=1), cpu_milli=8000,
                   memory_mib=65536, runtime_estimate_s=3600.0, run=ProcessRun(argv=["python", "train.py"]))
    some_id = uuid.uuid4()
    accepted = JobAccepted(job_id=some_id, spec=spec, producer="scheduler/scheduler-1").model_dump(mode="json")
    placed = JobPlaced(job_id=some_id, placement_id=some_id, producer="scheduler/scheduler-1", assignments=[
        NodeAssignment(node_id="n", gpus=[GpuAllocation(gpu_uuid="g", gpu_index=0)])]).model_dump(mode="json")
    started = JobStarted(job_id=some_id, placement_id=some_id, node_id="n", pid=1, log_path="/var/log/x",
                         producer="executor/n").model_dump(mode="json")
    finished = JobFinished(job_id=some_id, placement_id=some_id, node_id="n", exit_code=0, duration_s=1.0,
                           producer="executor/n").model_dump(mode="json")
    slots = shape.nodes * GPUS_PER_NODE
    running: deque[tuple[str, str, str, int]] = deque()  # job id, placement id, node id, job number
    job = 0
    while emitted < shape.events:
        if len(running) >= shape.running:
            job_id, placement_id, node_id, index = running.popleft()
            yield row({**finished, "job_id": job_id, "placement_id": placement_id, "node_id": node_id,
                       "producer": f"executor/{node_id}", "exit_code": 1 if index % shape.failed_every == 0 else 0,
                       "duration_s": shape.running * 4 * shape.every_s}, {})
            continue
        job_id, placement_id = str(uuid.uuid4()), str(uuid.uuid4())
        slot = job % slots
        node_id, gpu = f"node-{slot // GPUS_PER_NODE % shape.nodes:05d}", slot % GPUS_PER_NODE
        trace = {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"}
        yield row({**accepted, "job_id": job_id}, trace)
        if emitted < shape.events:
            yield row({**placed, "job_id": job_id, "placement_id": placement_id, "assignments": [
                {"node_id": node_id, "gpus": [{"gpu_uuid": f"GPU-{node_id}-{gpu}", "gpu_index": gpu, "milli": 1000,
                                                "memory_mib": None, "mig_profile": None}]}]}, trace)
        if emitted < shape.events:
            yield row({**started, "job_id": job_id, "placement_id": placement_id, "node_id": node_id,
                       "producer": f"executor/{node_id}", "pid": 10000 + job % 50000,
                       "log_path": f"/var/lib/gpuorch/logs/{job_id}.log"}, {})
        running.append((job_id, placement_id, node_id, job))
        job += 1


async def fill_event_log(dsn: str, shape: HistoryShape, chunk: int = 50_000) -> tuple[int, int]:
    """Migrate a fresh database and COPY ``shape.events`` rows into ``events``; returns the rows written and how
    many of them accepted a job."""
    import asyncpg
    from gpuorch_store import migrate

    await migrate(dsn)
    conn = await asyncpg.connect(dsn)
    written = accepted = 0
    try:
        rows: list[tuple[Any, ...]] = []
        for message_id, kind, occurred_at, payload, headers in synthetic_history(shape):
            rows.append((STREAM, message_id, kind, 1, occurred_at, payload, headers))
            accepted += kind == "job.accepted"
            if len(rows) >= chunk:
                written += await _copy(conn, rows)
                rows = []
                progress(f"recovery: {written:,}/{shape.events:,} events written")
        written += await _copy(conn, rows)
        await conn.execute("ANALYZE events")
    finally:
        await conn.close()
    return written, accepted


async def _copy(conn: Any, rows: list[tuple[Any, ...]]) -> int:
    if rows:
        await conn.copy_records_to_table(
            "events", records=rows,
            columns=["stream", "message_id", "type", "schema_version", "occurred_at", "payload", "headers"])
    return len(rows)



@dataclass(frozen=True)
class Restart:
    """One start of the scheduler, read from its ``scheduler.recovered`` log line."""

    recover_s: float
    """The recovery's own duration (see the module docstring for where it comes from)."""
    timed_by: str
    """``seconds field``, ``leader->recovered lines`` or ``process start``."""
    restart_s: float
    """Process start -> the ``scheduler.recovered`` line."""
    position: int
    replayed: int
    jobs: int
    nodes: int
    from_snapshot: bool


def _log_lines(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                yield record


def _at(record: dict[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(record["timestamp"])).timestamp()
    except (KeyError, ValueError):
        return None


def read_restart(log_path: Path, started_at: float) -> Restart | None:
    """The ``Restart`` a scheduler's log shows once it logged ``scheduler.recovered`` (None before);
    ``started_at``: wall time the process was started."""
    leader_at: float | None = None
    for record in _log_lines(log_path):
        if record.get("event") == "scheduler.leader":
            leader_at = _at(record)
        if record.get("event") != "scheduler.recovered":
            continue
        recovered_at = _at(record) or time.time()
        if isinstance(record.get("seconds"), int | float):
            recover_s, timed_by = float(record["seconds"]), "seconds field"
        elif leader_at is not None:
            recover_s, timed_by = recovered_at - leader_at, "leader->recovered lines"
        else:
            recover_s, timed_by = recovered_at - started_at, "process start"
        return Restart(recover_s=recover_s, timed_by=timed_by, restart_s=recovered_at - started_at,
                       position=int(record.get("position", 0)), replayed=int(record.get("replayed", 0)),
                       jobs=int(record.get("jobs", 0)), nodes=int(record.get("nodes", 0)),
                       from_snapshot=bool(record.get("from_snapshot")))
    return None


def _snapshot_failure(log_path: Path) -> str | None:
    for record in _log_lines(log_path):
        if record.get("event") == "scheduler.snapshot_failed":
            return str(record.get("error", "scheduler.snapshot_failed"))
    return None


class SchedulerRestarts:
    """Starts the real ``gpuorch-scheduler`` against a filled database, one run after another, and reads each
    run's recovery from its log. Every process is stopped by ``close`` (also used on failure)."""

    def __init__(self, root: Path, amqp_url: str, dsn: str, timeout_s: float) -> None:
        from gpuorch_gpuctl_ops.stack import LocalStack

        self.dsn, self.timeout_s = dsn, timeout_s
        self.stack = LocalStack(root=root, amqp_url=amqp_url, database_url=dsn, nodes=[],
                                extra_env={"GPUORCH_LOG_LEVEL": "INFO"})
        self.runs = 0

    async def run(self, *, cold: bool, store_snapshot: bool = False) -> tuple[Restart, str | None]:
        """One start, timed; stopped once recovered. ``cold``: every snapshot is deleted first (the whole log is
        replayed). ``store_snapshot``: the service is also left to store its snapshot of the recovered state (it
        does at its first tick; otherwise it is told to snapshot only every 10^9 events); returns the error it
        logged if it could not."""
        import asyncpg

        self.runs += 1
        name = f"scheduler-recovery-{self.runs}"
        conn = await asyncpg.connect(self.dsn)
        try:
            if cold:
                await conn.execute("DELETE FROM snapshots WHERE stream = $1", STREAM)
            started_at = time.time()
            process = self.stack.start_scheduler(name, GPUORCH_SNAPSHOT_EVERY_EVENTS="1" if store_snapshot else
                                                 "1000000000")
            deadline = time.monotonic() + self.timeout_s
            while (restart := read_restart(process.log_path, started_at)) is None:
                self._check(name, deadline, "log scheduler.recovered")
                await asyncio.sleep(0.05)
            error = None
            if store_snapshot:
                while (await conn.fetchval("SELECT coalesce(max(position), 0) FROM snapshots WHERE stream = $1",
                                           STREAM)) < restart.position:
                    if (error := _snapshot_failure(process.log_path)) is not None:
                        break
                    self._check(name, deadline, "store a snapshot")
                    await asyncio.sleep(0.2)
        finally:
            await conn.close()
        self.stack.stop(name)
        return restart, error

    def _check(self, name: str, deadline: float, what: str) -> None:
        if not self.stack.processes[name].running:
            raise RuntimeError(f"the scheduler exited before it could {what}:\n{self.stack.tail(name, 20)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler did not {what} within {self.timeout_s:.0f}s:\n"
                               f"{self.stack.tail(name, 20)}")

    def close(self) -> None:
        self.stack.stop_all()


async def _snapshot_mib(dsn: str) -> float | None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        stored = await conn.fetchval("SELECT pg_column_size(state) FROM snapshots WHERE stream = $1 "
                                     "ORDER BY position DESC LIMIT 1", STREAM)
    finally:
        await conn.close()
    return None if stored is None else round(stored / 2**20, 1)


async def _recovery(restarts: SchedulerRestarts, dsn: str, shape: HistoryShape, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    written, jobs_in_log = await fill_event_log(dsn, shape)
    fill_s = time.perf_counter() - started
    progress(f"recovery: {written:,} events in {fill_s:.0f}s; the scheduler recovering without a snapshot")
    cold: list[Restart] = []
    error: str | None = None
    for attempt in range(repeats):
        restart, error = await restarts.run(cold=True, store_snapshot=attempt == repeats - 1)
        cold.append(restart)
        progress(f"recovery: run {attempt + 1}/{repeats} without a snapshot: {restart.recover_s:.2f}s "
                 f"({restart.replayed:,} events replayed)")
    last = cold[-1]
    result: dict[str, Any] = {
        "events": written, "jobs_in_log": jobs_in_log, "repeats": repeats, "fill_s": round(fill_s, 1),
        "recover_no_snapshot_s": round(statistics.median(r.recover_s for r in cold), 2),
        "recover_no_snapshot_runs_s": [round(r.recover_s, 2) for r in cold],
        "restart_no_snapshot_s": round(statistics.median(r.restart_s for r in cold), 2),
        "recovery_timed_by": last.timed_by,
        "state_jobs_without_snapshot": last.jobs, "state_nodes": last.nodes, "position": last.position,
    }
    if error is not None:  # e.g. a state too large for one jsonb value (256 MiB)
        result["snapshot_error"] = error
        progress(f"recovery: the scheduler could not store its snapshot: {error}")
        return result
    result["snapshot_mib_stored"] = await _snapshot_mib(dsn)
    progress("recovery: the scheduler recovering from its snapshot")
    warm: list[Restart] = []
    for attempt in range(repeats):
        restart, _ = await restarts.run(cold=False)
        warm.append(restart)
        progress(f"recovery: run {attempt + 1}/{repeats} from the snapshot: {restart.recover_s:.2f}s")
    if not all(r.from_snapshot for r in warm):
        raise RuntimeError("the scheduler did not recover from the snapshot it stored")
    result.update({
        "recover_snapshot_s": round(statistics.median(r.recover_s for r in warm), 2),
        "recover_snapshot_runs_s": [round(r.recover_s, 2) for r in warm],
        "restart_snapshot_s": round(statistics.median(r.restart_s for r in warm), 2),
        "state_jobs": warm[-1].jobs, "state_nodes": warm[-1].nodes,
    })
    return result


def run_recovery(shape: HistoryShape, repeats: int, servers: ScratchServers, timeout_s: float) -> dict[str, Any]:
    """Fill a scratch database with ``shape`` and time the scheduler's restarts (see the module docstring)."""
    with servers.vhost() as amqp_url, servers.database() as dsn, tempfile.TemporaryDirectory() as root:
        restarts = SchedulerRestarts(Path(root), amqp_url, dsn, timeout_s)
        try:
            return asyncio.run(_recovery(restarts, dsn, shape, repeats))
        finally:
            restarts.close()
