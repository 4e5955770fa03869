"""The least-privilege broker users of deploy/rabbitmq/make_definitions.py, against the real RabbitMQ.

Each test gets a fresh vhost (root conftest ``amqp_vhost``) and its own users (unique names, deleted afterwards),
loaded through the management API from the generator's grants, and the topology declared by the setup identity
(``gpuorch_messaging.queues.install``, what ``gpuctl setup broker`` runs). Allowed work goes through the real
``gpuorch_messaging.Broker`` as the services run it (``declare_topology=False``: names looked up, nothing
declared) with the services' own queue specs; refused work must close the channel with ACCESS_REFUSED (403).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aio_pika
import aiormq.exceptions
import pytest
from gpuorch_contracts import (
    AlertRaised,
    JobAccepted,
    JobSpec,
    JobStarted,
    LaunchJob,
    Message,
    NodeHeartbeat,
    SubmitJob,
)
from gpuorch_executor.entrypoint import executor_queue
from gpuorch_messaging import Broker, Installation, QueueSpec, TopologyMissing
from gpuorch_messaging.queues import install
from gpuorch_scheduler.entrypoint import scheduler_queues, submission_lanes
from gpuorch_scheduling.testing import registered_node
from gpuorch_telemetry.entrypoint import queue_spec as telemetry_queue

from conftest import AMQP_HOST, AMQP_PORT
from tests.deploy.broker_users import BrokerUsers, gen, management_api

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SPEC = JobSpec.model_validate({"name": "lp", "run": {"runtime": "process", "argv": ["python", "-c", "1"]}})


class Users(BrokerUsers):
    """The generator's users under unique names (role -> name) in one vhost."""

    def __init__(self, vhost: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.names = {role: f"{role}-{suffix}" for role in (
            "scheduler", "telemetry", "submitter", "gpuctl", "executor-1", "executor-2", "node-agent-1", "setup")}
        n = self.names
        super().__init__(vhost, [
            gen.setup(n["setup"]),
            gen.scheduler(n["scheduler"]), gen.telemetry(n["telemetry"]), gen.submitter(n["submitter"]),
            gen.operator(n["gpuctl"]), gen.executor(n["executor-1"], ["node-1"]),
            gen.executor(n["executor-2"], ["node-2"]),
            gen.node_agent(n["node-agent-1"], "node-agent.node-1", ["node-1"]),
        ])

    def url(self, role: str) -> str:  # type: ignore[override]
        return super().url(self.names[role])

    async def install(self) -> list[str]:
        """The setup step, as the setup user: the topology of this vhost's fleet (two executors, one node agent)."""
        return await install(self.url("setup"), INSTALLATION)


INSTALLATION = Installation(tenants=["acme", "research"], executor_nodes=["node-1", "node-2"],
                            node_agents=[("node-agent.node-1", ["node-1"])])


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[Users]:
    created = Users(amqp_vhost)
    created.create()
    try:
        yield created
    finally:
        created.delete()


class Inbox:
    """A handler that keeps what it got; ``wait_for(type)`` returns the first message of that type."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.seen: list[Message] = []

    async def __call__(self, message: Message) -> None:
        await self.messages.put(message)

    async def wait_for(self, message_type: str, timeout: float = 10) -> Message:
        for message in self.seen:
            if message_type == message.TYPE:
                return message
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                self.seen.append(message)
                if message_type == message.TYPE:
                    return message


@pytest.fixture
async def brokers() -> AsyncIterator[list[Broker]]:
    opened: list[Broker] = []
    yield opened
    for broker in opened:
        await broker.close()


async def connect(brokers: list[Broker], url: str, producer: str, *, declare: bool = False) -> Broker:
    """A Broker as a runtime service runs it: it looks its names up (the setup step declared them). Identity checks
    are off: the broker's permissions are the point here (tests/security and libs/messaging test identity)."""
    broker = Broker(url, producer=producer, publish_timeout_s=5, declare_topology=declare, topology_wait_s=5,
                    identity="trust_all")
    await broker.connect(timeout_s=5)
    brokers.append(broker)
    return broker


async def assert_refused(url: str, operation: Callable[[aio_pika.abc.AbstractChannel], Awaitable[Any]]) -> None:
    """``operation`` on a fresh channel must fail with ACCESS_REFUSED (the broker closes the channel)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await asyncio.wait_for(operation(channel), timeout=10)
    finally:
        await connection.close()


def publish(exchange: str, routing_key: str, body: bytes = b"{}") -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        target = await channel.get_exchange(exchange)  # passive declare: needs no permission
        return await target.publish(aio_pika.Message(body), routing_key)
    return run


async def _ignore(message: Any) -> None:
    pass


def consume(queue: str) -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        declared = await channel.declare_queue(queue, passive=True)
        return await declared.consume(_ignore)
    return run


def submit_body() -> bytes:
    return SubmitJob(spec=SPEC, producer="other-system").model_dump_json().encode()


async def test_each_service_user_does_its_services_work(users: Users, brokers: list[Broker]) -> None:
    await users.install()
    scheduler = await connect(brokers, users.url("scheduler"), "scheduler/lp")
    telemetry = await connect(brokers, users.url("telemetry"), "telemetry/lp")
    executor = await connect(brokers, users.url("executor-1"), "executor/node-1")
    node_agent = await connect(brokers, users.url("node-agent-1"), "node-agent/node-1")
    scheduler_inbox, heartbeats, samples, commands, mig = Inbox(), Inbox(), Inbox(), Inbox(), Inbox()
    main_queue, heartbeat_queue = scheduler_queues()
    for lane in submission_lanes(["acme", "research"]):
        await scheduler.consume(lane, scheduler_inbox)
    await scheduler.consume(main_queue, scheduler_inbox)
    await scheduler.consume(heartbeat_queue, heartbeats)
    await telemetry.consume(telemetry_queue(prefetch=16), samples)
    await executor.consume(executor_queue("node-1"), commands)
    await node_agent.consume(QueueSpec("node-agent.node-1", [("gpuorch.commands", "node.node-1.apply_mig_layout")]),
                             mig)

    # another system submits with plain aio-pika (no declarations), as examples/submit_job.py does
    connection = await aio_pika.connect(users.url("submitter"))
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(aio_pika.Message(submit_body(), content_type="application/json"), "job.submit",
                               mandatory=True)
        await exchange.publish(aio_pika.Message(b'{"type": "job.submit", "bogus": 1}'), "job.submit",
                               mandatory=True)
    finally:
        await connection.close()
    assert isinstance(await scheduler_inbox.wait_for("job.submit"), SubmitJob)

    await node_agent.publish(registered_node("node-1"))
    await node_agent.publish(NodeHeartbeat(node_id="node-1", inventory_hash="h", sequence=1))
    await scheduler_inbox.wait_for("node.registered")
    await heartbeats.wait_for("node.heartbeat")

    job_id, placement_id = uuid.uuid4(), uuid.uuid4()
    await scheduler.publish(JobAccepted(job_id=job_id, spec=SPEC))
    await scheduler.publish(LaunchJob(node_id="node-1", job_id=job_id, placement_id=placement_id, spec=SPEC))
    assert (await commands.wait_for("launch_job")).job_id == job_id  # type: ignore[attr-defined]
    await samples.wait_for("job.accepted")

    await executor.publish(JobStarted(job_id=job_id, placement_id=placement_id, node_id="node-1", pid=1))
    await scheduler_inbox.wait_for("job.started")
    await samples.wait_for("job.started")
    await telemetry.publish(AlertRaised(alert_id=uuid.uuid4(), kind="idle", node_id="node-1", explanation="idle"))

    gpuctl = await connect(brokers, users.url("gpuctl"), "gpuctl")
    await gpuctl.publish(SubmitJob(spec=SPEC))
    await assert_refused(users.url("gpuctl"), consume("scheduler"))

    # the malformed submission was dead-lettered by the scheduler user; gpuctl's user can read the DLQ
    connection = await aio_pika.connect(users.url("gpuctl"))
    try:
        channel = await connection.channel()
        dlq = await channel.declare_queue("scheduler.submit.dlq", passive=True)  # the shared lane
        dead = None
        async with asyncio.timeout(10):
            while dead is None:
                dead = await dlq.get(no_ack=True, fail=False)
                if dead is None:
                    await asyncio.sleep(0.05)
        assert "invalid message" in str((dead.headers or {}).get("x-gpuorch-dead-letter-reason"))
    finally:
        await connection.close()


FIRST_QUEUES = {
    "scheduler": lambda: scheduler_queues()[0],
    "telemetry": lambda: telemetry_queue(),
    "executor-1": lambda: executor_queue("node-1"),
    "node-agent-1": lambda: QueueSpec("node-agent.node-1", [("gpuorch.commands", "node.node-1.apply_mig_layout")]),
}


@pytest.mark.parametrize("role", sorted(FIRST_QUEUES))
async def test_a_service_user_declares_nothing_and_waits_for_the_setup_step(
    role: str, users: Users, brokers: list[Broker]
) -> None:
    """On an empty vhost a runtime user may not declare the topology (no configure right), and a service that
    looks its names up waits for them: once the setup identity declared them, it consumes."""
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await connect(brokers, users.url(role), role, declare=True)
    broker = Broker(users.url(role), producer=role, publish_timeout_s=5, declare_topology=False, topology_wait_s=30)
    brokers.append(broker)
    starting = asyncio.ensure_future(_start(broker, FIRST_QUEUES[role]()))
    await asyncio.sleep(0.5)
    assert not starting.done()  # waiting for the setup step, not failing
    await users.install()
    await asyncio.wait_for(starting, timeout=30)
    late = Broker(users.url(role), producer=role, declare_topology=False, topology_wait_s=0.5)
    brokers.append(late)
    await late.connect(timeout_s=5)
    with pytest.raises(TopologyMissing, match="gpuctl setup broker"):
        await late.consume(QueueSpec("never-declared", []), _ignore)


async def _start(broker: Broker, spec: QueueSpec) -> None:
    await broker.connect(timeout_s=5)
    await broker.consume(spec, _ignore)


async def test_submitter_may_only_publish_submit_cancel_and_array_set(users: Users, brokers: list[Broker]) -> None:
    await users.install()
    url = users.url("submitter")

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(aio_pika.Message(submit_body()), "job.submit", mandatory=True)
        cancel = {"type": "job.cancel", "job_id": str(uuid.uuid4())}
        await exchange.publish(aio_pika.Message(json.dumps(cancel).encode()), "job.cancel", mandatory=True)
        steer = {"type": "job.array_set", "job_id": str(uuid.uuid4()), "parallelism": 2}
        await exchange.publish(aio_pika.Message(json.dumps(steer).encode()), "job.array_set", mandatory=True)
    finally:
        await connection.close()

    await assert_refused(url, publish("gpuorch.submit", "job.submit.acme", submit_body()))  # another tenant's lane
    await assert_refused(url, publish("gpuorch.submit", "job.accepted", submit_body()))
    await assert_refused(url, publish("gpuorch.submit", "node.node-1.launch_job"))
    await assert_refused(url, publish("gpuorch.events", "job.accepted"))
    await assert_refused(url, publish("gpuorch.commands", "node.node-1.launch_job"))
    await assert_refused(url, publish("gpuorch.dlx", "scheduler"))
    await assert_refused(url, consume("scheduler"))
    await assert_refused(url, consume("executor.node-1"))
    await assert_refused(url, consume("gpuorch.unrouted"))
    await assert_refused(url, lambda channel: channel.declare_queue("submitter-own", durable=True))
    await assert_refused(url, lambda channel: channel.declare_exchange("gpuorch.submit", "topic", durable=True))
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await connect(brokers, url, "submitter", declare=True)  # declaring the topology is not for submitters


async def test_executor_of_one_node_cannot_touch_another_nodes_queue(users: Users, brokers: list[Broker]) -> None:
    await users.install()
    other = await connect(brokers, users.url("executor-2"), "executor/node-2")
    await other.consume(executor_queue("node-2"), Inbox())
    url = users.url("executor-1")

    await assert_refused(url, consume("executor.node-2"))
    await assert_refused(url, lambda channel: channel.declare_queue(
        "executor.node-2", durable=True, arguments=executor_queue("node-2").arguments()))
    await assert_refused(url, consume("executor.node-2.dlq"))

    async def bind_own_queue_to_node_2(channel: Any) -> None:
        queue = await channel.declare_queue("executor.node-1", durable=True,
                                            arguments=executor_queue("node-1").arguments())
        await queue.bind("gpuorch.commands", "node.node-2.launch_job")
    await assert_refused(url, bind_own_queue_to_node_2)

    await assert_refused(url, publish("gpuorch.commands", "node.node-2.launch_job"))
    await assert_refused(url, publish("gpuorch.events", "job.placed"))
    await assert_refused(url, publish("gpuorch.submit", "job.submit", submit_body()))
    await assert_refused(url, publish("gpuorch.dlx", "executor.node-2"))


async def test_other_services_stay_in_their_lanes(users: Users, brokers: list[Broker]) -> None:
    await users.install()

    telemetry, node_agent, scheduler_url = users.url("telemetry"), users.url("node-agent-1"), users.url("scheduler")
    await assert_refused(telemetry, publish("gpuorch.events", "job.placed"))
    await assert_refused(telemetry, publish("gpuorch.commands", "node.node-1.launch_job"))
    await assert_refused(telemetry, consume("scheduler"))
    await assert_refused(node_agent, publish("gpuorch.events", "job.started"))
    await assert_refused(node_agent, consume("scheduler.heartbeats"))
    await assert_refused(scheduler_url, publish("gpuorch.events", "job.started"))  # the executor's word
    await assert_refused(scheduler_url, publish("gpuorch.events", "gpu.usage_sampled"))  # the node-agent's word
    await assert_refused(scheduler_url, consume("telemetry.samples"))


async def test_definitions_document_imports_and_its_password_hashes_log_in(amqp_vhost: str) -> None:
    """The document format (users with salted SHA-256 hashes, tags, topic_permissions) is what RabbitMQ imports."""
    suffix = uuid.uuid4().hex[:8]
    grants = [gen.submitter(f"submitter-{suffix}"), gen.administrator(f"admin-{suffix}")]
    document = gen.definitions(grants, amqp_vhost)
    document["vhosts"] = []  # the fixture made it
    with management_api() as api:
        try:
            api.post("/api/definitions", json=document).raise_for_status()
            v = quote(amqp_vhost, safe="")
            topics = api.get(f"/api/topic-permissions/{v}/submitter-{suffix}").raise_for_status().json()
            assert sorted((t["exchange"], t["write"]) for t in topics) == [
                ("gpuorch.events", "^$"), ("gpuorch.submit", "^job\\.(submit|cancel|array_set|session)(\\.(default))?$")]
            assert api.get(f"/api/users/admin-{suffix}").json()["tags"] in (["administrator"], "administrator")
            name = f"submitter-{suffix}"
            connection = await aio_pika.connect(
                f"amqp://{name}:{gen.dev_password(name)}@{AMQP_HOST}:{AMQP_PORT}/{v}")
            await connection.close()
            with pytest.raises(aio_pika.exceptions.ProbableAuthenticationError):
                await aio_pika.connect(f"amqp://{name}:wrong@{AMQP_HOST}:{AMQP_PORT}/{v}")
        finally:
            for grant in grants:
                api.delete(f"/api/users/{grant.user}")


def test_committed_definitions_match_the_generator() -> None:
    committed = json.loads((DEPLOY / "rabbitmq" / "definitions.json").read_text())
    assert committed == gen.definitions(gen.grants(), install=gen.installation())


def test_every_regex_compiles_and_admits_only_the_named_queues() -> None:
    import re

    executor = gen.executor("e", ["node-1"])
    assert re.search(executor.read, "executor.node-1")
    for name in ("executor.node-10", "executor.node-2", "xexecutor.node-1", "executor.node-1.dlq", "scheduler"):
        assert not re.search(executor.read, name), name
    for grant in gen.grants():
        for regex in (grant.configure, grant.write, grant.read, *(r for pair in grant.topics.values() for r in pair)):
            re.compile(regex)
