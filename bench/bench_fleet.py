"""Scale of the node agent's fleet mode: N simulated nodes heartbeating against the real local RabbitMQ.

    uv run python bench/bench_fleet.py                     # 5,000 nodes, heartbeat 10 s, 60 s measured
    uv run python bench/bench_fleet.py --nodes 500 --duration-s 20

What it does: makes a fresh RabbitMQ vhost (management API, like the test fixtures), declares bounded latest-wins
queues for ``node.heartbeat``, ``node.registered`` and ``gpu.#`` (x-max-length + drop-head: what the deployment's
topology does, so publishes are routable and nothing piles up), builds the fleet in this process (one NVML event
thread, one /proc scan per second), consumes the fleet's command queue (one binding per node), then runs for
``--duration-s`` after a warm-up of two heartbeat intervals and prints one table (also written to
``bench/results/fleet.md`` and ``fleet.json``):

- CPU %: psutil's CPU time of this process over the measured window (100 % = one core);
- RSS MiB: resident memory at the end;
- heartbeats/s: NodeHeartbeat messages confirmed by the broker per second over the window (expected: nodes/interval);
- publish lag p50/p99/max: confirm time minus the time the heartbeat was due (earliest due time of its batch;
  includes the scheduler tick of 0.1 s); batch confirm p50/p99: how long one batch's publish_many took.
Also: startup time (discovery of every node), time to declare the command queue's bindings, queue depth at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
from gpuorch_contracts import EVENTS_EXCHANGE
from gpuorch_messaging import Broker, QueueSpec
from gpuorch_node_agent.entrypoint import build_simulated_agents, command_queue, parse_config
from gpuorch_node_agent.fleet import FleetRunner
from gpuorch_node_agent.sim.profiles import parse_profile_mix

MGMT = os.environ.get("GPUORCH_TEST_AMQP_ADMIN", "http://guest:guest@127.0.0.1:15672")
AMQP = os.environ.get("GPUORCH_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672")


def _mgmt(method: str, path: str, body: dict[str, str] | None = None) -> httpx.Response:
    url = httpx.URL(MGMT)
    response = httpx.request(method, f"{url.scheme}://{url.host}:{url.port}{path}",
                             auth=(url.username or "guest", url.password or "guest"), timeout=30,
                             json=body if body is not None else ({} if method == "PUT" else None))
    response.raise_for_status()
    return response


async def bench(nodes: int, mix: str, heartbeat_s: float, usage_s: float, duration_s: float) -> dict[str, object]:
    """Run the fleet against a fresh vhost; returns the figures printed by ``main``."""
    vhost = f"gpuorch-bench-{uuid.uuid4().hex[:10]}"
    _mgmt("PUT", f"/api/vhosts/{vhost}")
    _mgmt("PUT", f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    url = f"{AMQP}/{vhost}"
    process = psutil.Process()
    try:
        broker = Broker(url, producer="node-agent/bench")
        await broker.connect()
        for name, key, length in (("bench.heartbeats", "node.heartbeat", nodes),
                                  ("bench.registrations", "node.registered", nodes),
                                  ("bench.gpu-events", "gpu.#", nodes)):
            await broker.declare_queue(QueueSpec(name=name, bindings=[(EVENTS_EXCHANGE, key)], max_length=length,
                                                 dead_letter=False))
        specs = parse_profile_mix(mix, prefix="bench")
        specs = (specs * (nodes // max(len(specs), 1) + 1))[:nodes]
        specs = [type(s)(f"bench-{i:05d}", s.gpu_profile, s.gpu_count, s.cpu_milli, s.memory_mib)
                 for i, s in enumerate(specs)]
        t0 = time.perf_counter()
        agents = build_simulated_agents(specs, seed=7, inventory_s=60.0)
        runner = FleetRunner(agents, broker, heartbeat_s=heartbeat_s, usage_s=usage_s, seed=7)
        config = parse_config(["--nvml", "sim", "--fleet-nodes", mix, "--fleet-name", "bench"], {})
        await broker.consume(command_queue(config, [a.node_id for a in agents]), _ignore)
        bindings_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        await runner.start()
        startup_s = time.perf_counter() - t1
        await asyncio.sleep(2 * heartbeat_s)  # warm-up: the start-up registrations are out, heartbeats steady
        hb0, reg0, usage0 = runner.stats.heartbeats, runner.stats.registrations, runner.stats.usage_samples
        runner.stats.lag_s.clear()
        runner.stats.confirm_s.clear()
        cpu0, wall0 = process.cpu_times(), time.perf_counter()
        await asyncio.sleep(duration_s)
        cpu1, wall1 = process.cpu_times(), time.perf_counter()
        window = wall1 - wall0
        stats = runner.stats
        lags = sorted(stats.lag_s)
        confirms = sorted(stats.confirm_s)
        depth = _mgmt("GET", f"/api/queues/{vhost}/bench.heartbeats").json().get("messages")
        await runner.stop()
        await broker.close()
        return {
            "nodes": nodes,
            "gpus": sum(s.gpu_count for s in specs),
            "heartbeat_s": heartbeat_s,
            "window_s": round(window, 1),
            "startup_s": round(startup_s, 1),
            "bindings_s": round(bindings_s, 1),
            "cpu_pct": round(100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / window, 1),
            "rss_mib": round(process.memory_info().rss / 2**20),
            "heartbeats_per_s": round((stats.heartbeats - hb0) / window, 1),
            "registrations": stats.registrations - reg0,
            "usage_per_s": round((stats.usage_samples - usage0) / window, 1),
            "lag_p50_ms": round(1000 * lags[len(lags) // 2], 1) if lags else None,
            "lag_p99_ms": round(1000 * lags[int(len(lags) * 0.99)], 1) if lags else None,
            "lag_max_ms": round(1000 * lags[-1], 1) if lags else None,
            "batch_confirm_p50_ms": round(1000 * confirms[len(confirms) // 2], 1) if confirms else None,
            "batch_confirm_p99_ms": round(1000 * confirms[int(len(confirms) * 0.99)], 1) if confirms else None,
            "publish_failures": stats.publish_failures,
            "heartbeat_queue_depth": depth,
        }
    finally:
        try:
            _mgmt("DELETE", f"/api/vhosts/{vhost}")
        except Exception:
            pass


async def _ignore(message: object) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--mix", default="h100x8:2,a100x8:1,l4x4:1,t4x4:1",
                        help="profile mix, repeated until --nodes nodes")
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--usage-s", type=float, default=60.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    args = parser.parse_args()
    result = asyncio.run(bench(args.nodes, args.mix, args.heartbeat_s, args.usage_s, args.duration_s))
    result["cpus_on_machine"] = os.cpu_count()
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    width = max(len(k) for k in result)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{key:<{width}}  {value}" for key, value in result.items()]
    table = "\n".join(lines)
    print(table)
    sys.stdout.flush()
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "fleet.md").write_text(f"# bench_fleet\n\n```\n{table}\n```\n")
    (results / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
