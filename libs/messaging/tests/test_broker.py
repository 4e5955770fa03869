"""Broker adapter against the real RabbitMQ: confirms, returns, dead-letters with reasons, reconnects."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aio_pika
import httpx
import pytest
from gpuorch_contracts import (
    DEAD_LETTER_EXCHANGE,
    EVENTS_EXCHANGE,
    SUBMIT_EXCHANGE,
    SUBMIT_SHARED_EXCHANGE,
    JobAccepted,
    JobSpec,
    Message,
    ProcessRun,
    StopJob,
    SubmitJob,
    decode,
)
from gpuorch_messaging import REASON_HEADER, Broker, PublishError, PublishRefused, QueueSpec
from gpuorch_messaging.testing import TcpProxy
from gpuorch_messaging.topology import (
    BOUNDED_QUEUES_POLICY,
    DEAD_LETTER_MAX_BYTES,
    DEAD_LETTER_MAX_LENGTH,
    UNROUTED,
    UNROUTED_MAX_BYTES,
)

from conftest import AMQP_MGMT, _mgmt

pytestmark = pytest.mark.integration

SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "print(42)"]))


async def _drain(url: str, queue: str, expect: int, wait_s: float = 10.0) -> list[aio_pika.abc.AbstractIncomingMessage]:
    connection = await aio_pika.connect(url)
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        deadline = asyncio.get_running_loop().time() + wait_s
        while len(got) < expect and asyncio.get_running_loop().time() < deadline:
            message = await q.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.05)
            else:
                got.append(message)
    finally:
        await connection.close()
    return got


async def _publish_foreign(url: str, body: bytes) -> None:
    """Publish as another system would: plain AMQP, no gpuorch checks."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(SUBMIT_EXCHANGE)
        await exchange.publish(aio_pika.Message(body, message_id="bad-1"), "job.submit")
    finally:
        await connection.close()


async def test_oversized_publish_is_refused(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        with pytest.raises(PublishError, match="limit"):
            await broker.publish_raw(SUBMIT_EXCHANGE, "job.submit", b"x" * 300_000, message_id="big")
    finally:
        await broker.close()


async def test_unroutable_command_or_submission_raises(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        with pytest.raises(PublishError, match="unroutable"):
            await broker.publish(SubmitJob(spec=SPEC))
        with pytest.raises(PublishError, match="unroutable"):
            await broker.publish(StopJob(node_id="nowhere", job_id=uuid.uuid4(), placement_id=uuid.uuid4()))
    finally:
        await broker.close()


async def test_a_submission_no_tenant_lane_takes_reaches_the_shared_lane(amqp_url: str) -> None:
    """``gpuorch.submit``'s alternate exchange: a key nobody binds (a tenant without a lane, the plain key) lands
    in whatever is bound to ``gpuorch.submit.shared``; a key a lane binds goes only to that lane."""
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    got: dict[str, list[str]] = {"shared": [], "acme": []}

    def collect(lane: str) -> Any:
        async def handle(message: Message) -> None:
            got[lane].append(message.spec.tenant)  # type: ignore[attr-defined]
        return handle

    try:
        await broker.consume(QueueSpec("t.shared", [(SUBMIT_SHARED_EXCHANGE, "")]), collect("shared"))
        await broker.consume(QueueSpec("t.acme", [(SUBMIT_EXCHANGE, "job.submit.acme")]), collect("acme"))
        for tenant in ("acme", "beta", "default"):
            await broker.publish(SubmitJob(spec=SPEC.model_copy(update={"tenant": tenant})))
        async with asyncio.timeout(20):
            while len(got["shared"]) + len(got["acme"]) < 3:
                await asyncio.sleep(0.05)
    finally:
        await broker.close()
    assert got == {"shared": ["beta", "default"], "acme": ["acme"]}


async def test_an_exchange_declared_with_other_arguments_is_a_clear_error(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:  # what a gpuorch before the submission lanes declared
        await (await connection.channel()).declare_exchange(SUBMIT_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    finally:
        await connection.close()
    broker = Broker(amqp_url, producer="test")
    with pytest.raises(RuntimeError, match="delete it once"):
        await broker.connect()
    await broker.close()


async def test_event_without_subscribers_is_kept_in_the_unrouted_queue(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        event = JobAccepted(job_id=uuid.uuid4(), spec=SPEC)
        await broker.publish(event)
    finally:
        await broker.close()
    kept = await _drain(amqp_url, UNROUTED, 1)
    assert [m.message_id for m in kept] == [str(event.message_id)]


async def test_published_message_is_handled_once_and_acked(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    seen: list[SubmitJob] = []
    done = asyncio.Event()

    async def handler(message):  # type: ignore[no-untyped-def]
        seen.append(message)
        done.set()

    try:
        await broker.consume(QueueSpec("t.submit", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        sent = SubmitJob(spec=SPEC)
        await broker.publish(sent)
        await asyncio.wait_for(done.wait(), 10)
        assert seen == [sent.model_copy(update={"producer": "test"})]
    finally:
        await broker.close()
    # nothing left unacked or dead-lettered
    assert await _drain(amqp_url, "t.submit", 1, wait_s=0.5) == []
    assert await _drain(amqp_url, "t.submit.dlq", 1, wait_s=0.5) == []


@pytest.mark.parametrize(
    ("body", "reason_fragment"),
    [
        (b"{not json", "invalid message"),
        (json.dumps({"type": "job.submit", "spec": SPEC.model_dump(mode="json"), "surprise": 1}).encode(),
         "surprise: Extra inputs are not permitted"),
        (json.dumps({"type": "job.submit", "spec": {"run": {"argv": "python"}}}).encode(), "spec.run"),
        (json.dumps({"type": "job.submit", "spec": SPEC.model_dump(mode="json"), "pad": "x" * 300_000}).encode(),
         "exceeds"),
        (json.dumps({"type": "no.such"}).encode(), "unknown message type"),
    ],
    ids=["bad-json", "unknown-field", "wrong-type", "oversized", "unknown-type"],
)
async def test_invalid_message_is_dead_lettered_with_reason_and_valid_traffic_flows(
    amqp_url: str, body: bytes, reason_fragment: str
) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    seen: list[object] = []

    async def handler(message):  # type: ignore[no-untyped-def]
        seen.append(message)

    try:
        await broker.consume(QueueSpec("t.in", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        await _publish_foreign(amqp_url, body)
        good = SubmitJob(spec=SPEC)
        await broker.publish(good)
        dead = await _drain(amqp_url, "t.in.dlq", 1)
        assert len(dead) == 1
        assert dead[0].body == body
        assert reason_fragment in dead[0].headers[REASON_HEADER]
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        assert [m.message_id for m in seen] == [good.message_id]  # type: ignore[attr-defined]
    finally:
        await broker.close()


async def test_handler_that_keeps_failing_is_dead_lettered_after_delivery_limit(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    attempts = 0

    async def handler(message):  # type: ignore[no-untyped-def]
        nonlocal attempts
        attempts += 1
        raise RuntimeError("database on fire")

    try:
        await broker.consume(QueueSpec("t.fail", [(SUBMIT_EXCHANGE, "job.submit")], delivery_limit=3), handler)
        await broker.publish(SubmitJob(spec=SPEC))
        dead = await _drain(amqp_url, "t.fail.dlq", 1)
        assert len(dead) == 1
        assert "handler failed 3 times: RuntimeError: database on fire" in dead[0].headers[REASON_HEADER]
        assert attempts == 3
    finally:
        await broker.close()


async def test_traceparent_rides_in_headers(amqp_url: str) -> None:
    from gpuorch_observability import configure_tracing, tracer

    configure_tracing("test")
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("t.trace", [(EVENTS_EXCHANGE, "job.#")]))
        with tracer().start_as_current_span("submit") as span:
            await broker.publish(JobAccepted(job_id=uuid.uuid4(), spec=SPEC))
            trace_id = format(span.get_span_context().trace_id, "032x")
        got = await _drain(amqp_url, "t.trace", 1)
        assert got[0].headers["traceparent"].split("-")[1] == trace_id
    finally:
        await broker.close()


async def test_connection_cut_mid_flow_publish_and_consume_resume(amqp_url: str, amqp_vhost: str) -> None:
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}"
    broker = Broker(url, producer="test")
    await broker.connect()
    seen: dict[uuid.UUID, int] = {}

    async def handler(message):  # type: ignore[no-untyped-def]
        seen[message.job_id] = seen.get(message.job_id, 0) + 1

    try:
        await broker.consume(QueueSpec("t.cut", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        sent = [SubmitJob(spec=SPEC) for _ in range(20)]
        for i, message in enumerate(sent):
            if i == 10:
                await proxy.cut()
            await broker.publish(message)
        for _ in range(200):
            if len(seen) == len(sent):
                break
            await asyncio.sleep(0.05)
        assert proxy.cuts == 1
        assert set(seen) == {m.job_id for m in sent}
    finally:
        await broker.close()
        await proxy.stop()


NESTED_5000_DEEP = b'{"type": "job.submit", "spec": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # 10 KB


async def test_bodies_whose_decoding_raises_anything_are_dead_lettered_and_never_stall_the_consumer(
    amqp_url: str,
) -> None:
    """A RecursionError (5,000-deep JSON), a UnicodeDecodeError or any other exception from the decoder is
    dead-lettered with its reason and acked: 70 of them, more than twice the prefetch, do not stall the queue."""
    hostile = [NESTED_5000_DEEP] * 70 + [b"\xff\xfe not utf-8", b'{"type": "job.submit", "decoder": "trips"}']
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    handled: list[object] = []
    valid_handled = asyncio.Event()

    def decoder(body: bytes):  # type: ignore[no-untyped-def]
        if b'"decoder": "trips"' in body:
            raise LookupError("a decoder bug")
        return decode(body)

    async def handler(message):  # type: ignore[no-untyped-def]
        handled.append(message)
        valid_handled.set()

    try:
        await broker.consume(QueueSpec("t.hostile", [(SUBMIT_EXCHANGE, "job.submit")], prefetch=32), handler,
                             decoder=decoder)
        for body in hostile:
            await _publish_foreign(amqp_url, body)
        valid = SubmitJob(spec=SPEC)
        await broker.publish(valid)
        await asyncio.wait_for(valid_handled.wait(), 60)  # only guards a hang: before, it never came
        assert [m.message_id for m in handled] == [valid.message_id]  # type: ignore[attr-defined]
        dead = await _drain(amqp_url, "t.hostile.dlq", len(hostile), wait_s=30)
        assert sorted(m.body for m in dead) == sorted(hostile)
        reasons = [m.headers[REASON_HEADER] for m in dead]
        assert all(r.startswith("invalid message: ") for r in reasons)
        assert sum("RecursionError" in r for r in reasons) == 70
        assert sum("UnicodeDecodeError" in r for r in reasons) == 1
        assert sum("LookupError: a decoder bug" in r for r in reasons) == 1
    finally:
        await broker.close()


async def test_publish_into_a_full_reject_publish_queue_is_refused(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("t.bounded", [(EVENTS_EXCHANGE, "job.accepted.#")], max_length=2,
                                             overflow="reject-publish"))
        for _ in range(2):
            await broker.publish(JobAccepted(job_id=uuid.uuid4(), spec=SPEC))
        # a quorum queue takes the one message that crosses its bound, then refuses
        with pytest.raises(PublishRefused, match="nack"):
            for _ in range(2):
                await broker.publish(JobAccepted(job_id=uuid.uuid4(), spec=SPEC))
        assert issubclass(PublishRefused, PublishError)
        kept = await _drain(amqp_url, "t.bounded", 4, wait_s=1)
        assert len(kept) == 3  # the refused one is not in the queue
    finally:
        await broker.close()


async def test_dead_letter_queues_are_bounded_dropping_the_oldest(amqp_url: str) -> None:
    assert QueueSpec("any", []).dead_letter_arguments()["x-max-length"] == DEAD_LETTER_MAX_LENGTH
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("t.small", [(EVENTS_EXCHANGE, "job.accepted")],
                                             dead_letter_max_length=2))
        for n in range(3):
            await broker.publish_raw(DEAD_LETTER_EXCHANGE, "t.small", f"dead {n}".encode(), message_id=f"d{n}")
        dead = await _drain(amqp_url, "t.small.dlq", 3, wait_s=1)
        assert [m.body for m in dead] == [b"dead 1", b"dead 2"]
    finally:
        await broker.close()


def test_queue_spec_refuses_an_overflow_quorum_queues_do_not_have() -> None:
    with pytest.raises(ValueError, match="overflow"):
        QueueSpec("t", [], max_length=1, overflow="reject-publish-dlx")  # type: ignore[arg-type]


async def test_a_handler_is_not_cancelled_when_the_connection_drops_under_it(amqp_url: str, amqp_vhost: str) -> None:
    """The delivery goes back to the queue with the channel, but the handler's effect completes; the
    redelivery is handled again (handlers dedupe)."""
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    broker = Broker(f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}", producer="test")
    await broker.connect()
    started: list[int] = []
    finished: list[int] = []
    release = asyncio.Event()
    redelivered = asyncio.Event()
    both_finished = asyncio.Event()

    async def handler(message):  # type: ignore[no-untyped-def]
        started.append(len(started))
        if len(started) == 2:
            redelivered.set()
        await release.wait()
        finished.append(len(finished))
        if len(finished) == 2:
            both_finished.set()

    try:
        await broker.consume(QueueSpec("t.inflight", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        await broker.publish(SubmitJob(spec=SPEC))
        while not started:
            await asyncio.sleep(0.02)
        await proxy.cut()
        await asyncio.wait_for(redelivered.wait(), 60)
        release.set()
        await asyncio.wait_for(both_finished.wait(), 30)  # the first handler was not cancelled
        assert len(finished) == 2
    finally:
        await broker.close()
        await proxy.stop()


async def test_a_batch_is_published_in_order_with_one_outcome_per_message(amqp_url: str) -> None:
    """``publish_raw_batch`` (the outbox relay's path): routed messages arrive in order; an unroutable one, one for
    an unknown exchange and an oversized one each get their refusal, and do not stop the others."""
    from gpuorch_contracts import COMMANDS_EXCHANGE, MAX_MESSAGE_BYTES
    from gpuorch_store import OutgoingMessage

    broker = Broker(amqp_url, producer="test", identity="trust_all")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("batch.node-1", [(COMMANDS_EXCHANGE, "node.node-1.#")]))
        stops = [StopJob(node_id="node-1", job_id=uuid.uuid4(), placement_id=uuid.uuid4()) for _ in range(5)]

        def row(message: Message, key: str, exchange: str = COMMANDS_EXCHANGE, body: bytes | None = None) -> Any:
            return OutgoingMessage(exchange, key, body if body is not None else message.model_dump_json().encode(),
                                   str(message.message_id), {"type": message.TYPE})

        batch = [row(stops[0], "node.node-1.stop_job"), row(stops[1], "node.nowhere.stop_job"),
                 row(stops[2], "node.node-1.stop_job"), row(stops[3], "node.node-1.stop_job", "no.such.exchange"),
                 row(stops[4], "node.node-1.stop_job", body=b"x" * (MAX_MESSAGE_BYTES + 1))]
        outcomes = await broker.publish_raw_batch(batch)
        assert outcomes[0] is None and outcomes[2] is None
        assert all(isinstance(outcomes[k], PublishRefused) for k in (1, 3, 4)), outcomes
        assert "unroutable" in str(outcomes[1]) and "unknown exchange" in str(outcomes[3])
        got = await _drain(amqp_url, "batch.node-1", 2)
        assert [m.message_id for m in got] == [str(stops[0].message_id), str(stops[2].message_id)]
        assert all(m.user_id == "guest" for m in got)
    finally:
        await broker.close()


async def test_publish_many_sends_what_publish_sends_in_one_batch_and_retries_what_the_batch_lost(
        amqp_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``publish_many`` (the node-agent fleet's path): every message arrives once, in order, with the body and AMQP
    properties ``publish`` gives it; an unroutable one fails the call (``PublishRefused`` as the cause) without
    stopping the others; messages the batch could not get confirmed go again through ``publish``'s retrying path."""
    from gpuorch_contracts import NodeHeartbeat
    from gpuorch_messaging.publishing import ConfirmedPublisher

    broker = Broker(amqp_url, producer="test", identity="trust_all")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("many.beats", [(EVENTS_EXCHANGE, "node.heartbeat")]))
        beats = [NodeHeartbeat(node_id=f"n{i}", inventory_hash="h", sequence=i) for i in range(6)]
        await broker.publish(beats[0])
        await broker.publish_many(beats[1:4])
        with pytest.raises(PublishError) as failed:
            await broker.publish_many([beats[4], StopJob(node_id="nowhere", job_id=uuid.uuid4(),
                                                         placement_id=uuid.uuid4())])
        assert isinstance(failed.value.__cause__, PublishRefused) and "unroutable" in str(failed.value)
        calls: list[int] = []

        async def lose_the_batch(self: ConfirmedPublisher, messages: Any) -> list[BaseException | None]:
            calls.append(len(messages))
            return [PublishError("not confirmed in time")] * len(messages)

        monkeypatch.setattr(ConfirmedPublisher, "publish_raw_batch", lose_the_batch)
        await broker.publish_many(beats[5:])
        assert calls == [1]
        got = await _drain(amqp_url, "many.beats", 6)
        assert [m.message_id for m in got] == [str(b.message_id) for b in beats]
        assert [decode(m.body) for m in got] == [b.model_copy(update={"producer": "test"}) for b in beats]
        first = got[0]
        for m in got[1:]:
            assert (m.content_type, m.delivery_mode, m.app_id, m.user_id, m.priority, m.headers) == (
                first.content_type, first.delivery_mode, first.app_id, first.user_id, first.priority, first.headers)
        assert first.headers["type"] == "node.heartbeat" and first.user_id == "guest"
    finally:
        await broker.close()


async def test_coalesced_acks_ack_every_handled_delivery_and_leave_a_failed_one_for_redelivery(amqp_url: str) -> None:
    """Deliveries handled in one turn of the loop are acked together; one whose handler fails is nacked on its own
    and comes again; once the consumer is gone nothing is left unacked (all would be back in the queue)."""
    broker = Broker(amqp_url, producer="test", identity="trust_all")
    await broker.connect()
    spec = QueueSpec("coalesced", [(EVENTS_EXCHANGE, "job.accepted.#")], prefetch=100)
    messages = [JobAccepted(job_id=uuid.uuid4(), spec=SPEC) for _ in range(50)]
    poison = messages[25].message_id
    release = asyncio.Event()
    seen: list[uuid.UUID] = []
    failed: list[uuid.UUID] = []
    entered: list[uuid.UUID] = []

    async def handler(message: Message) -> None:
        entered.append(message.message_id)
        await release.wait()  # every delivery finishes in the same turn of the loop
        if message.message_id == poison and not failed:
            failed.append(message.message_id)
            raise RuntimeError("once")
        seen.append(message.message_id)

    try:
        await broker.declare_queue(spec)
        for message in messages:
            await broker.publish(message)
        await broker.consume(spec, handler)
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline and len(entered) < 50:
            await asyncio.sleep(0.05)
        release.set()
        while asyncio.get_running_loop().time() < deadline and len(seen) < 50:
            await asyncio.sleep(0.05)
        assert sorted(map(str, seen)) == sorted(str(m.message_id) for m in messages) and failed == [poison]
        await asyncio.sleep(0.2)  # the last ack frame is written in the loop turn after the handlers returned
    finally:
        await broker.close()
    connection = await aio_pika.connect(amqp_url)
    try:
        queue = await (await connection.channel()).declare_queue("coalesced", passive=True)
        assert queue.declaration_result.message_count == 0
    finally:
        await connection.close()


def _queue_info(vhost: str, name: str) -> dict[str, Any]:
    url = httpx.URL(AMQP_MGMT)
    response = httpx.get(f"{url.scheme}://{url.host}:{url.port}/api/queues/{vhost}/{name}",
                         auth=(url.username or "guest", url.password or "guest"), timeout=10)
    response.raise_for_status()
    return dict(response.json())


async def test_unrouted_and_dead_letter_queues_are_bounded_in_bytes_and_an_older_queue_by_the_policy(
    amqp_url: str, amqp_vhost: str
) -> None:
    """Fresh queues get the byte bound as an argument; a dead-letter queue an older release declared without it is
    taken as it is (RabbitMQ would refuse the re-declaration), and the ``gpuorch-bounds`` policy bounds it."""
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    await channel.declare_queue("t.old.dlq", durable=True, arguments={  # as an older release declared it
        "x-queue-type": "quorum", "x-max-length": DEAD_LETTER_MAX_LENGTH, "x-overflow": "drop-head"})
    await connection.close()
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("t.new", [(EVENTS_EXCHANGE, "job.accepted")]))
        await broker.declare_queue(QueueSpec("t.old", [(EVENTS_EXCHANGE, "job.accepted")]))  # no PRECONDITION_FAILED
        for name, limit in ((UNROUTED, UNROUTED_MAX_BYTES), ("t.new.dlq", DEAD_LETTER_MAX_BYTES)):
            assert _queue_info(amqp_vhost, name)["arguments"]["x-max-length-bytes"] == limit
        assert "x-max-length-bytes" not in _queue_info(amqp_vhost, "t.old.dlq")["arguments"]
        policy = {**BOUNDED_QUEUES_POLICY, "definition": {**BOUNDED_QUEUES_POLICY["definition"],  # type: ignore[dict-item]
                                                         "max-length-bytes": 10}}  # small, to see it act
        _mgmt("PUT", f"/api/policies/{amqp_vhost}/{policy.pop('name')}", policy)
        deadline = time.monotonic() + 20
        while _queue_info(amqp_vhost, "t.old.dlq").get("effective_policy_definition", {}).get(
                "max-length-bytes") != 10:
            assert time.monotonic() < deadline, "the policy never applied"
            await asyncio.sleep(0.2)
        for n in range(3):
            await broker.publish_raw(DEAD_LETTER_EXCHANGE, "t.old", f"dead {n}".encode(), message_id=f"d{n}")
        kept = await _drain(amqp_url, "t.old.dlq", 3, wait_s=1)
        assert [m.body for m in kept] == [b"dead 2"]  # 6 bytes each under a 10-byte bound: the oldest dropped
    finally:
        await broker.close()


async def test_queue_depths_reads_each_queue_that_exists_and_leaves_out_the_others(amqp_url: str) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await broker.declare_queue(QueueSpec("t.depth", [(EVENTS_EXCHANGE, "job.accepted")]))
        for n in range(2):
            await broker.publish_raw(DEAD_LETTER_EXCHANGE, "t.depth", b"dead", message_id=f"d{n}")
        names = ["t.missing.dlq", "t.depth.dlq", "t.other-missing.dlq", UNROUTED]
        deadline = time.monotonic() + 10
        while (depths := await broker.queue_depths(names)) != {"t.depth.dlq": 2, UNROUTED: 0}:
            assert time.monotonic() < deadline, depths
            await asyncio.sleep(0.1)
    finally:
        await broker.close()


async def test_connect_without_a_timeout_waits_for_a_broker_down_at_start(amqp_vhost: str) -> None:
    """A service's start (``connect(timeout_s=None)``) retries with a backoff while the broker refuses, however long,
    and connects once it answers; with a timeout it gives up (decision 43)."""
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    proxy.refuse = True
    broker = Broker(f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}", producer="test")
    with pytest.raises(ConnectionError):
        await broker.connect(timeout_s=0.2)
    connecting = asyncio.create_task(broker.connect(timeout_s=None))
    try:
        deadline = time.monotonic() + 20
        while proxy.refused < 4:  # two tries of the timed connect, then two of the waiting one
            assert not connecting.done(), connecting
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        proxy.refuse = False
        await asyncio.wait_for(connecting, 20)
        assert broker.is_connected
    finally:
        connecting.cancel()
        await broker.close()
        await proxy.stop()


async def test_a_nodes_dead_letter_queue_reports_its_fullness(amqp_url: str) -> None:
    """What an executor or node-agent exports for its own node (decision 42): the dead-letter queue's depth, and
    full (dropping its oldest) at its message bound."""
    from gpuorch_messaging.bounded_gauges import keep_bounded_queue_gauges
    from prometheus_client import REGISTRY

    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    spec = QueueSpec(f"t.node-{uuid.uuid4().hex[:6]}", [], dead_letter_max_length=2)
    await broker.declare_queue(spec)
    connection = await aio_pika.connect(amqp_url)
    gauges = asyncio.create_task(keep_bounded_queue_gauges(broker, {spec.dead_letter_queue: 2}, period_s=0.05))
    try:
        channel = await connection.channel()
        for _ in range(3):  # one past the bound: the oldest is dropped
            await channel.default_exchange.publish(aio_pika.Message(b"poison"), spec.dead_letter_queue)
        labels = {"queue": spec.dead_letter_queue}
        deadline = time.monotonic() + 10
        while REGISTRY.get_sample_value("gpuorch_bounded_queue_full", labels) != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert REGISTRY.get_sample_value("gpuorch_bounded_queue_messages", labels) == 2
    finally:
        gauges.cancel()
        await connection.close()
        await broker.close()


async def test_a_latest_wins_queue_takes_deliveries_raw_dead_letters_the_invalid_and_keeps_it_after_a_reconnect(
    amqp_url: str, amqp_vhost: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeat-like queues (``acknowledged=False``) are handled from aiormq's deliveries directly; an invalid
    body still takes the full path (dead-lettered with its reason); after the connection is cut the raw path is
    installed again on the restored consumer."""
    from gpuorch_messaging.consuming import Consumers

    raw_calls = [0]
    raw_bodies: list[bytes] = []
    take_raw = Consumers._take_raw

    def counting(self, consumer, delivered):  # type: ignore[no-untyped-def]
        raw_calls[0] += 1
        raw_bodies.append(delivered.body)
        return take_raw(self, consumer, delivered)

    monkeypatch.setattr(Consumers, "_take_raw", counting)
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    broker = Broker(f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}", producer="test")
    await broker.connect()
    seen: list[uuid.UUID] = []

    async def handler(message):  # type: ignore[no-untyped-def]
        seen.append(message.job_id)

    async def handled(expected: list[uuid.UUID]) -> None:
        for _ in range(200):
            if seen == expected:
                return
            await asyncio.sleep(0.05)
        assert seen == expected

    try:
        await broker.consume(QueueSpec("t.latest", [(SUBMIT_EXCHANGE, "job.submit")], acknowledged=False), handler)
        first = [SubmitJob(spec=SPEC) for _ in range(3)]
        for message in first:
            await broker.publish(message)
        await handled([m.job_id for m in first])
        assert raw_calls[0] == 3

        await _publish_foreign(amqp_url, b"{not json")
        dead = await _drain(amqp_url, "t.latest.dlq", 1)
        assert len(dead) == 1 and "invalid message" in dead[0].headers[REASON_HEADER]

        assert raw_calls[0] == 4  # the invalid body came raw too
        await proxy.cut()
        later = SubmitJob(spec=SPEC)
        await broker.publish(later)  # waits for the reconnect
        await handled([m.job_id for m in first] + [later.job_id])
        # a delivery racing the consumer's restoration may take aio-pika's path (the same outcome); once the
        # channel is reopened, the raw path is back
        last = SubmitJob(spec=SPEC)
        await broker.publish(last)
        await handled([m.job_id for m in first] + [later.job_id, last.job_id])
        assert proxy.cuts == 1
        assert str(last.job_id).encode() in raw_bodies[-1]
    finally:
        await broker.close()
        await proxy.stop()


async def test_a_plain_handler_on_a_latest_wins_queue_runs_as_frames_arrive_and_invalid_or_refused_are_dead_lettered(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain (not async) handler of a latest-wins queue runs as each delivery's frames are read
    (``consuming._RawFrames``), on a connection of its own whose reads are paced: in order, nothing lost, and
    none of them reaches aiormq's channel reader (``_deliver_raw``).
    An undecodable body and a type the queue does not take are still dead-lettered with their reasons, a handler
    that raises does not stop the deliveries after it, and closing cancels the consumer."""
    from gpuorch_contracts import NodeHeartbeat
    from gpuorch_messaging.consuming import LATEST_WINS_READ_INTERVAL_S, Consumers
    from gpuorch_messaging.senders import Sender

    reader_calls = [0]
    deliver_raw = Consumers._deliver_raw

    async def counting(self, consumer, delivered):  # type: ignore[no-untyped-def]
        reader_calls[0] += 1
        await deliver_raw(self, consumer, delivered)

    monkeypatch.setattr(Consumers, "_deliver_raw", counting)
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    seen: list[uuid.UUID] = []
    failing = SubmitJob(spec=SPEC)

    def handler(message: Message) -> None:
        assert isinstance(message, SubmitJob)
        if message.job_id == failing.job_id:
            raise RuntimeError("this one fails")
        seen.append(message.job_id)

    async def handled(expected: list[uuid.UUID]) -> None:
        for _ in range(200):
            if seen == expected:
                return
            await asyncio.sleep(0.05)
        assert seen == expected

    spec = QueueSpec("t.plain", [(SUBMIT_EXCHANGE, "job.submit")], acknowledged=False,
                     accepts={SubmitJob.TYPE: [Sender("*")]})
    try:
        await broker.consume(spec, handler)
        first = [SubmitJob(spec=SPEC) for _ in range(6)]
        for message in [*first[:3], failing, *first[3:]]:
            await broker.publish(message)
        await handled([m.job_id for m in first])

        await _publish_foreign(amqp_url, b"{not json")
        await _publish_foreign(amqp_url, NodeHeartbeat(node_id="n1", inventory_hash="h", sequence=1)
                               .model_dump_json().encode())
        later = SubmitJob(spec=SPEC)
        await broker.publish(later)
        await handled([m.job_id for m in first] + [later.job_id])
        dead = await _drain(amqp_url, "t.plain.dlq", 2)
        reasons = sorted(str(m.headers[REASON_HEADER]) for m in dead)
        assert len(reasons) == 2
        assert reasons[0].startswith("invalid message")
        assert reasons[1].startswith("refused: queue t.plain does not take node.heartbeat")
        assert reader_calls[0] == 0
        paced = broker._consumers._latest_wins  # its own connection, read at most once per interval
        assert paced is not None and paced is not broker._consumers.connection
        assert paced.read_interval_s == LATEST_WINS_READ_INTERVAL_S and paced._pacing and paced._pacing.enabled
    finally:
        await broker.close()
