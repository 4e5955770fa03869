"""Acknowledged queues take their deliveries from aiormq directly (``raw_delivery.RawDelivery``), against the real
RabbitMQ: the same outcomes as aio-pika's path (dead letters with their reasons), an ack only once the handler
returned, a delivery in flight when the connection drops comes again."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import pytest
from gpuorch_contracts import SUBMIT_EXCHANGE, JobSpec, ProcessRun, SubmitJob
from gpuorch_messaging import REASON_HEADER, Broker, QueueSpec
from gpuorch_messaging.consuming import Consumers
from gpuorch_messaging.senders import Sender
from gpuorch_messaging.testing import TcpProxy

pytestmark = pytest.mark.integration

SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "print(42)"]))


@pytest.fixture
def raw_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the deliveries that took the raw acknowledged path."""
    calls = [0]
    deliver = Consumers._deliver_raw_acked

    async def counting(self: Consumers, consumer: Any, delivered: Any) -> None:
        calls[0] += 1
        await deliver(self, consumer, delivered)

    monkeypatch.setattr(Consumers, "_deliver_raw_acked", counting)
    return calls


async def _dead_letters(url: str, queue: str, expect: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    connection = await aio_pika.connect(url)
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    try:
        channel = await connection.channel()
        dlq = await channel.declare_queue(queue, passive=True)
        for _ in range(400):
            if len(got) >= expect:
                break
            message = await dlq.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.05)
            else:
                got.append(message)
    finally:
        await connection.close()
    return got


async def _until(condition: Any) -> None:
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.05)
    assert condition()


async def test_invalid_and_unpermitted_deliveries_are_dead_lettered_with_their_reason(
        amqp_url: str, raw_calls: list[int]) -> None:
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    seen: list[uuid.UUID] = []

    async def handler(message: Any) -> None:
        seen.append(message.job_id)

    try:
        await broker.consume(QueueSpec("t.acked", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        await broker.consume(QueueSpec("t.strict", [(SUBMIT_EXCHANGE, "job.submit")],
                                       accepts={"job.cancel": (Sender("operator"),)}), handler)
        valid = SubmitJob(spec=SPEC)
        await broker.publish(valid)
        await _until(lambda: seen == [valid.job_id])
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            exchange = await channel.get_exchange(SUBMIT_EXCHANGE)
            await exchange.publish(aio_pika.Message(b"{not json", message_id="bad-1"), "job.submit")
        finally:
            await connection.close()
        invalid = await _dead_letters(amqp_url, "t.acked.dlq", 1)
        assert len(invalid) == 1 and invalid[0].body == b"{not json"
        assert "invalid message" in invalid[0].headers[REASON_HEADER]
        refused = await _dead_letters(amqp_url, "t.strict.dlq", 2)  # the valid submission and the invalid body
        reasons = sorted(str(m.headers[REASON_HEADER]) for m in refused)
        assert any(r.startswith("refused:") and "job.submit" in r for r in reasons), reasons
        assert any(r.startswith("invalid message") for r in reasons), reasons
        assert seen == [valid.job_id]
        assert raw_calls[0] == 4  # every delivery of both queues came raw
    finally:
        await broker.close()


async def test_a_delivery_is_acked_only_after_its_handler_returned_and_comes_again_after_a_reconnect(
        amqp_vhost: str, raw_calls: list[int]) -> None:
    """The handler of the first delivery is still running when the connection drops: it was not acked, so the
    broker delivers it again on the restored consumer (raw, or through aio-pika's path if it arrived before the raw
    path was put back: the same outcome); once a handler returned, its ack holds (nothing comes a third time, the
    queue ends empty)."""
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    broker = Broker(f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}", producer="test")
    await broker.connect()
    seen: list[uuid.UUID] = []
    release = asyncio.Event()
    closed = False

    async def handler(message: Any) -> None:
        seen.append(message.job_id)
        await release.wait()

    try:
        await broker.consume(QueueSpec("t.inflight", [(SUBMIT_EXCHANGE, "job.submit")]), handler)
        message = SubmitJob(spec=SPEC)
        await broker.publish(message)
        await _until(lambda: seen == [message.job_id])
        await proxy.cut()
        await _until(lambda: seen == [message.job_id, message.job_id])  # redelivered: it was never acked
        assert proxy.cuts == 1 and raw_calls[0] in (1, 2)  # the redelivery may beat the raw path's reinstalling
        before = raw_calls[0]
        release.set()
        after = SubmitJob(spec=SPEC)
        await broker.publish(after)
        await _until(lambda: seen[-1] == after.job_id)
        assert raw_calls[0] == before + 1  # the restored consumer is raw again
        await broker.close()  # the handled deliveries' acks were written before the close: nothing goes back
        closed = True
        connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:5672/{amqp_vhost}")
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue("t.inflight", passive=True)
            assert queue.declaration_result.message_count == 0
        finally:
            await connection.close()
        assert seen == [message.job_id, message.job_id, after.job_id]
    finally:
        if not closed:
            await broker.close()
        await proxy.stop()
