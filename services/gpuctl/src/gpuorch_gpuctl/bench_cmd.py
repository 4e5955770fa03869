"""``gpuctl bench``: the scheduler at fleet scale, measured against the real RabbitMQ and PostgreSQL.

Pipelines::

    e2e       scratch vhost + database ─> gpuorch-scheduler (subprocess; CPU and RSS read from /proc)
              gpuorch-node-agent fleet (subprocess, N x h100x8, heartbeat 10 s) ─> wait: N rows in `nodes`
              raw hops:  paced publisher ─> bench.raw.in ─> relay (subprocess) ─> bench.raw.out ─> receiver
              scheduler: paced publisher ─> gpuorch.submit/job.submit ─> scheduler ─> outbox relay
                         ─> gpuorch.commands/node.<id>.launch_job ─> receiver (where an executor would be)
    recovery  scratch database ─> COPY a synthetic scheduler history into `events`
              ─> SchedulerService(conn).recover() timed without a snapshot, then with one
    curve     e2e at each fleet size ─> table + PNG (CPU ms per message, p50/p99, RSS)

Contract: every command creates its own RabbitMQ vhost and PostgreSQL database, drops them and stops every
process it started when it ends (also on failure or Ctrl-C), and stops by itself (``--timeout-s``). ``--json``
prints exactly one JSON object on stdout; progress goes to stderr. Figures are measurements of this machine at
this moment: the load average at start and end is part of every result. Nothing here asserts a speed.

Submissions are plain aio-pika publishes of ``SubmitJob`` JSON (publisher confirms, ``mandatory``), as any other
system would send them; gpuctl's own Broker is not used on the measured path. Latency is submit (just before the
publish call) to the ``LaunchJob`` delivered to our queue, matched by ``job_id``. The raw baseline sends the same
bodies at the same rate through the same two broker hops (a quorum queue, a relay that republishes with confirms
and acks after the confirm, a final queue), so ``overhead_ratio_*`` is what the scheduler adds on top of the broker.

``recovery`` is the one command that imports a service (``gpuorch_scheduler.handlers.SchedulerService``): a restart
can only be timed on the scheduler's own fold. It is imported when the command runs, never at gpuctl import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer

bench_app = typer.Typer(help="Benchmarks of the scheduler against the real broker and database (see docs/PERFORMANCE.md).",
                        no_args_is_help=True)



@bench_app.callback()
def _quiet_logs() -> None:
    """Library logs (the scheduler's fold, the broker adapter) go to stderr at warning: stdout is for results."""
    from gpuorch_observability import configure_logging

    configure_logging("gpuctl-bench", "WARNING")


GPUS_PER_NODE = 8
NODE_PROFILE = "h100"
LAUNCH_BINDING = "node.#.launch_job"
RAW_IN_EXCHANGE, RAW_OUT_EXCHANGE = "bench.raw.in", "bench.raw.out"
RAW_RELAY_QUEUE = "bench.raw.relay"

AmqpOpt = Annotated[str, typer.Option("--amqp", envvar="GPUORCH_BENCH_AMQP",
                                      help="RabbitMQ URL without a vhost (a scratch vhost is created)")]
AmqpAdminOpt = Annotated[str, typer.Option("--amqp-admin", envvar="GPUORCH_TEST_AMQP_ADMIN",
                                           help="RabbitMQ management API URL (creates and deletes the vhost)")]
PgAdminOpt = Annotated[str, typer.Option("--pg-admin", envvar="GPUORCH_TEST_PG_ADMIN",
                                         help="PostgreSQL admin DSN (creates and drops the scratch database)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object for scripts")]

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672"
DEFAULT_AMQP_ADMIN = "http://guest:guest@127.0.0.1:15672"
DEFAULT_PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


# -- scratch servers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScratchServers:
    """Where the scratch vhost and database are made: the same servers and defaults as the test fixtures."""

    amqp: str = DEFAULT_AMQP
    amqp_admin: str = DEFAULT_AMQP_ADMIN
    pg_admin: str = DEFAULT_PG_ADMIN

    def _mgmt(self, method: str, path: str, body: dict[str, str] | None = None) -> None:
        import httpx

        url = httpx.URL(self.amqp_admin)
        response = httpx.request(method, f"{url.scheme}://{url.host}:{url.port}{path}",
                                 auth=(url.username or "guest", url.password or "guest"), timeout=30,
                                 json=body if body is not None else ({} if method == "PUT" else None))
        response.raise_for_status()

    @contextlib.contextmanager
    def vhost(self) -> Iterator[str]:
        """A fresh vhost (guest may do anything in it); yields its AMQP URL; deleted afterwards."""
        name = f"gpuorch-bench-{uuid.uuid4().hex[:10]}"
        self._mgmt("PUT", f"/api/vhosts/{name}")
        try:
            self._mgmt("PUT", f"/api/permissions/{name}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
            yield f"{self.amqp.rstrip('/')}/{name}"
        finally:
            with contextlib.suppress(Exception):
                self._mgmt("DELETE", f"/api/vhosts/{name}")

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh empty database; yields its DSN; dropped afterwards (WITH FORCE)."""
        name = f"gpuorch_bench_{uuid.uuid4().hex[:10]}"
        asyncio.run(self._admin(f'CREATE DATABASE "{name}"'))
        try:
            yield f"{self.pg_admin.rsplit('/', 1)[0]}/{name}"
        finally:
            with contextlib.suppress(Exception):
                asyncio.run(self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    async def _admin(self, sql: str) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.pg_admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()


# -- process accounting ------------------------------------------------------------------------------------------


@dataclass
class ProcessMeter:
    """CPU seconds and resident memory of one process and its children (the scheduler's outbox relay runs in a
    child process), read from /proc (through psutil)."""

    pid: int
    peak_rss: int = 0
    _sampler: asyncio.Task[None] | None = field(default=None, repr=False)

    def cpu_s(self) -> float:
        import psutil

        process = psutil.Process(self.pid)
        total = 0.0
        for each in (process, *process.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = each.cpu_times()
                total += times.user + times.system
        return total

    def rss(self) -> int:
        import psutil

        process = psutil.Process(self.pid)
        total = 0
        for each in (process, *process.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                total += each.memory_info().rss
        return total

    def high_water_rss(self) -> int | None:
        """VmHWM: the peak resident set since the process started (Linux only)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start_sampling(self, every_s: float = 0.25) -> None:
        async def sample() -> None:
            while True:
                with contextlib.suppress(Exception):
                    self.peak_rss = max(self.peak_rss, self.rss())
                await asyncio.sleep(every_s)

        self.peak_rss = 0
        self._sampler = asyncio.create_task(sample())

    async def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        with contextlib.suppress(Exception):
            self.peak_rss = max(self.peak_rss, self.rss())


# -- paced publishing and receiving ------------------------------------------------------------------------------


@dataclass
class Arrivals:
    """First arrival time of each key (a job id) at a receiver; later copies are counted as duplicates."""

    expected: int
    received_at: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_message(self, message: Any) -> None:
        now = time.perf_counter()
        key = str(json.loads(message.body)["job_id"])
        if key in self.received_at:
            self.duplicates += 1
            return
        self.received_at[key] = now
        if len(self.received_at) >= self.expected:
            self.all_in.set()


async def publish_paced(exchange: Any, routing_key: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                        user_id: str | None, max_in_flight: int = 2000) -> tuple[dict[str, float], float]:
    """Publish ``(key, body)`` at ``rate`` per second (confirms, mandatory, persistent), confirms awaited
    concurrently (at most ``max_in_flight`` unconfirmed). Returns each key's send time and the seconds it took
    to send them all (so the achieved rate can be reported). Raises on the first unconfirmed message."""
    import aio_pika

    sent_at: dict[str, float] = {}
    gate = asyncio.Semaphore(max_in_flight)
    pending: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    async def send(key: str, body: bytes) -> None:
        try:
            message = aio_pika.Message(body, message_id=str(uuid.uuid4()), content_type="application/json",
                                       delivery_mode=aio_pika.DeliveryMode.PERSISTENT, user_id=user_id)
            sent_at[key] = time.perf_counter()
            await exchange.publish(message, routing_key, mandatory=True, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported after the loop
            failures.append(exc)
        finally:
            gate.release()

    started = time.perf_counter()
    sent = 0
    while sent < len(bodies) and not failures:
        due = min(len(bodies), int((time.perf_counter() - started) * rate) + 1)
        while sent < due:
            await gate.acquire()
            task = asyncio.create_task(send(*bodies[sent]))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.sleep(max(0.0, started + sent / rate - time.perf_counter()))
    if pending:
        await asyncio.wait(set(pending))
    if failures:
        raise RuntimeError(f"{len(failures)} publishes not confirmed: {failures[0]!r}") from failures[0]
    return sent_at, time.perf_counter() - started


def submit_bodies(jobs: int) -> list[tuple[str, bytes]]:
    """``jobs`` SubmitJob bodies for one whole GPU each, keyed by job id (serialised before timing starts)."""
    from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob

    spec = JobSpec(name="bench", tenant="bench", tier="batch", resources=GpuRequest(gpus=1),
                   cpu_milli=1000, memory_mib=4096, run=ProcessRun(argv=["python", "-c", "pass"]))
    bodies = []
    for _ in range(jobs):
        message = SubmitJob(spec=spec, producer="bench")
        bodies.append((str(message.job_id), message.model_dump_json().encode()))
    return bodies


def _latencies(sent_at: dict[str, float], arrivals: Arrivals) -> list[float]:
    return sorted(arrivals.received_at[k] - sent_at[k] for k in arrivals.received_at if k in sent_at)


# -- the raw two-hop baseline ------------------------------------------------------------------------------------


async def relay_hop(amqp_url: str, duration_s: float) -> None:
    """The bare middle of the raw baseline: consume ``bench.raw.relay`` (prefetch 64, like the scheduler's queue),
    republish each body to ``bench.raw.out`` with confirms and ``mandatory``, ack after the confirm."""
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=64)
        out = await channel.declare_exchange(RAW_OUT_EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=False)
        queue = await channel.declare_queue(RAW_RELAY_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})

        async def forward(incoming: Any) -> None:
            await out.publish(aio_pika.Message(incoming.body, message_id=incoming.message_id,
                                               delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "hop", mandatory=True)
            await incoming.ack()

        await queue.consume(forward)
        await asyncio.sleep(duration_s)
    finally:
        await connection.close()


@bench_app.command("relay", hidden=True)
def relay(amqp_url: str, duration_s: float = 600.0) -> None:
    """The raw baseline's relay process (started by ``bench e2e``; stops after ``duration_s``)."""
    asyncio.run(relay_hop(amqp_url, duration_s))


async def raw_two_hops(connection: Any, amqp_url: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                       user_id: str | None, timeout_s: float) -> dict[str, Any]:
    """The same bodies, at the same rate, through two bare broker hops; latency where the last consumer gets them."""
    import aio_pika

    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    first = await channel.declare_exchange(RAW_IN_EXCHANGE, aio_pika.ExchangeType.TOPIC)
    out = await channel.declare_exchange(RAW_OUT_EXCHANGE, aio_pika.ExchangeType.TOPIC)
    hop_queue = await channel.declare_queue(RAW_RELAY_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    await hop_queue.bind(first, "hop")
    receiving = await connection.channel()
    await receiving.set_qos(prefetch_count=1000)
    final = await receiving.declare_queue("", exclusive=True)
    await final.bind(out, "hop")
    arrivals = Arrivals(expected=len(bodies))
    await final.consume(arrivals.on_message, no_ack=True)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuorch_gpuctl", "bench", "relay", amqp_url, "--duration-s", str(timeout_s + 60),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (await channel.declare_queue(RAW_RELAY_QUEUE, passive=True)).declaration_result.consumer_count < 1:
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("the raw relay did not start consuming")
            await asyncio.sleep(0.2)
        sent_at, _ = await publish_paced(first, "hop", bodies, rate, user_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrivals.all_in.wait(), timeout=timeout_s)
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), timeout=10)
        except TimeoutError:
            process.kill()
            await process.wait()
        await channel.close()
        await receiving.close()
    latencies = _latencies(sent_at, arrivals)
    return {"raw_messages": len(bodies), "raw_received": len(arrivals.received_at),
            "raw_p50_ms": _ms(_percentile(latencies, 0.50)), "raw_p99_ms": _ms(_percentile(latencies, 0.99))}


# -- e2e -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class E2eParameters:
    nodes: int
    rate: float
    jobs: int
    timeout_s: float = 600.0
    register_timeout_s: float = 600.0
    heartbeat_s: float = 10.0
    idle_s: float = 5.0
    scheduler_log_level: str = "WARNING"
    raw: bool = True


def run_e2e(params: E2eParameters, servers: ScratchServers) -> dict[str, Any]:
    """One end-to-end measurement on a scratch vhost and database; returns the result (see ``e2e``)."""
    from gpuorch_gpuctl.stack import LocalStack, SimNode

    if params.jobs > params.nodes * GPUS_PER_NODE:
        raise ValueError(f"{params.jobs} one-GPU jobs cannot all be placed on {params.nodes} nodes x "
                         f"{GPUS_PER_NODE} GPUs (nothing finishes in this benchmark)")
    before = _machine()
    with servers.vhost() as amqp_url, servers.database() as dsn, tempfile.TemporaryDirectory() as root:
        fleet = [SimNode(f"bench-{i:05d}", NODE_PROFILE, GPUS_PER_NODE, cpu_milli=GPUS_PER_NODE * 16000,
                         memory_mib=GPUS_PER_NODE * 128 * 1024) for i in range(params.nodes)]
        stack = LocalStack(root=Path(root), amqp_url=amqp_url, database_url=dsn, nodes=fleet,
                           extra_env={"GPUORCH_LOG_LEVEL": params.scheduler_log_level})
        try:
            result = asyncio.run(_e2e(stack, params, amqp_url, dsn))
        except BaseException:
            for name in stack.processes:
                _progress(f"{name} log tail:\n{stack.tail(name, 15)}")
            raise
        finally:
            stack.stop_all()
    return {**result, "load_avg_1m_start": before["load_avg_1m"], "load_avg_1m_end": _machine()["load_avg_1m"],
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


async def _e2e(stack: Any, params: E2eParameters, amqp_url: str, dsn: str) -> dict[str, Any]:
    import aio_pika
    from gpuorch_contracts import COMMANDS_EXCHANGE, SUBMIT_EXCHANGE

    _progress(f"e2e: {params.nodes} nodes, {params.jobs} jobs at {params.rate:g}/s; starting the scheduler")
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

        fleet_started = time.monotonic()
        stack.start_node_agents(GPUORCH_HEARTBEAT_S=str(params.heartbeat_s), GPUORCH_USAGE_S="3600",
                                GPUORCH_LOG_LEVEL="WARNING")
        known = 0
        while known < params.nodes:
            if time.monotonic() - fleet_started > params.register_timeout_s:
                raise TimeoutError(f"the scheduler knows {known} of {params.nodes} nodes after "
                                   f"{params.register_timeout_s:.0f}s")
            if stack.dead():
                raise RuntimeError(f"a service died: {stack.dead()}")
            await asyncio.sleep(1.0)
            previous, known = known, await _count_nodes(dsn)
            if known != previous or known == params.nodes:
                _progress(f"e2e: scheduler knows {known}/{params.nodes} nodes")
        registration_s = time.monotonic() - fleet_started

        idle_cpu0, idle_t0 = meter.cpu_s(), time.monotonic()
        await asyncio.sleep(params.idle_s)
        idle_cpu_pct = 100 * (meter.cpu_s() - idle_cpu0) / max(time.monotonic() - idle_t0, 1e-9)

        bodies = submit_bodies(params.jobs)
        raw: dict[str, Any] = {}
        if params.raw:
            _progress(f"e2e: raw two-hop baseline, {len(bodies)} messages at {params.rate:g}/s")
            raw = await raw_two_hops(connection, amqp_url, bodies, params.rate, user_id, params.timeout_s)

        _progress(f"e2e: submitting {params.jobs} jobs at {params.rate:g}/s")
        publishing = await connection.channel(publisher_confirms=True, on_return_raises=True)
        submit = await publishing.get_exchange(SUBMIT_EXCHANGE)  # declared by the scheduler's broker
        cpu0 = meter.cpu_s()
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
        cpu_s = meter.cpu_s() - cpu0
        window_s = time.perf_counter() - first_submit
        await meter.stop_sampling()
        high_water = meter.high_water_rss()
    finally:
        await connection.close()

    latencies = _latencies(sent_at, arrivals)
    placed = len(arrivals.received_at)
    last_launch = max(arrivals.received_at.values(), default=first_submit)
    p50, p99 = _ms(_percentile(latencies, 0.50)), _ms(_percentile(latencies, 0.99))
    result: dict[str, Any] = {
        "nodes": params.nodes, "gpus": params.nodes * GPUS_PER_NODE, "heartbeat_s": params.heartbeat_s,
        "offered_per_s": params.rate, "jobs": params.jobs, "submitted_per_s": round(params.jobs / send_s, 1),
        "placed": placed, "complete": placed == params.jobs, "duplicate_launches": arrivals.duplicates,
        "placements_per_s": round(placed / max(last_launch - first_submit, 1e-9), 1) if placed else 0.0,
        "p50_ms": p50, "p90_ms": _ms(_percentile(latencies, 0.90)), "p99_ms": p99,
        "max_ms": _ms(latencies[-1] if latencies else None),
        **raw,
        "overhead_ratio_p50": round(p50 / raw["raw_p50_ms"], 1) if raw.get("raw_p50_ms") and p50 else None,
        "overhead_ratio_p99": round(p99 / raw["raw_p99_ms"], 1) if raw.get("raw_p99_ms") and p99 else None,
        "registration_s": round(registration_s, 1),
        "scheduler_idle_cpu_pct": round(idle_cpu_pct, 1),
        "scheduler_cpu_s": round(cpu_s, 2), "window_s": round(window_s, 2),
        "cpu_ms_per_message": round(1000 * cpu_s / params.jobs, 3),
        "cpu_ms_per_message_net": round(1000 * max(cpu_s - idle_cpu_pct / 100 * window_s, 0.0) / params.jobs, 3),
        "scheduler_rss_mib": round(meter.peak_rss / 2**20, 1),
        "scheduler_rss_hwm_mib": round(high_water / 2**20, 1) if high_water else None,
    }
    return result


async def _report_progress(arrivals: Arrivals, jobs: int) -> None:
    while True:
        await asyncio.sleep(2.0)
        _progress(f"e2e: {len(arrivals.received_at)}/{jobs} LaunchJob received")


E2E_COLUMNS = ("nodes", "offered_per_s", "jobs", "placed", "placements_per_s", "p50_ms", "p99_ms", "raw_p50_ms",
               "raw_p99_ms", "overhead_ratio_p50", "cpu_ms_per_message", "scheduler_rss_mib", "load_avg_1m_start")


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console().print(table)


@bench_app.command()
def e2e(
    nodes: Annotated[int, typer.Option(min=1, help="simulated h100x8 nodes")] = 1000,
    rate: Annotated[float, typer.Option(min=0.1, help="SubmitJob messages offered per second")] = 500.0,
    jobs: Annotated[int, typer.Option(min=1, help="one-GPU jobs to submit (at most 8 x nodes)")] = 5000,
    timeout_s: Annotated[float, typer.Option(help="stop waiting for launches this many seconds after the first "
                                                  "submit; the figures of what arrived are reported")] = 600.0,
    register_timeout_s: Annotated[float, typer.Option(help="fail if the scheduler does not know every node by "
                                                           "then")] = 600.0,
    idle_s: Annotated[float, typer.Option(help="seconds of heartbeats only, before submitting, to measure the "
                                               "scheduler's idle CPU")] = 5.0,
    raw: Annotated[bool, typer.Option(help="also measure the bare two-hop broker baseline")] = True,
    heartbeat_s: Annotated[float, typer.Option(help="seconds between heartbeats of each simulated node")] = 10.0,
    scheduler_log_level: Annotated[str, typer.Option(help="the scheduler's GPUORCH_LOG_LEVEL")] = "WARNING",
    amqp: AmqpOpt = DEFAULT_AMQP,
    amqp_admin: AmqpAdminOpt = DEFAULT_AMQP_ADMIN,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """Submit -> LaunchJob through the real scheduler on a simulated fleet, beside the raw broker baseline.

    Keys: nodes, offered_per_s, jobs, placed, placements_per_s (placed / (last LaunchJob - first submit)),
    p50_ms/p90_ms/p99_ms (submit -> LaunchJob received), raw_p50_ms/raw_p99_ms and overhead_ratio_p50/p99, the
    scheduler's CPU seconds over the submit window and cpu_ms_per_message (that CPU / jobs; includes the
    heartbeats and ticks of the window; cpu_ms_per_message_net subtracts the idle rate, scheduler_idle_cpu_pct,
    measured over --idle-s before submitting), and its peak RSS (MiB).
    """
    params = E2eParameters(nodes=nodes, rate=rate, jobs=jobs, timeout_s=timeout_s, idle_s=idle_s,
                           register_timeout_s=register_timeout_s, heartbeat_s=heartbeat_s,
                           scheduler_log_level=scheduler_log_level, raw=raw)
    try:
        result = run_e2e(params, ScratchServers(amqp, amqp_admin, pg_admin))
    except (ValueError, TimeoutError, RuntimeError) as exc:
        _progress(f"e2e failed: {exc}")
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(result))
    else:
        _print_table([result], E2E_COLUMNS, "gpuctl bench e2e")


# -- curve -------------------------------------------------------------------------------------------------------

CURVE_COLUMNS = ("nodes", "jobs", "offered_per_s", "placements_per_s", "cpu_ms_per_message", "cpu_ms_per_message_net",
                 "scheduler_idle_cpu_pct", "p50_ms", "p99_ms", "raw_p50_ms", "scheduler_rss_mib", "load_avg_1m_start")


def write_curve_png(points: list[dict[str, Any]], path: Path, title: str) -> None:
    """Three panels against fleet size (log scale): CPU ms per message, p50/p99 latency, scheduler RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [p["nodes"] for p in points]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    axes[0].plot(nodes, [p["cpu_ms_per_message"] for p in points], "o-", label="all CPU in the window")
    axes[0].plot(nodes, [p.get("cpu_ms_per_message_net") for p in points], "s--", label="less idle (heartbeats)")
    axes[0].set_ylabel("scheduler CPU ms per SubmitJob")
    axes[0].legend()
    axes[1].plot(nodes, [p["p50_ms"] for p in points], "o-", label="p50")
    axes[1].plot(nodes, [p["p99_ms"] for p in points], "s--", label="p99")
    axes[1].plot(nodes, [p.get("raw_p50_ms") for p in points], "^:", label="raw broker p50")
    axes[1].set_ylabel("submit -> LaunchJob ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    axes[2].plot(nodes, [p["scheduler_rss_mib"] for p in points], "o-")
    axes[2].set_ylabel("scheduler RSS MiB (peak in run)")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xlabel("nodes (8 GPUs each)")
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


@bench_app.command()
def curve(
    nodes: Annotated[str, typer.Option(help="fleet sizes, comma-separated")] = "100,1000,5000,10000",
    rate: Annotated[float, typer.Option(min=0.1, help="SubmitJob messages offered per second")] = 200.0,
    jobs: Annotated[int, typer.Option(min=1, help="jobs per point (capped at the fleet's GPUs)")] = 2000,
    timeout_s: Annotated[float, typer.Option(help="per point, as in `bench e2e`")] = 600.0,
    register_timeout_s: Annotated[float, typer.Option(help="per point, as in `bench e2e`")] = 600.0,
    png: Annotated[Path | None, typer.Option(help="write the curve as a PNG here")] = Path("docs/img/cost_curve.png"),
    label: Annotated[str, typer.Option(help="words added to the PNG's title (e.g. which scheduler)")] = "",
    scheduler_log_level: Annotated[str, typer.Option(help="the scheduler's GPUORCH_LOG_LEVEL")] = "WARNING",
    amqp: AmqpOpt = DEFAULT_AMQP,
    amqp_admin: AmqpAdminOpt = DEFAULT_AMQP_ADMIN,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """The cost curve: `bench e2e` at each fleet size, fixed rate; per-message scheduler CPU, latency and RSS."""
    servers = ScratchServers(amqp, amqp_admin, pg_admin)
    sizes = [int(n) for n in nodes.split(",") if n.strip()]
    points = []
    for size in sizes:
        params = E2eParameters(nodes=size, rate=rate, jobs=min(jobs, size * GPUS_PER_NODE), timeout_s=timeout_s,
                               register_timeout_s=register_timeout_s, scheduler_log_level=scheduler_log_level)
        try:
            points.append(run_e2e(params, servers))
        except (ValueError, TimeoutError, RuntimeError) as exc:
            _progress(f"curve: {size} nodes failed: {exc}")
            points.append({"nodes": size, "jobs": params.jobs, "offered_per_s": rate, "error": str(exc)})
    measured = [p for p in points if "error" not in p and p.get("p50_ms") is not None]
    if png is not None and measured:
        write_curve_png(measured, png, f"scheduler cost by fleet size ({rate:g} one-GPU SubmitJob/s, "
                                       f"{time.strftime('%Y-%m-%d')}){' ' + label if label else ''}")
        _progress(f"curve: wrote {png}")
    if as_json:
        print(json.dumps({"rate": rate, "points": points, "png": str(png) if png else None}))
    else:
        _print_table(points, CURVE_COLUMNS, "gpuctl bench curve")


# -- recovery ----------------------------------------------------------------------------------------------------

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
                _progress(f"recovery: {written:,}/{shape.events:,} events written")
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


async def time_recovery(dsn: str, repeats: int, save: Callable[[Any], Any] | None = None) -> tuple[list[float], Any]:
    """Seconds of ``SchedulerService(conn).recover()`` on a fresh connection, ``repeats`` times; the last state."""
    import asyncpg
    from gpuorch_scheduler.handlers import SchedulerService

    seconds: list[float] = []
    state: Any = None
    for attempt in range(repeats):
        conn = await asyncpg.connect(dsn)
        try:
            service = SchedulerService(conn)
            started = time.perf_counter()
            await service.recover()
            seconds.append(time.perf_counter() - started)
            state = service.state
            _progress(f"recovery: run {attempt + 1}/{repeats}: {seconds[-1]:.2f}s")
        finally:
            await conn.close()
    return seconds, state


async def _recovery(dsn: str, shape: HistoryShape, repeats: int) -> dict[str, Any]:
    import asyncpg
    from gpuorch_store import save_snapshot

    started = time.perf_counter()
    written, jobs_in_log = await fill_event_log(dsn, shape)
    fill_s = time.perf_counter() - started
    _progress(f"recovery: {written:,} events in {fill_s:.0f}s; recover() without a snapshot")
    cold, state = await time_recovery(dsn, repeats)
    result: dict[str, Any] = {
        "events": written, "jobs_in_log": jobs_in_log, "repeats": repeats, "fill_s": round(fill_s, 1),
        "recover_no_snapshot_s": round(statistics.median(cold), 2),
        "recover_no_snapshot_runs_s": [round(s, 2) for s in cold],
        "state_jobs_without_snapshot": len(state.jobs), "state_nodes": len(state.nodes), "position": state.position,
    }
    conn = await asyncpg.connect(dsn)
    try:
        started = time.perf_counter()
        await save_snapshot(conn, STREAM, state.position, state.to_snapshot())
        result["snapshot_save_s"] = round(time.perf_counter() - started, 2)
        stored = await conn.fetchval("SELECT pg_column_size(state) FROM snapshots ORDER BY position DESC LIMIT 1")
        result["snapshot_mib_stored"] = round(stored / 2**20, 1)
    except asyncpg.PostgresError as exc:  # e.g. a state too large for one jsonb value (256 MiB)
        result["snapshot_error"] = f"{type(exc).__name__}: {exc}"
        _progress(f"recovery: the snapshot could not be saved: {result['snapshot_error']}")
        return result
    finally:
        await conn.close()
    _progress("recovery: recover() from the snapshot")
    warm, warm_state = await time_recovery(dsn, repeats)
    result.update({
        "recover_snapshot_s": round(statistics.median(warm), 2),
        "recover_snapshot_runs_s": [round(s, 2) for s in warm],
        "state_jobs": len(warm_state.jobs), "state_nodes": len(warm_state.nodes),
    })
    return result


@bench_app.command()
def recovery(
    events: Annotated[int, typer.Option(min=1, help="events in the synthetic log")] = 1_000_000,
    nodes: Annotated[int, typer.Option(min=1, help="nodes registered at the start of the history")] = 1000,
    running: Annotated[int, typer.Option(min=0, help="jobs running at any moment of the history")] = 4000,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each recovery; the median is reported")] = 3,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """Scheduler restart time from a log of --events events: without a snapshot, then from a snapshot.

    The history (``synthetic_history``): node registrations, then one-GPU jobs accepted -> placed -> started ->
    finished, written with COPY in the rows the store's append writes. ``state_jobs``/``state_nodes`` are what
    ``recover()`` yields (a scheduler that forgets finished jobs holds fewer jobs than the log has).
    """
    before = _machine()
    shape = HistoryShape(events=events, nodes=nodes, running=min(running, nodes * GPUS_PER_NODE))
    servers = ScratchServers(pg_admin=pg_admin)
    with servers.database() as dsn:
        result = asyncio.run(_recovery(dsn, shape, repeats))
    result.update({"nodes": nodes, "load_avg_1m_start": before["load_avg_1m"],
                   "load_avg_1m_end": _machine()["load_avg_1m"], "cpus": before["cpus"]})
    if as_json:
        print(json.dumps(result))
    else:
        _print_table([result], ("events", "nodes", "jobs_in_log", "recover_no_snapshot_s", "recover_snapshot_s",
                                "state_jobs_without_snapshot", "state_jobs", "state_nodes", "snapshot_mib_stored",
                                "snapshot_error", "fill_s", "load_avg_1m_start"),
                     "gpuctl bench recovery")


@bench_app.command()
def core(
    nodes: Annotated[str, typer.Option(help="comma-separated fleet sizes (h100x8 nodes)")] = "1000,10000",
    jobs: Annotated[int, typer.Option(min=1, help="one-GPU jobs per fleet size (at most 8 x nodes)")] = 10_000,
    repeats: Annotated[int, typer.Option(min=1, help="runs per fleet size; medians are reported")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """The scheduler's step in process, on its Harness (no broker, no database): one-GPU jobs onto N x 8 GPUs, the
    shape of Armada's scheduler benchmark. Keys per fleet size: placements_per_s (one cycle and the plan applier
    deciding every job), step_placements_per_s (the whole step, admission included) and engine_placements_per_s
    (the placement engine alone)."""
    from gpuorch_gpuctl.bench_core import run_core

    sizes = [int(n) for n in nodes.split(",") if n.strip()]
    rows = []
    for size in sizes:
        _progress(f"core: {size} nodes, {min(jobs, size * 8)} jobs, {repeats} runs")
        rows += run_core([size], jobs, repeats)
    result = {"machine": _machine(), "load_avg_1m": round(os.getloadavg()[0], 2), "fleets": rows}
    if as_json:
        print(json.dumps(result))
        return
    _print_table(rows, ["nodes", "gpus", "jobs", "placed", "placements_per_s", "step_placements_per_s",
                        "engine_placements_per_s", "repeats"], "The scheduler's step in process (medians)")
