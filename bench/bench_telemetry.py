"""Can ONE telemetry instance keep up with 5,000 nodes x 8 GPUs sampling every 10 s (500 GpuUsageSampled/s)?

    uv run python bench/bench_telemetry.py                          # 5,000 nodes, 8 GPUs, every 10 s, 60 s measured
    uv run python bench/bench_telemetry.py --nodes 500 --duration-s 20

What it does: makes a fresh RabbitMQ vhost and a fresh PostgreSQL database (all migrations applied), starts
``gpuorch-telemetry`` as its own process (so its CPU and memory are measured alone), places ``--jobs`` 8-GPU jobs
through the broker (job.accepted/placed/started, so samples are attributed to jobs), then publishes every node's
sample on its 10 s period (spread evenly, confirmed by the broker) for a warm-up and the measured window, and prints:

- published/s and ingested/s: messages confirmed by the broker, and messages committed by telemetry (its
  ``gpuorch_telemetry_samples_ingested_total`` counter), per second over the window;
- lag p50/p95: from each sample's ``occurred_at`` to the commit of its batch (telemetry's
  ``gpuorch_telemetry_ingest_lag_seconds`` histogram over the window, interpolated within buckets like
  Prometheus' histogram_quantile);
- CPU % and RSS of the telemetry process (psutil; 100 % = one core), queue depth at the end, drain time after the
  producer stops, rows written, and how many job evaluations ran meanwhile (detection window ``--window-s``);
- how long full ``/metrics`` scrapes took: one every 15 s during the run (as Prometheus would), one at the end.
The producer pre-renders each node's JSON body once and only swaps the message id and timestamp per send; telemetry
still decodes and validates every message in full.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import asyncpg
import httpx
import psutil
from gpuorch_contracts import EVENTS_EXCHANGE, GpuAllocation, GpuUsageSampled, utc_now
from gpuorch_messaging import Broker
from gpuorch_store.migrations import migrate
from gpuorch_telemetry.simulation import PROFILES, SimulatedGpu, gpu_uuid, simulated_job

MGMT = os.environ.get("GPUORCH_TEST_AMQP_ADMIN", "http://guest:guest@127.0.0.1:15672")
AMQP = os.environ.get("GPUORCH_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672")
PG_ADMIN = os.environ.get("GPUORCH_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
PLACEHOLDER_ID = "00000000-0000-4000-8000-000000000000"
PLACEHOLDER_AT = "2000-01-01T00:00:00Z"


def _mgmt(method: str, path: str, body: dict[str, str] | None = None) -> httpx.Response:
    url = httpx.URL(MGMT)
    response = httpx.request(method, f"{url.scheme}://{url.host}:{url.port}{path}",
                             auth=(url.username or "guest", url.password or "guest"), timeout=30,
                             json=body if body is not None else ({} if method == "PUT" else None))
    response.raise_for_status()
    return response


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


INSTANCE_METRICS = ("gpuorch_telemetry_samples_ingested_total", "gpuorch_telemetry_ingest_lag_seconds",
                    "gpuorch_telemetry_ingest_batch_messages", "gpuorch_telemetry_jobs_evaluated_total")


def _scrape(port: int) -> dict[str, float]:
    """This instance's own counters only (``name[]`` filter): the fleet gauges are measured separately."""
    names = [f"{n}{suffix}" for n in INSTANCE_METRICS for suffix in ("", "_total", "_bucket", "_count", "_sum")]
    values: dict[str, float] = {}
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", params={"name[]": names}, timeout=30)
    for line in response.text.splitlines():
        if line.startswith("gpuorch_telemetry_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _quantile(q: float, before: dict[str, float], after: dict[str, float]) -> float:
    """histogram_quantile over the window (after - before) of the ingest lag histogram."""
    prefix = 'gpuorch_telemetry_ingest_lag_seconds_bucket{le="'
    buckets = sorted(
        (float("inf") if k[len(prefix):-2] == "+Inf" else float(k[len(prefix):-2]), v - before.get(k, 0.0))
        for k, v in after.items() if k.startswith(prefix)
    )
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return float("nan")
    rank, lower_bound, lower_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


def _node_template(node: int, gpus: int, busy: bool) -> str:
    node_id = f"node-{node:05d}"
    simulated = [SimulatedGpu(node_id=node_id, index=i, uuid=gpu_uuid(node_id, i),
                              profile=PROFILES["normal"] if busy else None, pids=[10_000 + node] if busy else [])
                 for i in range(gpus)]
    message = GpuUsageSampled(message_id=uuid.UUID(PLACEHOLDER_ID), node_id=node_id,
                              samples=[g.sample() for g in simulated],
                              occurred_at=datetime(2000, 1, 1, tzinfo=UTC), producer="bench")
    return message.model_dump_json().replace("2000-01-01T00:00:00Z", PLACEHOLDER_AT)


async def bench(
    nodes: int, gpus: int, period_s: float, jobs: int, warmup_s: float, duration_s: float, window_s: float
) -> None:
    vhost = f"gpuorch-bench-{uuid.uuid4().hex[:10]}"
    database = f"gpuorch_bench_{uuid.uuid4().hex[:10]}"
    _mgmt("PUT", f"/api/vhosts/{vhost}")
    _mgmt("PUT", f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'CREATE DATABASE "{database}"')
    dsn = f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}"
    url = f"{AMQP}/{vhost}"
    port = _free_port()
    child: subprocess.Popen[bytes] | None = None
    broker = Broker(url, producer="bench")
    try:
        await migrate(dsn)
        env = {**os.environ, "GPUORCH_AMQP_URL": url, "GPUORCH_DATABASE_URL": dsn, "GPUORCH_METRICS_PORT": str(port),
               "GPUORCH_LOG_LEVEL": "WARNING", "GPUORCH_TELEMETRY_INSTANCE": "telemetry/bench",
               "GPUORCH_TELEMETRY_WINDOW_S": str(window_s), "GPUORCH_BROKER_TOPOLOGY": "declare"}
        child = subprocess.Popen([sys.executable, "-m", "gpuorch_telemetry.entrypoint"], env=env)
        process = psutil.Process(child.pid)
        deadline = time.monotonic() + 60
        while True:
            try:
                _mgmt("GET", f"/api/queues/{vhost}/telemetry.samples")
                _scrape(port)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or child.poll() is not None:
                    raise RuntimeError("telemetry did not start") from None
                await asyncio.sleep(0.2)
        await broker.connect()

        started = time.perf_counter()
        job_messages = []
        for n in range(jobs):
            node_id = f"node-{n:05d}"
            job = simulated_job(f"bench-{n}", node_id,
                                [GpuAllocation(gpu_uuid=gpu_uuid(node_id, i), gpu_index=i) for i in range(gpus)],
                                10_000 + n, tenant=f"tenant-{n % 7}")
            job_messages.extend(job.lifecycle(utc_now(), utc_now()))
        for i in range(0, len(job_messages), 500):
            await broker.publish_many(job_messages[i:i + 500])
        db = await asyncpg.connect(dsn)
        while await db.fetchval("SELECT count(*) FROM telemetry_job_processes") < jobs:
            await asyncio.sleep(0.2)
        jobs_s = time.perf_counter() - started

        templates = [_node_template(n, gpus, busy=n < jobs).encode() for n in range(nodes)]
        at_bytes, id_bytes = PLACEHOLDER_AT.encode(), PLACEHOLDER_ID.encode()
        published = 0
        tick_s = 0.1
        per_tick = nodes * tick_s / period_s
        measure_from = warmup_s
        stop_at = warmup_s + duration_s
        before: dict[str, float] = {}
        cpu0 = wall0 = 0.0
        published0 = 0
        scrape_times: list[float] = []

        async def prometheus() -> None:  # a full scrape every 15 s, as Prometheus would do
            while True:
                await asyncio.sleep(15)
                began = time.perf_counter()
                curl = await asyncio.create_subprocess_exec(  # its own process, like Prometheus
                    "curl", "-sf", "-o", "/dev/null", f"http://127.0.0.1:{port}/metrics")
                await curl.wait()
                scrape_times.append(time.perf_counter() - began)

        scraper = asyncio.create_task(prometheus())
        t0 = time.perf_counter()
        next_node = 0.0
        cursor = 0
        measuring = False
        while True:
            elapsed = time.perf_counter() - t0
            if not measuring and elapsed >= measure_from:
                before, cpu = _scrape(port), process.cpu_times()
                cpu0, wall0, published0, measuring = cpu.user + cpu.system, time.perf_counter(), published, True
            if elapsed >= stop_at:
                break
            next_node += per_tick
            batch = []
            while cursor < int(next_node):
                template = templates[cursor % nodes]
                message_id = str(uuid.uuid4())
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ").encode()
                batch.append((template.replace(id_bytes, message_id.encode()).replace(at_bytes, now), message_id))
                cursor += 1
            await asyncio.gather(*(broker.publish_raw(EVENTS_EXCHANGE, "gpu.usage_sampled", body, message_id=mid,
                                                      headers={"type": "gpu.usage_sampled"})
                                   for body, mid in batch))
            published += len(batch)
            await asyncio.sleep(max(0.0, t0 + elapsed + tick_s - time.perf_counter()))
        after, cpu = _scrape(port), process.cpu_times()
        window = time.perf_counter() - wall0
        scraper.cancel()
        cpu_pct = 100 * (cpu.user + cpu.system - cpu0) / window
        rss_mib = process.memory_info().rss / 2**20
        depth = _mgmt("GET", f"/api/queues/{vhost}/telemetry.samples").json().get("messages", 0)
        key = 'gpuorch_telemetry_samples_ingested_total{outcome="applied"}'
        ingested = after.get(key, 0.0) - before.get(key, 0.0)
        drain_started = time.perf_counter()
        while _scrape(port).get(key, 0.0) < published and time.perf_counter() - drain_started < 120:
            await asyncio.sleep(0.2)
        drain_s = time.perf_counter() - drain_started
        final = _scrape(port)
        scrape_started = time.perf_counter()
        full = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=120).text
        scrape_s = time.perf_counter() - scrape_started
        series = sum(1 for line in full.splitlines() if line and not line.startswith("#"))
        gpu_series = sum(1 for line in full.splitlines() if line.startswith("DCGM_FI_DEV_GPU_UTIL{"))
        gpu_rows = await db.fetchval("SELECT count(*) FROM telemetry_gpu_samples")
        job_rows = await db.fetchval("SELECT count(*) FROM telemetry_job_samples")
        await db.close()
        batch_count = after.get("gpuorch_telemetry_ingest_batch_messages_count", 0) - before.get(
            "gpuorch_telemetry_ingest_batch_messages_count", 0)
        rows = [
            ("nodes x GPUs, period", f"{nodes} x {gpus}, every {period_s:g} s"),
            ("jobs placed (8 GPUs each)", f"{jobs} ({jobs * gpus} GPUs attributed), events applied in {jobs_s:.1f} s"),
            ("target messages/s", f"{nodes / period_s:.0f}"),
            ("published messages/s (confirmed)", f"{(published - published0) / window:.0f}"),
            ("ingested messages/s (committed)", f"{ingested / window:.0f}"),
            ("GPU samples/s stored", f"{ingested * gpus / window:.0f}"),
            ("mean batch (messages/transaction)", f"{ingested / batch_count:.0f}" if batch_count else "-"),
            ("lag occurred_at -> commit p50", f"{_quantile(0.5, before, after) * 1000:.0f} ms"),
            ("lag occurred_at -> commit p95", f"{_quantile(0.95, before, after) * 1000:.0f} ms"),
            ("telemetry CPU %", f"{cpu_pct:.0f} % (100 % = one core)"),
            ("telemetry RSS", f"{rss_mib:.0f} MiB"),
            ("queue depth at end of window", f"{depth}"),
            ("drain after producer stopped", f"{drain_s:.1f} s"),
            ("rows: gpu samples / job samples", f"{gpu_rows} / {job_rows}"),
            ("job evaluations during run", f"{final.get('gpuorch_telemetry_jobs_evaluated_total', 0):.0f} "
                                           f"(window {window_s:g} s, each running job every 60 s)"),
            ("full /metrics scrape (fleet leader)", f"{scrape_s:.2f} s, {series} series, "
                                                      f"{gpu_series} GPUs in DCGM_FI_DEV_GPU_UTIL"),
            ("scrapes every 15 s during the run", ", ".join(f"{t:.2f} s" for t in scrape_times) or "-"),
            ("measured window", f"{window:.0f} s after {warmup_s:g} s warm-up"),
        ]
        width = max(len(k) for k, _ in rows)
        print(f"\nbench_telemetry ({os.cpu_count()} CPUs on this machine)")
        print("-" * (width + 40))
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    finally:
        await broker.close()
        if child is not None:
            child.terminate()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
        _mgmt("DELETE", f"/api/vhosts/{vhost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--period-s", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=1000, help="8-GPU jobs placed on the first nodes")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=30.0,
                        help="detection window: short, so that job evaluations run during the measurement")
    args = parser.parse_args()
    asyncio.run(bench(args.nodes, args.gpus, args.period_s, args.jobs, args.warmup_s, args.duration_s,
                      args.window_s))


if __name__ == "__main__":
    main()
