"""CPU the node agent spends per heartbeat, in process: a simulated fleet (``FleetRunner`` over ``h100x8`` nodes,
the code ``gpuorch-node-agent`` runs) heartbeating for a while; the process's CPU time over the window divided by the
heartbeats sent. Prints CPU-seconds per 10,000 heartbeats.

    uv run python bench/bench_heartbeat_cpu.py                      # 1,000 nodes, time x5 (500 heartbeats/s)
    uv run python bench/bench_heartbeat_cpu.py --publisher null     # no broker: producing the messages only
    uv run python bench/bench_heartbeat_cpu.py --runs 5 --json

Time is compressed by ``--speed`` (heartbeat 10 s, inventory refresh 60 s, usage sample 60 s, all divided by it), so
1,000 nodes at x5 send what 5,000 nodes send at x1 (500 heartbeats/s), in ticks of the same size. Usage samples are
off unless ``--usage``: the figure is the heartbeat's. ``--publisher broker`` publishes to the local RabbitMQ (a fresh
vhost with bounded latest-wins queues, as ``bench_fleet.py``), confirms awaited; ``null`` drops every batch (what
producing the messages costs). CPU is ``time.process_time`` (every thread of the process: the NVML event thread
included); the first two heartbeat intervals are warm-up. Compare two commits by running this file with each one's
environment, interleaved (``/path/to/other/.venv/bin/python bench/bench_heartbeat_cpu.py``): the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterable
from typing import Any

import httpx
from gpuorch_contracts import EVENTS_EXCHANGE, Message
from gpuorch_node_agent.entrypoint import build_simulated_agents
from gpuorch_node_agent.fleet import FleetRunner
from gpuorch_node_agent.sim.profiles import NodeSpec, parse_node_profile

MGMT = os.environ.get("GPUORCH_TEST_AMQP_ADMIN", "http://guest:guest@127.0.0.1:15672")
AMQP = os.environ.get("GPUORCH_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672")


class NullPublisher:
    async def publish(self, message: Message, *, headers: Any = None) -> None:
        return None

    async def publish_many(self, messages: Iterable[Message]) -> None:
        return None


def _mgmt(method: str, path: str, body: dict[str, str] | None = None) -> None:
    url = httpx.URL(MGMT)
    httpx.request(method, f"{url.scheme}://{url.host}:{url.port}{path}", timeout=30,
                  auth=(url.username or "guest", url.password or "guest"),
                  json=body if body is not None else ({} if method == "PUT" else None)).raise_for_status()


async def one_run(nodes: int, speed: float, heartbeats: int, publisher_kind: str, usage: bool) -> dict[str, float]:
    heartbeat_s, refresh_s = 10.0 / speed, 60.0 / speed
    usage_s = 60.0 / speed if usage else 1e9
    profile, count = parse_node_profile("h100x8")
    specs = [NodeSpec(f"hb-{i:05d}", profile, count, cpu_milli=128_000, memory_mib=1_048_576) for i in range(nodes)]
    agents = build_simulated_agents(specs, seed=7, inventory_s=refresh_s)
    vhost = None
    broker: Any = None
    if publisher_kind == "broker":
        from gpuorch_messaging import Broker, QueueSpec

        vhost = f"gpuorch-bench-{uuid.uuid4().hex[:10]}"
        _mgmt("PUT", f"/api/vhosts/{vhost}")
        _mgmt("PUT", f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        broker = Broker(f"{AMQP}/{vhost}", producer="node-agent/bench")
        await broker.connect()
        for name, key in (("bench.heartbeats", "node.heartbeat"), ("bench.registrations", "node.registered"),
                          ("bench.gpu-events", "gpu.#")):
            await broker.declare_queue(QueueSpec(name=name, bindings=[(EVENTS_EXCHANGE, key)], max_length=nodes,
                                                 dead_letter=False))
        publisher: Any = broker
    else:
        publisher = NullPublisher()
    runner = FleetRunner(agents, publisher, heartbeat_s=heartbeat_s, usage_s=usage_s, seed=7)
    try:
        await runner.start()
        await asyncio.sleep(2 * heartbeat_s)
        hb0, cpu0, wall0 = runner.stats.heartbeats, time.process_time(), time.perf_counter()
        while runner.stats.heartbeats - hb0 < heartbeats:
            await asyncio.sleep(0.05)
        hb1, cpu1, wall1 = runner.stats.heartbeats, time.process_time(), time.perf_counter()
        await runner.stop()
        sent = hb1 - hb0
        return {"heartbeats": sent, "cpu_s_per_10k": round((cpu1 - cpu0) * 10_000 / sent, 3),
                "heartbeats_per_s": round(sent / (wall1 - wall0), 1),
                "cpu_pct": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 1),
                "publish_failures": runner.stats.publish_failures}
    finally:
        if broker is not None:
            await broker.close()
        if vhost is not None:
            try:
                _mgmt("DELETE", f"/api/vhosts/{vhost}")
            except Exception:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--speed", type=float, default=5.0, help="time compression (heartbeat 10 s / speed)")
    parser.add_argument("--heartbeats", type=int, default=10_000, help="heartbeats measured per run")
    parser.add_argument("--publisher", choices=("broker", "null"), default="broker")
    parser.add_argument("--usage", action="store_true", help="send usage samples too (every 60 s / speed)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = [asyncio.run(one_run(args.nodes, args.speed, args.heartbeats, args.publisher, args.usage))
            for _ in range(args.runs)]
    result = {"nodes": args.nodes, "speed": args.speed, "publisher": args.publisher, "runs": runs,
              "median_cpu_s_per_10k": statistics.median(r["cpu_s_per_10k"] for r in runs)}
    if args.json:
        print(json.dumps(result))
    else:
        for r in runs:
            print(f"{r['heartbeats']} heartbeats  {r['cpu_s_per_10k']:.3f} CPU-s per 10k  {r['cpu_pct']} % CPU  "
                  f"{r['heartbeats_per_s']}/s  failures {r['publish_failures']}")
        print(f"median CPU-s per 10,000 heartbeats: {result['median_cpu_s_per_10k']:.3f}")


if __name__ == "__main__":
    main()
