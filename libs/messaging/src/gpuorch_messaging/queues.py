"""gpuorch's queues, in one catalogue: what each service consumes and what the setup step declares.

    service         queue                                   bound to (exchange: key)                        takes
    scheduler       scheduler.submit.<tenant>  (lane)       gpuorch.submit: job.submit.<t>, job.cancel.<t>  scheduler_accepts
                    scheduler.submit           (shared)     gpuorch.submit.shared (submit's alternate)
                    scheduler                               gpuorch.events: job facts .#, node facts
                    scheduler.heartbeats       (latest)     gpuorch.events: node/executor.heartbeat
    executor        executor.<node>                         gpuorch.commands: node.<node>.launch_job/stop_job executor_accepts
    node-agent      node-agent.<node> | node-agent.fleet.<fleet>  gpuorch.commands: node.<n>.apply_mig_layout  node_agent_accepts
    telemetry       telemetry.samples                       gpuorch.events: gpu.*, job.#, mig.plan_proposed  telemetry_accepts

Each service's entrypoint consumes its queues from here; ``Installation`` lists every queue of one deployment
(tenants from the identity map and quotas, the executors' and node-agents' nodes) for the setup step
(``gpuctl setup broker``) and for deploy/rabbitmq/make_definitions.py, so what is declared at install is exactly
what the services look up. ``consumer_of(queue)`` names the role and allow-list of a queue by its name (replays
of dead letters trust a dead letter's recorded publisher only when that role wrote it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    SUBMIT_EXCHANGE,
    SUBMIT_SHARED_EXCHANGE,
    ApplyMigLayout,
    LaunchJob,
    StopJob,
    event_binding,
    submit_routing_key,
)
from gpuorch_contracts.jobs import DEFAULT_TENANT
from gpuorch_contracts.routing import command_routing_key

from gpuorch_messaging.connection import BrokerConnection
from gpuorch_messaging.rejections import InvalidHook
from gpuorch_messaging.senders import (
    Accepts,
    executor_accepts,
    node_agent_accepts,
    scheduler_accepts,
    telemetry_accepts,
)
from gpuorch_messaging.topology import QueueSpec, declare_exchanges, declare_queue, unbind

SCHEDULER_QUEUE = "scheduler"
SUBMIT_QUEUE = "scheduler.submit"
HEARTBEAT_QUEUE = "scheduler.heartbeats"
TELEMETRY_QUEUE = "telemetry.samples"
SCHEDULER_DELIVERY_LIMIT = 50
"""Deliveries before a message of the scheduler's queues is dead-lettered. RabbitMQ counts every return of an
unacked message, and a leader that dies returns all of its prefetch: with 10, 20 PostgreSQL terminations under
1,000 submissions (12 scheduler restarts) dead-lettered 164 valid submissions. A message that fails on its own (the
Batcher retries a failed batch message by message) still reaches its dead-letter queue, after 50 tries alone."""
SCHEDULER_EVENTS = ("job.started", "job.finished", "job.failed", "job.lost", "job.checkpointed",
                    "node.registered", "gpu.health_changed", "node.mig_layout_applied")
TELEMETRY_BINDINGS = ((EVENTS_EXCHANGE, "gpu.usage_sampled"), (EVENTS_EXCHANGE, "gpu.health_changed"),
                      (EVENTS_EXCHANGE, "job.#"), (EVENTS_EXCHANGE, "mig.plan_proposed"))
DROPPED_BINDINGS = {SCHEDULER_QUEUE: ((SUBMIT_EXCHANGE, "job.submit"), (SUBMIT_EXCHANGE, "job.cancel"))}
"""Bindings older releases made and this one removes at install (submissions left ``scheduler`` for the lanes)."""


def scheduler_queues() -> tuple[QueueSpec, QueueSpec]:
    """The scheduler's event queue (single active consumer, bounded with ``reject-publish``: publishers are told)
    and its latest-wins heartbeat queue. Submissions arrive on ``submission_lanes``."""
    main = QueueSpec(
        SCHEDULER_QUEUE, [(EVENTS_EXCHANGE, event_binding(key)) for key in SCHEDULER_EVENTS],
        prefetch=1000, delivery_limit=SCHEDULER_DELIVERY_LIMIT, single_active_consumer=True,
        max_length=1_000_000, overflow="reject-publish", accepts=scheduler_accepts(),
    )
    heartbeats = QueueSpec(HEARTBEAT_QUEUE, [(EVENTS_EXCHANGE, "node.heartbeat"),
                                             (EVENTS_EXCHANGE, "executor.heartbeat")],
                           prefetch=500, max_length=20000, overflow="drop-head", delivery_limit=3,
                           accepts=scheduler_accepts(), acknowledged=False)
    return main, heartbeats


def submission_lanes(tenants: Iterable[str], on_invalid: InvalidHook | None = None) -> list[QueueSpec]:
    """The shared lane ``scheduler.submit`` (bound to ``gpuorch.submit``'s alternate exchange: plain
    ``job.submit``/``job.cancel`` and tenants without a lane) and one lane per tenant
    (``scheduler.submit.<tenant>``, bound to ``job.submit.<tenant>`` and ``job.cancel.<tenant>``), each bounded
    with ``reject-publish`` (a flooding publisher is told). ``on_invalid`` answers an identifiable invalid
    submission (``rejections.answer_invalid_submission``)."""

    def lane(name: str, bindings: list[tuple[str, str]]) -> QueueSpec:
        return QueueSpec(name, bindings, prefetch=1000, delivery_limit=SCHEDULER_DELIVERY_LIMIT,
                         single_active_consumer=True, max_length=200_000, overflow="reject-publish",
                         accepts=scheduler_accepts(), on_invalid=on_invalid)

    lanes = [lane(SUBMIT_QUEUE, [(SUBMIT_SHARED_EXCHANGE, "")])]
    for tenant in sorted(set(tenants) - {DEFAULT_TENANT, "*"}):
        lanes.append(lane(f"{SUBMIT_QUEUE}.{tenant}", [(SUBMIT_EXCHANGE, submit_routing_key(tenant)),
                                                         (SUBMIT_EXCHANGE, submit_routing_key(tenant, "job.cancel"))]))
    return lanes


def executor_queue(node_id: str) -> QueueSpec:
    return QueueSpec(
        name=f"executor.{node_id}",
        bindings=[(COMMANDS_EXCHANGE, command_routing_key(node_id, LaunchJob.TYPE)),
                  (COMMANDS_EXCHANGE, command_routing_key(node_id, StopJob.TYPE))],
        prefetch=16, accepts=executor_accepts(),
    )


def node_agent_queue(name: str, node_ids: Sequence[str]) -> QueueSpec:
    """``name``: ``node-agent.<node>`` for one node, ``node-agent.fleet.<fleet>`` for a simulated fleet."""
    bindings = [(COMMANDS_EXCHANGE, command_routing_key(n, ApplyMigLayout.TYPE)) for n in node_ids]
    return QueueSpec(name=name, bindings=bindings, prefetch=8, accepts=node_agent_accepts())


def telemetry_queue(prefetch: int = 1024) -> QueueSpec:
    """Competing consumers of every telemetry instance."""
    return QueueSpec(name=TELEMETRY_QUEUE, bindings=TELEMETRY_BINDINGS, prefetch=prefetch, delivery_limit=5,
                     accepts=telemetry_accepts())


def consumer_of(queue: str) -> tuple[str, Accepts] | None:
    """The role consuming a gpuorch queue and the queue's allow-list, by the queue's name; None for any other."""
    if queue == SCHEDULER_QUEUE or queue.startswith(SCHEDULER_QUEUE + "."):
        return "scheduler", scheduler_accepts()
    if queue.startswith("executor."):
        return "executor", executor_accepts()
    if queue.startswith("node-agent."):
        return "node-agent", node_agent_accepts()
    if queue == TELEMETRY_QUEUE:
        return "telemetry", telemetry_accepts()
    return None


@dataclass(frozen=True)
class Installation:
    """Every queue of one deployment: the tenants with a submission lane, the nodes with an executor queue, and
    the node-agent queues (name -> node ids)."""

    tenants: Sequence[str] = ()
    executor_nodes: Sequence[str] = ()
    node_agents: Sequence[tuple[str, Sequence[str]]] = field(default_factory=tuple)
    telemetry: bool = True

    def queues(self) -> list[QueueSpec]:
        specs = [*scheduler_queues(), *submission_lanes(self.tenants)]
        specs += [executor_queue(node) for node in dict.fromkeys(self.executor_nodes)]
        specs += [node_agent_queue(name, nodes) for name, nodes in self.node_agents]
        if self.telemetry:
            specs.append(telemetry_queue())
        return specs


async def install(amqp_url: str, installation: Installation,
                  on_declared: Callable[[str], None] | None = None, *, connect_timeout_s: float = 10.0) -> list[str]:
    """The setup step: declare the exchanges and every queue of ``installation`` with its dead-letter queue and
    bindings, and remove the bindings releases dropped; idempotent. ``amqp_url`` logs in as the setup identity
    (configure, write and read on gpuorch's names), retrying to reach the broker for ``connect_timeout_s``. Returns
    the queues declared; ``on_declared(name)`` after each (progress)."""
    link = BrokerConnection(amqp_url, "gpuorch-setup")
    await link.connect(timeout_s=connect_timeout_s)
    declared: list[str] = []
    try:
        channel = await link.channel()
        await declare_exchanges(channel)
        for spec in installation.queues():
            await declare_queue(channel, spec)
            declared.append(spec.name)
            if on_declared is not None:
                on_declared(spec.name)
        await channel.close()
        for queue, bindings in DROPPED_BINDINGS.items():
            await unbind(link, queue, bindings)
    finally:
        await link.close()
    return declared
