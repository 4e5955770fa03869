"""Identity on the wire against the real RabbitMQ: user_id on every publish, per-queue allow-lists of types and
senders, dead letters that say why, and a JobRejected for an invalid submission that names its job.

Users are created per test (unique names, full rights on the test's vhost, deleted afterwards): the point here is
what the *consumer* refuses, not the broker's permissions (tests/deploy covers those).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote

import aio_pika
import aiormq.exceptions
import httpx
import pytest
from gpuorch_contracts import (
    EVENTS_EXCHANGE,
    SUBMIT_EXCHANGE,
    JobFailed,
    JobFinished,
    JobSpec,
    LaunchJob,
    Message,
    NodeHeartbeat,
    ProcessRun,
    SubmissionRejected,
    SubmitJob,
    decode,
    tenant_binding,
)
from gpuorch_messaging import (
    REASON_HEADER,
    USER_ID_HEADER,
    Broker,
    BrokerSettings,
    QueueSpec,
    Sender,
    answer_invalid_submission,
    job_id_of,
    refusal,
    scheduler_accepts,
    speaker_of,
)
from gpuorch_settings import SettingsError

from conftest import AMQP_HOST, AMQP_MGMT, AMQP_PORT

pytestmark = pytest.mark.integration

SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "print(42)"]))
SUFFIX = uuid.uuid4().hex[:8]
NODE = f"n{SUFFIX}"


class Users:
    """Broker users with every right on one vhost; ``url(user)`` connects as one of them."""

    def __init__(self, vhost: str, names: list[str]) -> None:
        url = httpx.URL(AMQP_MGMT)
        self.api = httpx.Client(base_url=f"{url.scheme}://{url.host}:{url.port}",
                                auth=(url.username or "guest", url.password or "guest"), timeout=30)
        self.vhost, self.names = vhost, names
        for name in names:
            self.api.put(f"/api/users/{name}", json={"password": "pw", "tags": ""}).raise_for_status()
            self.api.put(f"/api/permissions/{quote(vhost, safe='')}/{name}",
                         json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()

    def url(self, user: str) -> str:
        return f"amqp://{user}:pw@{AMQP_HOST}:{AMQP_PORT}/{quote(self.vhost, safe='')}"

    def delete(self) -> None:
        for name in self.names:
            self.api.delete(f"/api/users/{name}")
        self.api.close()


SCHEDULER, EXECUTOR, OTHER_EXECUTOR, SUBMITTER = (
    f"scheduler-{SUFFIX}", f"executor-{NODE}", f"executor-x{SUFFIX}", f"acme-ci-{SUFFIX}")


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[Users]:
    created = Users(amqp_vhost, [SCHEDULER, EXECUTOR, OTHER_EXECUTOR, SUBMITTER])
    try:
        yield created
    finally:
        created.delete()


@pytest.fixture
async def brokers() -> AsyncIterator[list[Broker]]:
    opened: list[Broker] = []
    yield opened
    for broker in opened:
        await broker.close()
    for connection in OPEN_CONNECTIONS:
        await connection.close()
    OPEN_CONNECTIONS.clear()


OPEN_CONNECTIONS: list[aio_pika.abc.AbstractConnection] = []


async def plain_connection(url: str) -> aio_pika.abc.AbstractConnection:
    """A plain aio-pika connection, closed after the test by the ``brokers`` fixture."""
    connection = await aio_pika.connect(url)
    OPEN_CONNECTIONS.append(connection)
    return connection


async def connect(brokers: list[Broker], url: str, **options: object) -> Broker:
    options.setdefault("identity", "strict")  # the root conftest makes trust_all the default of tests
    broker = Broker(url, producer="test", publish_timeout_s=5, **options)  # type: ignore[arg-type]
    await broker.connect(timeout_s=5)
    brokers.append(broker)
    return broker


class Tap:
    """A plain consumer of one queue; ``next()`` waits for the next delivery (no polling)."""

    def __init__(self) -> None:
        self.deliveries: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()

    async def __call__(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()
        await self.deliveries.put(message)

    async def next(self) -> aio_pika.abc.AbstractIncomingMessage:
        async with asyncio.timeout(10):
            return await self.deliveries.get()


async def tap(connection: aio_pika.abc.AbstractConnection, queue: str, bind: tuple[str, str] | None = None) -> Tap:
    channel = await connection.channel()
    if bind is None:
        declared = await channel.declare_queue(queue, passive=True)
    else:
        declared = await channel.declare_queue(queue, exclusive=True)
        await declared.bind(bind[0], bind[1])
    listener = Tap()
    await declared.consume(listener)
    return listener


class Handled:
    def __init__(self) -> None:
        self.messages: asyncio.Queue[Message] = asyncio.Queue()

    async def __call__(self, message: Message) -> None:
        await self.messages.put(message)


async def publish_as(url: str, exchange: str, key: str, body: bytes, *, user_id: str | None,
                     message_id: str | None = None, correlation_id: str | None = None) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        target = await channel.get_exchange(exchange)
        await target.publish(aio_pika.Message(body, user_id=user_id, message_id=message_id or str(uuid.uuid4()),
                                              correlation_id=correlation_id), key, mandatory=True)
    finally:
        await connection.close()


def scheduler_queue(name: str, **extra: object) -> QueueSpec:
    return QueueSpec(name, [(SUBMIT_EXCHANGE, "job.submit"), (EVENTS_EXCHANGE, "job.#"),
                            (EVENTS_EXCHANGE, "node.heartbeat")], accepts=scheduler_accepts(), **extra)  # type: ignore[arg-type]


async def test_every_publish_carries_its_users_id_and_rabbitmq_refuses_a_forged_one(
    users: Users, brokers: list[Broker]
) -> None:
    executor = await connect(brokers, users.url(EXECUTOR))
    listener = await tap(await plain_connection(users.url(SCHEDULER)), "t.events", (EVENTS_EXCHANGE, "job.#"))
    await executor.publish(JobFinished(job_id=uuid.uuid4(), placement_id=uuid.uuid4(), node_id=NODE,
                                       exit_code=0, duration_s=1, tenant="acme"))
    delivery = await listener.next()
    assert delivery.user_id == EXECUTOR and delivery.routing_key == "job.finished.acme"

    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):  # RabbitMQ's own check
        await publish_as(users.url(SUBMITTER), EVENTS_EXCHANGE, "job.finished", b"{}", user_id=EXECUTOR)


async def test_forged_senders_are_dead_lettered_with_the_reason_and_never_handled(
    users: Users, brokers: list[Broker]
) -> None:
    scheduler = await connect(brokers, users.url(SCHEDULER))
    handled = Handled()
    await scheduler.consume(scheduler_queue("t.scheduler"), handled)
    dead = await tap(await plain_connection(users.url(SCHEDULER)), "t.scheduler.dlq")
    job_id, placement_id = uuid.uuid4(), uuid.uuid4()

    def failed(node: str) -> bytes:
        return JobFailed(job_id=job_id, placement_id=placement_id, node_id=node, cause="killed",
                         reason="forged").model_dump_json().encode()

    forged = [  # (publisher, exchange, routing key, body, user_id, expected reason)
        (SUBMITTER, SUBMIT_EXCHANGE, "job.submit", failed(NODE), SUBMITTER,
         f"job.failed from {SUBMITTER} (role submitter) refused"),
        (OTHER_EXECUTOR, EVENTS_EXCHANGE, "job.failed", failed(NODE), OTHER_EXECUTOR,
         f"node_id='{NODE}' is not a node {OTHER_EXECUTOR} speaks for"),
        (EXECUTOR, EVENTS_EXCHANGE, "job.failed", failed(NODE), None, "has no user_id"),
        (SCHEDULER, EVENTS_EXCHANGE, "job.launch",
         LaunchJob(node_id=NODE, job_id=job_id, placement_id=placement_id, spec=SPEC).model_dump_json().encode(),
         SCHEDULER, "queue t.scheduler does not take launch_job"),
    ]
    for user, exchange, key, body, user_id, _ in forged:
        await publish_as(users.url(user), exchange, key, body, user_id=user_id)
    for user, *_, reason in forged:
        letter = await dead.next()
        assert reason in str((letter.headers or {})[REASON_HEADER])
        assert (letter.headers or {})[USER_ID_HEADER] == ("" if "no user_id" in reason else user)
        assert letter.user_id == SCHEDULER  # republished under the consumer's own identity

    # the executor of the node speaks for it: handled, and nothing forged came before it
    executor = await connect(brokers, users.url(EXECUTOR))
    await executor.publish(JobFailed.model_validate_json(failed(NODE)))
    got = await asyncio.wait_for(handled.messages.get(), 10)
    assert isinstance(got, JobFailed) and got.node_id == NODE and handled.messages.empty()


async def test_trust_all_checks_types_but_not_senders(amqp_url: str, brokers: list[Broker]) -> None:
    broker = await connect(brokers, amqp_url, identity="trust_all")  # guest, as local development runs
    handled = Handled()
    await broker.consume(scheduler_queue("t.trusting"), handled)
    dead = await tap(await plain_connection(amqp_url), "t.trusting.dlq")
    await broker.publish(NodeHeartbeat(node_id="anything", inventory_hash="h", sequence=1))
    assert isinstance(await asyncio.wait_for(handled.messages.get(), 10), NodeHeartbeat)
    await broker.publish_raw(SUBMIT_EXCHANGE, "job.submit", LaunchJob(
        node_id="n", job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=SPEC).model_dump_json().encode(),
        message_id="m")
    letter = await dead.next()
    assert "does not take launch_job" in str((letter.headers or {})[REASON_HEADER])
    with pytest.raises(ValueError, match="identity"):
        Broker(amqp_url, identity="off")  # type: ignore[arg-type]


async def test_an_invalid_submission_with_a_job_id_is_answered_with_job_rejected(
    users: Users, brokers: list[Broker]
) -> None:
    scheduler = await connect(brokers, users.url(SCHEDULER))
    tenants = {SUBMITTER: "acme"}
    await scheduler.consume(scheduler_queue("t.answering", on_invalid=answer_invalid_submission(tenants.get)),
                            Handled())
    connection = await plain_connection(users.url(SCHEDULER))
    answers = await tap(connection, "t.answers", (EVENTS_EXCHANGE, "job.rejected.#"))
    dead = await tap(connection, "t.answering.dlq")
    job_id = uuid.uuid4()
    bad_spec = {"type": "job.submit", "job_id": str(job_id), "spec": {"run": {"runtime": "process", "argv": []},
                                                                      "tenant": "other-team"}}
    await publish_as(users.url(SUBMITTER), SUBMIT_EXCHANGE, "job.submit", b'{"type": "job.submit", "bogus": 1}',
                     user_id=SUBMITTER)  # no job id: a dead letter only
    await publish_as(users.url(SUBMITTER), SUBMIT_EXCHANGE, "job.submit", json.dumps(bad_spec).encode(),
                     user_id=SUBMITTER)
    await dead.next()
    await dead.next()
    answer = await answers.next()
    rejected = decode(answer.body)
    assert rejected.TYPE == "job.rejected" and rejected.job_id == job_id  # type: ignore[attr-defined]
    assert "spec.run.process.argv" in rejected.reason  # type: ignore[attr-defined]
    assert answer.routing_key == "job.rejected.acme"  # the publisher's tenant, not the one its body named
    assert answers.deliveries.empty()


async def test_a_sender_aware_handler_gets_the_publishers_user(users: Users, brokers: list[Broker]) -> None:
    """Admission needs the publisher: ``consume(..., with_sender=True)`` passes the delivery's user_id."""
    scheduler = await connect(brokers, users.url(SCHEDULER))
    got: asyncio.Queue[tuple[Message, str | None]] = asyncio.Queue()

    async def admit(message: Message, user_id: str | None) -> None:
        await got.put((message, user_id))

    await scheduler.consume(scheduler_queue("t.admission"), admit, with_sender=True)
    submitter = await connect(brokers, users.url(SUBMITTER))
    submission = SubmitJob(spec=SPEC)
    await submitter.publish(submission)
    message, user_id = await asyncio.wait_for(got.get(), 10)
    assert message.message_id == submission.message_id and user_id == SUBMITTER


def test_job_id_of_never_raises() -> None:
    job_id = uuid.uuid4()
    assert job_id_of(json.dumps({"type": "job.submit", "job_id": str(job_id), "spec": 1}).encode()) == job_id
    for body in (b"", b"\xff\xfe", b"[1]", b'{"type": "job.cancel", "job_id": "%s"}' % str(
            job_id).encode(), b'{"type": "job.submit", "job_id": "nope"}', b'{"type": "job.submit", "job_id": 7}',
            b'{"type": "job.submit", "job_id": "' + b"a" * 2_000_000 + b'"}'):
        assert job_id_of(body) is None, body[:40]


def test_an_undecodable_submission_that_names_its_job_is_still_answerable() -> None:
    job_id = uuid.uuid4()
    named = b'{"type": "job.submit", "job_id": "%s", ' % str(job_id).encode()
    for tail in (b'"spec": {"name": "\xff\xfe"}}', b'"spec": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'"spec": {'):
        assert job_id_of(named + tail) == job_id  # invalid UTF-8, nested too deep, cut short
    assert job_id_of(b'{"type": "job.cancel", "job_id": "%s", \xff}' % str(job_id).encode()) is None


@pytest.mark.parametrize(("user", "role", "nodes"), [
    ("scheduler", "scheduler", set()), ("scheduler-b", "scheduler", set()), ("telemetry-1", "telemetry", set()),
    ("executor-node-1", "executor", {"node-1"}), ("node-agent-gpu-a", "node-agent", {"gpu-a"}),
    ("gpuctl-operator", "operator", set()), ("gpuctl-operator-2", "operator", set()),
    ("gpuctl-submit", "submitter", set()), ("gpuctl-operatorx", "submitter", set()), ("executor-", "submitter", set()),
    ("schedulerx", "submitter", set()), ("guest", "submitter", set()),
])
def test_speaker_naming_convention(user: str, role: str, nodes: set[str]) -> None:
    speaker = speaker_of(user)
    assert (speaker.role, set(speaker.nodes)) == (role, nodes)


def test_node_scopes_override_the_suffix_and_refusals_name_the_rule() -> None:
    heartbeat = NodeHeartbeat(node_id="sim-00001", inventory_hash="h", sequence=1)
    accepts = {"node.heartbeat": (Sender("node-agent", node_field="node_id"),)}
    scopes = {"node-agent-sim": ["sim-00000", "sim-00001"]}
    assert refusal(accepts, heartbeat, "node-agent-sim", queue="q", node_scopes=scopes) is None
    assert "is not a node node-agent-sim speaks for" in str(refusal(accepts, heartbeat, "node-agent-sim", queue="q"))
    assert "only node-agent (for its own node_id)" in str(refusal(accepts, heartbeat, "scheduler", queue="q"))
    assert refusal(accepts, heartbeat, None, queue="q", mode="trust_all") is None
    assert "does not take" in str(refusal({}, heartbeat, "scheduler", queue="q", mode="trust_all"))


def test_production_default_is_strict_and_only_settings_read_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUORCH_IDENTITY", "trust_all")  # the library reads no environment
    assert Broker("amqp://scheduler:pw@broker/").identity == "strict"
    assert Broker("amqp://scheduler:pw@broker/").user_id == "scheduler" and Broker("amqp://broker/").user_id == "guest"
    assert BrokerSettings.load({}).broker_options() == {
        "identity": "strict", "declare_topology": False, "topology_wait_s": 60.0}
    options = BrokerSettings.load({"GPUORCH_IDENTITY": "trust_all", "GPUORCH_BROKER_TOPOLOGY": "declare"}).broker_options()
    assert Broker("amqp://broker/", **options).identity == "trust_all" and options["declare_topology"] is True
    with pytest.raises(SettingsError, match="GPUORCH_BROKER_TOPOLOGY"):
        BrokerSettings.load({"GPUORCH_BROKER_TOPOLOGY": "maybe"})


async def test_an_oversized_submission_with_a_job_id_is_answered_too(users: Users, brokers: list[Broker]) -> None:
    scheduler = await connect(brokers, users.url(SCHEDULER))
    tenants = {SUBMITTER: "acme"}
    await scheduler.consume(scheduler_queue("t.oversized", on_invalid=answer_invalid_submission(tenants.get)),
                            Handled())
    connection = await plain_connection(users.url(SCHEDULER))
    answers = await tap(connection, "t.oversized.answers", (EVENTS_EXCHANGE, "job.rejected.#"))
    job_id = uuid.uuid4()
    body = json.dumps({"type": "job.submit", "job_id": str(job_id), "spec": {"name": "x" * 1_000_000}}).encode()
    await publish_as(users.url(SUBMITTER), SUBMIT_EXCHANGE, "job.submit", body, user_id=SUBMITTER)
    rejected = decode((await answers.next()).body)
    assert rejected.job_id == job_id and "exceeds" in rejected.reason  # type: ignore[attr-defined]


async def test_an_oversized_submission_without_a_job_id_is_answered_to_its_sender(
    users: Users, brokers: list[Broker]
) -> None:
    """1 MB that names no job: a SubmissionRejected with the AMQP ids, routed to the publisher's tenant (what a
    submitter's ``job.*.<tenant>`` binding receives), and the consumer goes on with the next submission."""
    scheduler = await connect(brokers, users.url(SCHEDULER))
    tenants = {SUBMITTER: "acme"}
    handled = Handled()
    await scheduler.consume(scheduler_queue("t.unread", on_invalid=answer_invalid_submission(tenants.get)), handled)
    connection = await plain_connection(users.url(SCHEDULER))
    answers = await tap(connection, "t.unread.answers", (EVENTS_EXCHANGE, tenant_binding("acme")))
    body = b'{"type": "job.submit", "spec": {"name": "' + b"x" * 1_000_000 + b'"}}'
    await publish_as(users.url(SUBMITTER), SUBMIT_EXCHANGE, "job.submit", body, user_id=SUBMITTER,
                     message_id="sub-1", correlation_id="corr-1")
    answer = await answers.next()
    rejected = decode(answer.body)
    assert isinstance(rejected, SubmissionRejected) and answer.routing_key == "job.submission_rejected.acme"
    assert (rejected.submission_message_id, rejected.correlation_id) == ("sub-1", "corr-1")
    assert rejected.size_bytes == len(body) and "exceeds" in rejected.reason
    valid = SubmitJob(spec=SPEC)
    await publish_as(users.url(SUBMITTER), SUBMIT_EXCHANGE, "job.submit", valid.model_dump_json().encode(),
                     user_id=SUBMITTER)
    assert (await asyncio.wait_for(handled.messages.get(), 10)).message_id == valid.message_id
