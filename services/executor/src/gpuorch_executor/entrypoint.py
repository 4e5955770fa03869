"""``gpuorch-executor``: the broker adapter. Builds one ``NodeExecutor`` per node id, reconciles, consumes.

Per node it consumes queue ``executor.<node_id>`` (``gpuorch_messaging.executor_queue``: bound to ``gpuorch.commands``
with ``node.<node_id>.launch_job`` and ``node.<node_id>.stop_job``; declared at install, or here with
``GPUORCH_BROKER_TOPOLOGY=declare``), and hands each decoded command to that node's executor. ``lease.LeaseRenewer``
renews each node's lease (``ExecutorHeartbeat`` on ``gpuorch.events``, key ``executor.heartbeat``) and, when
renewals have failed for the fencing deadline minus the grace, stops every job itself (``domain.fencing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from gpuorch_contracts import JobIsolation
from gpuorch_messaging import Broker, executor_queue
from gpuorch_messaging.bounded_gauges import keep_bounded_queue_gauges
from gpuorch_observability import READINESS, configure, connected, get_logger, start_metrics_server
from gpuorch_settings import load_or_exit

from gpuorch_executor.backends.base import Backend
from gpuorch_executor.backends.cgroups import CgroupV1, CgroupV2
from gpuorch_executor.backends.container import ContainerBackend
from gpuorch_executor.backends.devices import DeviceConfinement, GpuDeviceNodes
from gpuorch_executor.backends.job_users import can_switch_users, named_uids, privileged_gids
from gpuorch_executor.backends.mps import MpsControl
from gpuorch_executor.backends.process import ProcessBackend
from gpuorch_executor.config import ConfigError, ExecutorConfig
from gpuorch_executor.domain.allowlist import load_allow_list
from gpuorch_executor.domain.job_users import JobUidsError, JobUserPool, parse_job_uids
from gpuorch_executor.gpu_memory import GpuMemoryProbe, probe_for
from gpuorch_executor.handlers import NodeExecutor, NodeSettings
from gpuorch_executor.lease import LeaseRenewer
from gpuorch_executor.logs_http import LogServer, SessionTarget, start_log_endpoint
from gpuorch_executor.placement_store import StateDirectoryInUse

log = get_logger("gpuorch_executor")
CLOSE_TIMEOUT_S = 2.0


DEFAULT_JOB_UIDS = "61000-61063"
CGROUP_V1_MEMORY_ROOT = Path("/sys/fs/cgroup/memory/gpuorch")
CGROUP_V1_CPU_ROOT = Path("/sys/fs/cgroup/cpu/gpuorch")


def build_job_users(config: ExecutorConfig) -> JobUserPool | None:
    """The pool of job uids (``GPUORCH_EXECUTOR_JOB_UIDS``); ``auto`` is the default pool when this process may
    switch users, else none. A pool this process cannot use is a configuration error, never silently dropped."""
    value = config.job_uids
    if value.strip().lower() == "auto":
        if not can_switch_users():
            return None
        value = DEFAULT_JOB_UIDS
    try:
        pool = parse_job_uids(value, forbidden_gids=privileged_gids())
    except JobUidsError as exc:
        raise ConfigError(str(exc)) from exc
    if pool is not None and not can_switch_users():
        raise ConfigError("GPUORCH_EXECUTOR_JOB_UIDS needs an executor that may switch users (root, or "
                          "CAP_SETUID+CAP_SETGID); set it to 'off' to run jobs as the executor's user")
    if pool is not None and (os.getuid() in pool or os.geteuid() in pool):
        raise ConfigError(f"GPUORCH_EXECUTOR_JOB_UIDS {pool.first}-{pool.last} holds the executor's own uid "
                          f"{os.geteuid()}: a job must never run as the executor")
    if pool is not None:
        named = named_uids(range(pool.first, pool.last + 1))
        if named:
            log.warning("job_users.named", uids=named[:8], effect="these uids belong to host users: their "
                        "processes are killed and their files in /tmp removed whenever a job lent one ends")
    return pool


def refuse_unsandboxed(config: ExecutorConfig, job_users: JobUserPool | None) -> None:
    """Process jobs never run as the executor's own user (root included) without the operator's explicit opt-out
    (``GPUORCH_EXECUTOR_UNSANDBOXED``): a ``ConfigError`` saying what to do, or with the opt-out a warning now
    (and one at every launch, ``handlers``)."""
    if job_users is not None or "process" not in config.runtimes:
        return
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    why = (f"GPUORCH_EXECUTOR_JOB_UIDS is {config.job_uids!r}" if can_switch_users()
           else "this process may not switch users (not root, no CAP_SETUID+CAP_SETGID)")
    if not config.unsandboxed:
        raise ConfigError(f"process jobs would run as the executor's own user ({who}): {why}. Run the executor as "
                          "root (or with CAP_SETUID and CAP_SETGID) with a job uid pool (GPUORCH_EXECUTOR_JOB_UIDS, "
                          "default 61000-61063), or set GPUORCH_EXECUTOR_UNSANDBOXED=1 to run jobs unsandboxed "
                          "(demos and tests only)")
    log.warning("executor.unsandboxed", user=who, reason=why, opt_out="GPUORCH_EXECUTOR_UNSANDBOXED=1",
                effect="process jobs run as the executor's own user: they can read its environment (the broker "
                "password), its state and each other's files, and signal each other")


def prepare_state_root(root: Path, job_users: JobUserPool | None) -> None:
    """Create the state root (0711: jobs pass through it to their own home and checkpoint directories, list
    nothing). With job uids, every directory above it must let other users pass too, or no job could reach its
    files: that is a configuration error, said now rather than as every launch failing."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)
    if job_users is None:
        return
    blocked = closed_ancestor(root)
    if blocked is not None:
        raise ConfigError(f"GPUORCH_EXECUTOR_STATE_DIR {root}: {blocked} does not let other users pass "
                          f"(mode {blocked.stat().st_mode & 0o777:o}); jobs run as other uids and could not reach "
                          "their home and checkpoint directories (chmod o+x it, or move the state directory)")


def closed_ancestor(path: Path) -> Path | None:
    """The first directory above ``path`` that other users may not traverse (no ``o+x``), if any."""
    for directory in path.resolve().parents:
        if not directory.stat().st_mode & 0o001:
            return directory
    return None


def build_backends(config: ExecutorConfig, job_users: JobUserPool | None = None,
                   gpu_memory: GpuMemoryProbe | None = None) -> tuple[dict[str, Backend], JobIsolation]:
    """The runtimes this node offers, and what they enforce (logged now; sent on every heartbeat); ``gpu_memory``:
    the share watchdog's probe (None: shares are not watched)."""
    backends: dict[str, Backend] = {}
    notes: list[str] = []
    limits: str = "none"
    devices_kind = mig_slices = "env_only"
    mps: MpsControl | None = None
    if job_users is None:
        notes.append("process jobs run as the executor's user (GPUORCH_EXECUTOR_JOB_UIDS off, or not root): "
                     "they can read its state and signal each other")
        log.warning("job_users.unavailable", reason="GPUORCH_EXECUTOR_JOB_UIDS is off or the executor may not "
                    "switch users", effect="process jobs run as the executor's user: not isolated from it or "
                    "from each other")
    if "process" in config.runtimes:
        cgroups: CgroupV2 | CgroupV1 | None = None
        if config.cgroup_root != "off":
            cgroups, why = CgroupV2.detect(Path(config.cgroup_root))
            if cgroups is None:
                cgroups, why_v1 = CgroupV1.detect(CGROUP_V1_MEMORY_ROOT, CGROUP_V1_CPU_ROOT)
                why = f"{why}; {why_v1}"
            if cgroups is None:
                log.warning("cgroups.unavailable", reason=why, effect="host memory/CPU limits not enforced")
                notes.append(f"no host memory/CPU limits: {why}"[:1024])
        limits = cgroups.kind if cgroups is not None else "none"
        confinement = DeviceConfinement.detect(config.device_cgroup_root,
                                               GpuDeviceNodes.from_setting(config.gpu_devices),
                                               cgroups.root if isinstance(cgroups, CgroupV2) else None)
        if confinement.cgroup is None:
            log.warning("devices.unconfined", reason=confinement.why_not,
                        effect="process jobs see GPUs through CUDA_VISIBLE_DEVICES only; a job can unset it")
            notes.append(f"process jobs not device-confined: {confinement.why_not}"[:1024])
        elif not confinement.devices.confines_mig:
            notes.append("MIG instances inside one GPU are chosen by CUDA_VISIBLE_DEVICES only: the driver's MIG "
                         "capabilities are not device nodes here (no nvidia-caps in /proc/devices)")
        devices_kind = confinement.kind
        mig_slices = devices_kind if confinement.cgroup is not None and confinement.devices.confines_mig else (
            "env_only")
        mps = MpsControl(config.mps_pipe_directory) if config.mps_pipe_directory != "off" else None
        backends["process"] = ProcessBackend(cgroups, confinement, mps)
    if "container" in config.runtimes:
        try:
            backends["container"] = ContainerBackend(config.docker)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    isolation = JobIsolation(
        job_users="per_job_uid" if job_users is not None else "executor_uid",
        devices=devices_kind,  # type: ignore[arg-type]
        limits=limits,  # type: ignore[arg-type]
        containers="gpus_flag" if "container" in backends else "disabled", notes=notes[:8],
        mig_slices=mig_slices if "process" in config.runtimes else None,  # type: ignore[arg-type]
        shares="none" if gpu_memory is None else "mps" if mps is not None and mps.pipe_directory() else "watchdog",
    )
    log.info("executor.isolation", **isolation.model_dump())
    return backends, isolation


def session_target(executors: list[NodeExecutor], job_id: uuid.UUID) -> SessionTarget | None:
    """Where the running session ``job_id`` listens on one of this process's nodes, if it runs here."""
    for executor in executors:
        record = executor.session(job_id)
        if record is not None and record.session_port is not None:
            return SessionTarget(record.session_port, record.session_strip_prefix)
    return None


def exec_launch(executors: list[NodeExecutor], job_id: uuid.UUID, argv: list[str]) -> dict[str, Any] | str | None:
    """How to run ``argv`` in the job's running placement on one of this process's nodes (``gpuctl exec``)."""
    for executor in executors:
        found = executor.exec_launch(job_id, argv)
        if found is not None:
            return found
    return None


def session_requested(executors: list[NodeExecutor], job_id: uuid.UUID) -> None:
    for executor in executors:
        if executor.session(job_id) is not None:
            executor.session_requested(job_id)


async def serve(config: ExecutorConfig, stop: asyncio.Event) -> None:
    producer = "executor/" + ",".join(config.node_ids)
    broker = Broker(config.amqp_url, producer=producer, connection_name=f"executor {producer}",
                    **config.broker_options())
    allow_list = load_allow_list(config.allow)
    job_users = build_job_users(config)
    refuse_unsandboxed(config, job_users)
    prepare_state_root(config.state_root, job_users)
    gpu_memory = probe_for(config.gpu_memory_probe)
    backends, isolation = build_backends(config, job_users, gpu_memory)
    log.info("executor.share_watchdog", probe=gpu_memory.name if gpu_memory else "off",
             tolerance_pct=config.share_tolerance_pct, sustain_s=config.share_sustain_s)
    executors = [
        NodeExecutor(NodeSettings(node_id=node_id, state_dir=config.state_dir(node_id), backends=backends,
                                  allow_list=allow_list, producer=f"executor/{node_id}",
                                  poll_interval_s=config.poll_interval_s, job_users=job_users,
                                  unsandboxed=config.unsandboxed, gpu_memory=gpu_memory,
                                  share_tolerance_pct=config.share_tolerance_pct,
                                  share_sustain_s=config.share_sustain_s, sessions_dir=config.sessions_dir), broker)
        for node_id in config.node_ids
    ]
    for executor in executors:
        executor.store.lock()  # held until this process exits, however it exits
    READINESS.mark("consuming", "reconciling its placements")
    READINESS.add("broker", connected(broker))
    connecting = asyncio.ensure_future(broker.connect(timeout_s=None))  # a broker down at start is waited for
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():  # stopped while the broker was still down
        connecting.cancel()
        await broker.close()
        return
    connecting.result()
    tasks: list[asyncio.Task[None]] = []
    logs: LogServer | None = None
    try:
        for executor in executors:
            await executor.reconcile()
            tasks.append(asyncio.create_task(executor.run()))
        own = [executor_queue(executor.node_id) for executor in executors]
        for executor, spec in zip(executors, own, strict=True):
            await broker.consume(spec, executor.handle)
        tasks.append(asyncio.create_task(keep_bounded_queue_gauges(  # its nodes' dead-letter queues (decision 42)
            broker, {spec.dead_letter_queue: spec.dead_letter_max_length for spec in own if spec.dead_letter})))
        READINESS.mark("consuming", None)
        log.info("executor.ready", nodes=list(config.node_ids), runtimes=list(config.runtimes))
        logs = await start_log_endpoint(  # GPUORCH_LOGS_PORT, logs_http (logs, and the proxy to sessions)
            [e.store.logs_dir for e in executors],
            lambda job_id: any(r.job_id == job_id for e in executors for r in e.active_placements()),
            session=lambda job_id: session_target(executors, job_id),
            requested=lambda job_id: session_requested(executors, job_id),
            exec_launch=lambda job_id, argv: exec_launch(executors, job_id, argv))
        lease = LeaseRenewer(broker, executors, interval_s=config.heartbeat_s,
                             fencing_deadline_s=config.fencing_deadline_s, fencing_grace_s=config.fencing_grace_s,
                             isolation=isolation, logs_url=logs.url if logs is not None else None)
        tasks.append(asyncio.create_task(lease.run()))
        await stop.wait()
    finally:
        log.info("executor.stopping", note="jobs keep running under their supervisors")
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if logs is not None:
            await logs.close()
        log.info("executor.tasks_stopped")
        try:
            await asyncio.wait_for(broker.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("executor.broker_close_timeout", timeout_s=CLOSE_TIMEOUT_S)
        log.info("executor.stopped")


def main(argv: list[str] | None = None) -> int:
    config, _ = load_or_exit(ExecutorConfig, argv, prog="gpuorch-executor",
                             description="Run gpuorch jobs on this GPU node.")
    os.umask(0o077)  # whatever the executor writes is its own unless it says otherwise (jobs run as other uids)
    configure("executor", log_level=config.log_level, otlp_endpoint=config.otlp_endpoint,
              instance=",".join(config.node_ids))
    start_metrics_server(config.metrics_port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(config, stop)

    try:
        asyncio.run(run())
    except ConfigError as exc:
        log.error("executor.config_error", error=str(exc))
        return 2
    except StateDirectoryInUse as exc:
        log.error("executor.state_dir_in_use", error=str(exc))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
