"""``gpuctl bench e2e``: SubmitJob -> LaunchJob through the real scheduler on a simulated fleet.

    scratch vhost + database ─> gpuorch-scheduler (a process; CPU and RSS of it and its relay child from /proc)
    gpuorch-node-agent fleet (a process, N x h100x8, heartbeat 10 s) ─> wait: N alive rows in `nodes`
    idle: the scheduler's CPU over --idle-s of heartbeats only
    raw hops and the floor (``bench_baselines``), the same bodies at the same rate
    paced publisher ─> gpuorch.submit/job.submit ─> scheduler ─> outbox relay
        ─> gpuorch.commands/node.<id>.launch_job ─> receiver (where an executor would be)

Submissions are plain aio-pika publishes of ``SubmitJob`` JSON (publisher confirms, ``mandatory``), as any other
system would send them; gpuctl's own Broker is not on the measured path. Every process started here is stopped
when the run ends, also on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuorch_gpuctl_ops.bench_baselines import bare_floor, raw_two_hops
from gpuorch_gpuctl_ops.bench_scratch import MachineCpu, ProcessMeter, ScratchServers, machine, progress
from gpuorch_gpuctl_ops.bench_traffic import Arrivals, ms, percentile, publish_paced, submit_bodies

GPUS_PER_NODE = 8
NODE_PROFILE = "h100"
LAUNCH_BINDING = "node.#.launch_job"


@dataclass(frozen=True)
class E2eParameters:
    nodes: int
    rate: float
    jobs: int
    timeout_s: float = 600.0
    register_timeout_s: float = 600.0
    heartbeat_s: float = 10.0
    fleet_nice: int = 0
    idle_s: float = 5.0
    scheduler_log_level: str = "WARNING"
    raw: bool = True
    floor: bool = True


def run_e2e(params: E2eParameters, servers: ScratchServers) -> dict[str, Any]:
    """One end-to-end measurement on a scratch vhost and database (and, with ``floor``, a second database for
    the floor); returns the result (keys: see ``gpuctl bench e2e --help``)."""
    from gpuorch_gpuctl_ops.stack import LocalStack, SimNode

    if params.jobs > params.nodes * GPUS_PER_NODE:
        raise ValueError(f"{params.jobs} one-GPU jobs cannot all be placed on {params.nodes} nodes x "
                         f"{GPUS_PER_NODE} GPUs (nothing finishes in this benchmark)")
    before = machine()
    with contextlib.ExitStack() as scratch:
        amqp_url, dsn = scratch.enter_context(servers.vhost()), scratch.enter_context(servers.database())
        floor_dsn = scratch.enter_context(servers.database()) if params.floor else None
        root = scratch.enter_context(tempfile.TemporaryDirectory())
        fleet = [SimNode(f"bench-{i:05d}", NODE_PROFILE, GPUS_PER_NODE, cpu_milli=GPUS_PER_NODE * 16000,
                         memory_mib=GPUS_PER_NODE * 128 * 1024) for i in range(params.nodes)]
        stack = LocalStack(root=Path(root), amqp_url=amqp_url, database_url=dsn, nodes=fleet,
                           extra_env={"GPUORCH_LOG_LEVEL": params.scheduler_log_level})
        try:
            result = asyncio.run(_e2e(stack, params, amqp_url, dsn, floor_dsn))
        except BaseException:
            for name in stack.processes:
                progress(f"{name} log tail:\n{stack.tail(name, 15)}")
            raise
        finally:
            stack.stop_all()
    return {**result, "load_avg_1m_start": before["load_avg_1m"], "load_avg_1m_end": machine()["load_avg_1m"],
            "cpus": before["cpus"], "scheduler_log_level": params.scheduler_log_level}


async def _count_nodes(dsn: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM nodes WHERE liveness = 'alive'"))
    except asyncpg.UndefinedTableError:
        return 0
    finally:
        await conn.close()


async def _fleet_registered(stack: Any, params: E2eParameters, dsn: str) -> float:
    """Start the simulated fleet and wait until the scheduler's ``nodes`` read model holds every node alive;
    returns the seconds that took."""
    started = time.monotonic()
    fleet = stack.start_node_agents(GPUORCH_HEARTBEAT_S=str(params.heartbeat_s), GPUORCH_USAGE_S="3600",
                                    GPUORCH_LOG_LEVEL="WARNING")
    if params.fleet_nice:
        _renice(fleet.popen.pid, params.fleet_nice)
    known = 0
    while known < params.nodes:
        if time.monotonic() - started > params.register_timeout_s:
            raise TimeoutError(f"the scheduler knows {known} of {params.nodes} nodes after "
                               f"{params.register_timeout_s:.0f}s")
        if stack.dead():
            raise RuntimeError(f"a service died: {stack.dead()}")
        await asyncio.sleep(1.0)
        previous, known = known, await _count_nodes(dsn)
        if known != previous or known == params.nodes:
            progress(f"e2e: scheduler knows {known}/{params.nodes} nodes")
    return time.monotonic() - started


async def _e2e(stack: Any, params: E2eParameters, amqp_url: str, dsn: str, floor_dsn: str | None) -> dict[str, Any]:
    import aio_pika
    from gpuorch_contracts import COMMANDS_EXCHANGE, SUBMIT_EXCHANGE

    progress(f"e2e: {params.nodes} nodes, {params.jobs} jobs at {params.rate:g}/s; starting the scheduler")
    scheduler = stack.start_scheduler()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"], timeout_s=120)
    meter = ProcessMeter(scheduler.popen.pid)
    user_id = urlsplit(amqp_url).username or None  # RabbitMQ checks user_id against the connection's user
    connection = await aio_pika.connect(amqp_url)
    try:
        # where an executor would receive its LaunchJob: bound before any node exists, so no launch is unroutable
        receiving = await connection.channel()
        await receiving.set_qos(prefetch_count=1000)
        commands = await receiving.declare_exchange(COMMANDS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        launches = await receiving.declare_queue("", exclusive=True)
        await launches.bind(commands, LAUNCH_BINDING)
        arrivals = Arrivals(expected=params.jobs)
        await launches.consume(arrivals.on_message, no_ack=True)

        registration_s = await _fleet_registered(stack, params, dsn)
        fleet = ProcessMeter(stack.processes["node-agent"].popen.pid)
        idle_cpu0, fleet_cpu0, idle_t0 = meter.cpu_s(), fleet.cpu_s(), time.monotonic()
        idle_machine0 = MachineCpu.now()
        await asyncio.sleep(params.idle_s)
        idle_machine = MachineCpu.now().since(idle_machine0, "idle_")
        idle_elapsed = max(time.monotonic() - idle_t0, 1e-9)
        idle_cpu_pct = 100 * (meter.cpu_s() - idle_cpu0) / idle_elapsed
        fleet_idle_cpu_pct = 100 * (fleet.cpu_s() - fleet_cpu0) / idle_elapsed

        bodies = submit_bodies(params.jobs)
        references: dict[str, Any] = {}
        if params.raw:
            progress(f"e2e: raw two-hop baseline, {len(bodies)} messages at {params.rate:g}/s")
            references |= await raw_two_hops(connection, amqp_url, bodies, params.rate, user_id, params.timeout_s)
        if floor_dsn is not None:
            from gpuorch_store import migrate

            progress(f"e2e: bare broker+database floor, {len(bodies)} messages at {params.rate:g}/s")
            await migrate(floor_dsn)
            references |= await bare_floor(connection, amqp_url, floor_dsn, bodies, params.rate, user_id,
                                           params.timeout_s)

        progress(f"e2e: submitting {params.jobs} jobs at {params.rate:g}/s")
        publishing = await connection.channel(publisher_confirms=True, on_return_raises=True)
        submit = await publishing.get_exchange(SUBMIT_EXCHANGE)  # declared by the scheduler's broker
        cpu0, main_cpu0, fleet_cpu0 = meter.cpu_s(), meter.cpu_s(children=False), fleet.cpu_s()
        machine0, bench0 = MachineCpu.now(), ProcessMeter(os.getpid()).cpu_s(children=False)
        meter.start_sampling()
        first_submit = time.perf_counter()
        watcher = asyncio.create_task(_report_progress(arrivals, params.jobs))
        try:
            sent_at, send_s = await publish_paced(submit, "job.submit", bodies, params.rate, user_id)
            remaining = params.timeout_s - (time.perf_counter() - first_submit)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrivals.all_in.wait(), timeout=max(remaining, 1.0))
        finally:
            watcher.cancel()
        cpu_s, main_cpu_s = meter.cpu_s() - cpu0, meter.cpu_s(children=False) - main_cpu0
        fleet_cpu_s = fleet.cpu_s() - fleet_cpu0
        window_s = time.perf_counter() - first_submit
        window_machine = MachineCpu.now().since(machine0, "")
        bench_cpu_s = ProcessMeter(os.getpid()).cpu_s(children=False) - bench0
        await meter.stop_sampling()
        high_water = meter.high_water_rss()
    finally:
        await connection.close()

    latencies = arrivals.latencies(sent_at)
    placed = len(arrivals.received_at)
    p50, p99 = ms(percentile(latencies, 0.50)), ms(percentile(latencies, 0.99))
    placements_per_s = arrivals.per_second(first_submit)
    return {
        "nodes": params.nodes, "gpus": params.nodes * GPUS_PER_NODE, "heartbeat_s": params.heartbeat_s,
        "fleet_nice": params.fleet_nice,
        "offered_per_s": params.rate, "jobs": params.jobs, "submitted_per_s": round(params.jobs / send_s, 1),
        "placed": placed, "complete": placed == params.jobs, "duplicate_launches": arrivals.duplicates,
        "placements_per_s": placements_per_s,
        "p50_ms": p50, "p90_ms": ms(percentile(latencies, 0.90)), "p99_ms": p99,
        "max_ms": ms(latencies[-1] if latencies else None),
        **references,
        "overhead_ratio_p50": _ratio(p50, references.get("raw_p50_ms")),
        "overhead_ratio_p99": _ratio(p99, references.get("raw_p99_ms")),
        "floor_ratio": _ratio(placements_per_s, references.get("floor_placements_per_s"), digits=2),
        "registration_s": round(registration_s, 1),
        "scheduler_idle_cpu_pct": round(idle_cpu_pct, 1),
        "idle_cpu_ms_per_node_s": round(10 * idle_cpu_pct / params.nodes, 4),
        "scheduler_cpu_s": round(cpu_s, 2), "window_s": round(window_s, 2),
        "cpu_ms_per_message": round(1000 * cpu_s / params.jobs, 3),
        "relay_cpu_ms_per_message": round(1000 * max(cpu_s - main_cpu_s, 0.0) / params.jobs, 3),
        "cpu_ms_per_message_net": round(1000 * max(cpu_s - idle_cpu_pct / 100 * window_s, 0.0) / params.jobs, 3),
        "fleet_idle_cpu_pct": round(fleet_idle_cpu_pct, 1),
        "fleet_cpu_pct": round(100 * fleet_cpu_s / max(window_s, 1e-9), 1),
        "bench_cpu_pct": round(100 * bench_cpu_s / max(window_s, 1e-9), 1),
        **window_machine, **idle_machine,
        "scheduler_rss_mib": round(meter.peak_rss / 2**20, 1),
        "scheduler_rss_hwm_mib": round(high_water / 2**20, 1) if high_water else None,
    }


def _renice(pid: int, niceness: int) -> None:
    """Give every thread of ``pid`` (Linux keeps a niceness per thread; later threads inherit their creator's)
    ``niceness``."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [pid]:
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)


def _ratio(value: float | None, reference: float | None, digits: int = 1) -> float | None:
    return round(value / reference, digits) if value and reference else None


async def _report_progress(arrivals: Arrivals, jobs: int) -> None:
    while True:
        await asyncio.sleep(2.0)
        progress(f"e2e: {len(arrivals.received_at)}/{jobs} LaunchJob received")
