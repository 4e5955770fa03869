"""``gpuorch-node-agent``: configuration, NVML choice (real or simulated), broker wiring.

Every option has an environment variable; a command-line flag overrides it (``--help`` lists both).
Single node: NVML is the real ``pynvml`` (``--nvml real``) or one simulated node (``--nvml sim``).
Fleet: ``--fleet-nodes h100x8:2,a100x8:1`` or ``--fleet-csv nodes.csv`` runs many simulated nodes in this process.

Commands: a single node consumes queue ``node-agent.<node id>`` bound to ``gpuorch.commands`` with
``node.<node id>.apply_mig_layout``. A fleet consumes one queue ``node-agent.fleet.<fleet name>`` bound once per
node (``node.<node id>.apply_mig_layout``), not ``node.*.apply_mig_layout``: a command for a node no process runs
stays unroutable (the scheduler's ``mandatory`` publish fails loudly) and two fleets never see each other's
commands.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuorch_contracts import COMMANDS_EXCHANGE, ApplyMigLayout, Message, encode
from gpuorch_contracts.routing import command_routing_key
from gpuorch_observability import configure, get_logger

from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.fleet import FleetRunner, publish_batch
from gpuorch_node_agent.handlers import handlers
from gpuorch_node_agent.sim.nvml import EventHub, SimulatedNvml
from gpuorch_node_agent.sim.processes import ProcessTable
from gpuorch_node_agent.sim.profiles import NodeSpec, parse_node_csv, parse_node_profile, parse_profile_mix

log = get_logger(__name__)

ENVIRONMENT = (
    ("amqp_url", "GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL"),
    ("node_id", "GPUORCH_NODE_ID", None, "node id (default: host name); fleet node ids are <fleet name>-NNNNN"),
    ("nvml", "GPUORCH_NVML", "real", "real (nvidia-ml-py) or sim (simulated NVML)"),
    ("sim_profile", "GPUORCH_SIM_PROFILE", "h100x8", "simulated node: <gpu profile>x<count>, e.g. a100x8, l4x4"),
    ("sim_seed", "GPUORCH_SIM_SEED", "0", "seed of the simulation (usage defaults, phases, jitter)"),
    ("heartbeat_s", "GPUORCH_HEARTBEAT_S", "10", "seconds between heartbeats of one node"),
    ("usage_s", "GPUORCH_USAGE_S", "60", "seconds between GpuUsageSampled of one node"),
    ("inventory_s", "GPUORCH_INVENTORY_S", "60", "seconds between full rediscoveries of one node"),
    ("fleet_nodes", "GPUORCH_FLEET_NODES", None, "fleet from a profile mix, e.g. h100x8:2,a100x8:1,l4x4:2"),
    ("fleet_csv", "GPUORCH_FLEET_CSV", None, "fleet from an openb node list CSV (sn,cpu_milli,memory_mib,gpu,model)"),
    ("fleet_name", "GPUORCH_FLEET_NAME", "sim", "name of this fleet (queue and node id prefix)"),
    ("log_level", "GPUORCH_LOG_LEVEL", "INFO", "log level"),
    ("otlp_endpoint", "GPUORCH_OTLP_ENDPOINT", None, "OTLP/HTTP endpoint for traces (none: not exported)"),
    ("metrics_port", "GPUORCH_METRICS_PORT", "0", "Prometheus /metrics port (0: off)"),
)


@dataclass(frozen=True)
class AgentConfig:
    amqp_url: str
    node_id: str
    nvml: str
    sim_profile: str
    sim_seed: int
    heartbeat_s: float
    usage_s: float
    inventory_s: float
    fleet_nodes: str | None
    fleet_csv: str | None
    fleet_name: str
    log_level: str
    otlp_endpoint: str | None
    metrics_port: int = 0
    stdout: bool = False
    duration_s: float | None = None

    @property
    def is_fleet(self) -> bool:
        return bool(self.fleet_nodes or self.fleet_csv)


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if environ is None else environ
    epilog = "environment variables (a flag overrides its variable):\n" + "\n".join(
        f"  {var:<24} --{name.replace('_', '-'):<16} {help_text}" for name, var, _, help_text in ENVIRONMENT)
    parser = argparse.ArgumentParser(
        prog="gpuorch-node-agent", description="gpuorch node agent: GPU discovery, health, heartbeats, MIG.",
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, var, default, help_text in ENVIRONMENT:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=env.get(var, default),
                            help=f"{help_text} [${var}]")
    parser.add_argument("--stdout", action="store_true", help="print messages as JSON lines instead of publishing")
    parser.add_argument("--duration-s", type=float, default=None, help="stop after this many seconds")
    args = parser.parse_args(argv)
    if args.nvml not in ("real", "sim"):
        parser.error("--nvml must be real or sim")
    return AgentConfig(
        amqp_url=args.amqp_url, node_id=args.node_id or socket.gethostname(), nvml=args.nvml,
        sim_profile=args.sim_profile, sim_seed=int(args.sim_seed), heartbeat_s=float(args.heartbeat_s),
        usage_s=float(args.usage_s), inventory_s=float(args.inventory_s), fleet_nodes=args.fleet_nodes,
        fleet_csv=args.fleet_csv, fleet_name=args.fleet_name, log_level=args.log_level,
        otlp_endpoint=args.otlp_endpoint, metrics_port=int(args.metrics_port), stdout=args.stdout,
        duration_s=args.duration_s,
    )


def node_specs(config: AgentConfig) -> list[NodeSpec]:
    if config.fleet_csv:
        with open(config.fleet_csv, encoding="utf-8") as fh:
            return parse_node_csv(fh.read())
    if config.fleet_nodes:
        return parse_profile_mix(config.fleet_nodes, prefix=config.fleet_name)
    profile, count = parse_node_profile(config.sim_profile)
    return [NodeSpec(config.node_id, profile, count, cpu_milli=max(count, 1) * 16000,
                     memory_mib=max(count, 1) * 128 * 1024)]


def build_simulated_agents(specs: Iterable[NodeSpec], *, seed: int, inventory_s: float,
                           processes: ProcessTable | None = None) -> list[NodeAgent]:
    """Simulated nodes sharing one process table and one event hub (one /proc scan, one event thread)."""
    processes = processes or ProcessTable()
    hub = EventHub()
    agents = []
    for spec in specs:
        nvml = SimulatedNvml(spec.node_id, spec.gpu_profile, spec.gpu_count, seed=seed, processes=processes,
                             events=hub)
        agents.append(NodeAgent(spec.node_id, nvml, cpu_milli=spec.cpu_milli, memory_mib=spec.memory_mib,
                                hostname=spec.node_id, labels={"gpuorch.io/simulated": "true"},
                                inventory_refresh_s=inventory_s))
    return agents


def build_real_agent(config: AgentConfig) -> NodeAgent:
    import pynvml

    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    return NodeAgent(config.node_id, pynvml, cpu_milli=(os.cpu_count() or 1) * 1000, memory_mib=memory_mib,
                     hostname=socket.gethostname(), inventory_refresh_s=config.inventory_s)


def build_agents(config: AgentConfig) -> list[NodeAgent]:
    if config.nvml == "real" and not config.is_fleet:
        return [build_real_agent(config)]
    return build_simulated_agents(node_specs(config), seed=config.sim_seed, inventory_s=config.inventory_s)


class JsonLinesPublisher:
    """Prints each message as one JSON line (``--stdout``): for trying the agent without a broker."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout

    async def publish(self, message: Message, *, headers: Any = None) -> None:
        self.stream.write(encode(message).decode() + "\n")

    async def publish_many(self, messages: Iterable[Message]) -> None:
        for message in messages:
            await self.publish(message)
        self.stream.flush()


def command_queue(config: AgentConfig, node_ids: Sequence[str]) -> Any:
    from gpuorch_messaging import QueueSpec, node_agent_accepts

    bindings = [(COMMANDS_EXCHANGE, command_routing_key(n, ApplyMigLayout.TYPE)) for n in node_ids]
    name = f"node-agent.fleet.{config.fleet_name}" if config.is_fleet else f"node-agent.{config.node_id}"
    return QueueSpec(name=name, bindings=bindings, prefetch=8, accepts=node_agent_accepts())


async def run(config: AgentConfig) -> FleetRunner:
    agents = build_agents(config)
    broker = None
    if config.stdout:
        publisher: Any = JsonLinesPublisher()
    else:
        from gpuorch_messaging import Broker, dispatch

        producer = f"node-agent/{config.fleet_name if config.is_fleet else config.node_id}"
        broker = Broker(config.amqp_url, producer=producer)
        await broker.connect()
        publisher = broker
    runner = FleetRunner(agents, publisher, heartbeat_s=config.heartbeat_s, usage_s=config.usage_s,
                         seed=config.sim_seed)
    if config.metrics_port:
        from gpuorch_observability import start_metrics_server

        from gpuorch_node_agent.metrics import register

        register(runner)
        start_metrics_server(config.metrics_port)
    if broker is not None:  # bind before heartbeats start: 5,000 bindings take a while
        registry = handlers(runner.by_node_id, runner.publish_now)
        await broker.consume(command_queue(config, [a.node_id for a in agents]),
                             lambda message: dispatch(registry, message, service="node-agent"))
        from gpuorch_observability import READINESS, connected

        READINESS.add("broker", connected(broker))
        READINESS.mark("consuming", None)
    await runner.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(runner.stop()))
    log.info("node_agent.started", nodes=len(agents), gpus=sum(len(a.handles) for a in agents),
             nvml=config.nvml, heartbeat_s=config.heartbeat_s)
    try:
        await runner.run(config.duration_s)
    finally:
        if broker is not None:
            await broker.close()
        if isinstance(publisher, JsonLinesPublisher):
            await publish_batch(publisher, [])
    return runner


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    configure("node-agent", log_level=config.log_level, otlp_endpoint=config.otlp_endpoint)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
