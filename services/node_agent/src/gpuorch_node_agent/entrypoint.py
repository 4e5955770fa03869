"""``gpuorch-node-agent``: configuration, NVML choice (real or simulated), broker wiring.

Every setting has an environment variable (``AgentConfig``, ``gpuorch_settings``: also a key of the optional
``--config`` file); a command-line flag overrides it (``--help`` lists both).
Single node: NVML is the real ``pynvml`` (``--nvml real``) or one simulated node (``--nvml sim``).
Fleet: ``--fleet-nodes h100x8:2,a100x8:1`` or ``--fleet-csv nodes.csv`` runs many simulated nodes in this process.

Commands (``gpuorch_messaging.node_agent_queue``; declared at install, or here with
``GPUORCH_BROKER_TOPOLOGY=declare``): a single node consumes queue ``node-agent.<node id>`` bound to ``gpuorch.commands`` with
``node.<node id>.apply_mig_layout``. A fleet consumes one queue ``node-agent.fleet.<fleet name>`` bound once per
node (``node.<node id>.apply_mig_layout``), not ``node.*.apply_mig_layout``: a command for a node no process runs
stays unroutable (the scheduler's ``mandatory`` publish fails loudly) and two fleets never see each other's
commands.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from gpuorch_contracts import Message, encode
from gpuorch_messaging.settings import BrokerSettings
from gpuorch_observability import configure, get_logger
from gpuorch_settings import load_or_exit, setting, variable_of

from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.fleet import FleetRunner, publish_batch
from gpuorch_node_agent.handlers import handlers
from gpuorch_node_agent.sim.nvml import EventHub, SimulatedNvml
from gpuorch_node_agent.sim.processes import ProcessTable
from gpuorch_node_agent.sim.profiles import NodeSpec, parse_node_csv, parse_node_profile, parse_profile_mix

log = get_logger(__name__)

class AgentConfig(BrokerSettings):
    """The node agent's settings (``gpuorch_settings``); each has a command-line flag too, which wins."""

    amqp_url: str = setting("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL")
    node_id: str = setting("GPUORCH_NODE_ID", description="node id (default: host name); fleet node ids are "
                           "<fleet name>-NNNNN", default_factory=socket.gethostname, min_length=1)
    nvml: Literal["real", "sim"] = setting("GPUORCH_NVML", "real", "real (nvidia-ml-py) or sim (simulated NVML)")
    sim_profile: str = setting("GPUORCH_SIM_PROFILE", "h100x8", "simulated node: <gpu profile>x<count>, e.g. "
                               "a100x8, l4x4")
    sim_seed: int = setting("GPUORCH_SIM_SEED", 0, "seed of the simulation (usage defaults, phases, jitter)")
    heartbeat_s: float = setting("GPUORCH_HEARTBEAT_S", 10.0, "seconds between heartbeats of one node", gt=0)
    usage_s: float = setting("GPUORCH_USAGE_S", 60.0, "seconds between GpuUsageSampled of one node", gt=0)
    inventory_s: float = setting("GPUORCH_INVENTORY_S", 60.0, "seconds between full rediscoveries of one node",
                                 gt=0)
    fleet_nodes: str | None = setting("GPUORCH_FLEET_NODES", None, "fleet from a profile mix, e.g. "
                                      "h100x8:2,a100x8:1,l4x4:2")
    fleet_csv: str | None = setting("GPUORCH_FLEET_CSV", None, "fleet from an openb node list CSV "
                                    "(sn,cpu_milli,memory_mib,gpu,model)")
    fleet_name: str = setting("GPUORCH_FLEET_NAME", "sim", "name of this fleet (queue and node id prefix)")
    metrics_port: int = setting("GPUORCH_METRICS_PORT", 0, "port of /metrics, /healthz and /readyz (0: off)",
                                ge=0, le=65535)
    stdout: bool = setting("GPUORCH_NODE_AGENT_STDOUT", False, "print messages as JSON lines instead of "
                           "publishing")
    duration_s: float | None = setting("GPUORCH_NODE_AGENT_DURATION_S", None, "stop after this many seconds", gt=0)
    state_dir: Path = setting("GPUORCH_NODE_AGENT_STATE_DIR", Path("./var/node-agent"), "state root; each node "
                              "keeps <root>/<node id>/leader_epoch.json (the newest scheduler leader epoch seen)")

    @property
    def is_fleet(self) -> bool:
        return bool(self.fleet_nodes or self.fleet_csv)


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Settings from the environment (``environ``, default the process's) and ``--config``, each overridden by
    its flag (``--heartbeat-s 2``); exits 2 naming each invalid setting."""
    parser = argparse.ArgumentParser()
    flags: dict[str, str] = {}
    for name, info in AgentConfig.model_fields.items():
        variable = variable_of(info, name)
        flags[name] = variable
        if info.annotation is bool:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_const", const="1",
                                default=None, help=f"{info.description} [${variable}]")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                                help=f"{info.description} [${variable}]")
    args, _ = parser.parse_known_args(list(argv) if argv is not None else sys.argv[1:])
    env = dict(os.environ if environ is None else environ)
    env.update({flags[name]: value for name, value in vars(args).items() if name in flags and value is not None})
    config, _ = load_or_exit(AgentConfig, argv, prog="gpuorch-node-agent", env=env, parser=parser,
                             description="gpuorch node agent: GPU discovery, health, heartbeats, MIG.")
    return config


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
                                hostname=spec.node_id, labels={"gpuorch.io/simulated": "true", **spec.labels},
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
    from gpuorch_messaging import node_agent_queue

    name = f"node-agent.fleet.{config.fleet_name}" if config.is_fleet else f"node-agent.{config.node_id}"
    return node_agent_queue(name, node_ids)


async def run(config: AgentConfig, *, freeze_gc: bool = False) -> FleetRunner:
    """Run the agents of ``config`` until ``duration_s`` or a signal. ``freeze_gc`` (the process's own entry point):
    once the agents have started, what is loaded is moved out of the garbage collector's reach."""
    agents = build_agents(config)
    broker = None
    if config.stdout:
        publisher: Any = JsonLinesPublisher()
    else:
        from gpuorch_messaging import Broker, dispatch

        producer = f"node-agent/{config.fleet_name if config.is_fleet else config.node_id}"
        broker = Broker(config.amqp_url, producer=producer, **config.broker_options())
        await broker.connect(timeout_s=None)  # a broker down at start is waited for (broker.unreachable logged)
        publisher = broker
    runner = FleetRunner(agents, publisher, heartbeat_s=config.heartbeat_s, usage_s=config.usage_s,
                         seed=config.sim_seed)
    if config.metrics_port:
        from gpuorch_observability import start_metrics_server

        from gpuorch_node_agent.metrics import register

        register(runner)
        start_metrics_server(config.metrics_port)
    gauges: asyncio.Task[None] | None = None
    if broker is not None:  # bind before heartbeats start: 5,000 bindings take a while
        from gpuorch_messaging.bounded_gauges import keep_bounded_queue_gauges

        registry = handlers(runner.by_node_id, runner.publish_now, config.state_dir)
        spec = command_queue(config, [a.node_id for a in agents])
        await broker.consume(spec, lambda message: dispatch(registry, message, service="node-agent"))
        if spec.dead_letter:  # its dead-letter queue's fullness (decision 42)
            gauges = asyncio.create_task(keep_bounded_queue_gauges(
                broker, {spec.dead_letter_queue: spec.dead_letter_max_length}))
        from gpuorch_observability import READINESS, connected

        READINESS.add("broker", connected(broker))
        READINESS.mark("consuming", None)
    await runner.start()
    if freeze_gc:  # the agents, their inventories and the broker's objects live as long as the process: no later
        gc.collect()  # collection traverses them (a 5,000-node fleet spent a third of its CPU in full collections)
        gc.freeze()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(runner.stop()))
    log.info("node_agent.started", nodes=len(agents), gpus=sum(len(a.handles) for a in agents),
             nvml=config.nvml, heartbeat_s=config.heartbeat_s)
    try:
        await runner.run(config.duration_s)
    finally:
        if gauges is not None:
            gauges.cancel()
        if broker is not None:
            await broker.close()
        if isinstance(publisher, JsonLinesPublisher):
            await publish_batch(publisher, [])
    return runner


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    configure("node-agent", log_level=config.log_level, otlp_endpoint=config.otlp_endpoint,
              instance=config.fleet_name if config.is_fleet else config.node_id)
    asyncio.run(run(config, freeze_gc=True))


if __name__ == "__main__":
    main()
