"""Issue 29, smaller items: no broker ``max_message_size`` (a 60 MB dead letter blocked replay), and an oversized
message must be refused with an answer to its sender.

- Every deployment's RabbitMQ refuses a publish above ``BROKER_MAX_MESSAGE_BYTES`` (the broker's own answer: the
  publisher's channel is closed with the reason). Checked statically here: the test broker is shared, its limit is
  not ours to change.
- A 60 MB dead letter (possible on a broker without that limit, or recorded before it) is kept, listed and skipped by
  a replay, which replays what follows it.
- A submission between gpuorch's limit and the broker's is dead-lettered by its consumer with the reason and
  answered with ``job.rejected`` (it names its job).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import yaml
from gpuorch_contracts import EVENTS_EXCHANGE, MAX_MESSAGE_BYTES, SUBMIT_EXCHANGE, JobSpec, ProcessRun, SubmitJob
from gpuorch_messaging import (
    EXCHANGE_HEADER,
    REASON_HEADER,
    ROUTING_KEY_HEADER,
    Broker,
    answer_invalid_submission,
    submission_lanes,
)
from gpuorch_messaging.dead_letters import peek, replay
from gpuorch_messaging.queues import Installation, install
from gpuorch_messaging.topology import BROKER_MAX_MESSAGE_BYTES

pytestmark = [pytest.mark.security, pytest.mark.integration]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LANE = "scheduler.submit"


def test_every_deployed_broker_refuses_messages_above_the_limit() -> None:
    conf = (DEPLOY / "rabbitmq" / "rabbitmq.conf").read_text()
    assert re.search(rf"^max_message_size = {BROKER_MAX_MESSAGE_BYTES}$", conf, re.MULTILINE)
    cluster = yaml.safe_load((DEPLOY / "k8s" / "backing" / "rabbitmq-cluster.yaml").read_text())
    assert f"max_message_size = {BROKER_MAX_MESSAGE_BYTES}" in cluster["spec"]["rabbitmq"]["additionalConfig"]
    assert MAX_MESSAGE_BYTES * 4 <= BROKER_MAX_MESSAGE_BYTES <= 16 * 1024 * 1024


async def dead_letter(channel: Any, body: bytes, message_id: str) -> None:
    """A dead letter as RabbitMQ keeps one: the publisher's user_id, where it was going, why."""
    await channel.default_exchange.publish(aio_pika.Message(
        body, message_id=message_id, user_id="guest",
        headers={REASON_HEADER: "invalid message: too large", EXCHANGE_HEADER: SUBMIT_EXCHANGE,
                 ROUTING_KEY_HEADER: "job.submit"}), routing_key=f"{LANE}.dlq")


async def test_a_60_mb_dead_letter_does_not_block_the_replay_of_those_behind_it(amqp_url: str) -> None:
    await install(amqp_url, Installation())
    small = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"])))
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await dead_letter(channel, b"x" * (60 * 1024 * 1024), "huge")
        await dead_letter(channel, small.model_dump_json().encode(), "small")
        listed = await peek(amqp_url, [LANE], 10)
        assert [(d.message_id, d.bytes) for d in listed] == [("huge", 60 * 1024 * 1024),
                                                            ("small", len(small.model_dump_json()))]
        done = await replay(amqp_url, LANE, 10, producer="test")
        assert [letter.message_id for letter in done.replayed] == ["small"] and done.stopped is None
        assert [(s.letter.message_id, "larger than any message" in s.why) for s in done.skipped] == [("huge", True)]
        assert [d.message_id for d in await peek(amqp_url, [LANE], 10)] == ["huge"]  # kept for an operator
        lane = await channel.declare_queue(LANE, passive=True)  # single active consumer: consumed, not got
        arrived: asyncio.Queue[Any] = asyncio.Queue()
        await lane.consume(arrived.put, no_ack=True)
        assert (await asyncio.wait_for(arrived.get(), 10)).message_id == "small"
    finally:
        await connection.close()


async def test_a_submission_above_gpuorchs_limit_is_dead_lettered_and_answered(amqp_url: str) -> None:
    await install(amqp_url, Installation())
    lane = submission_lanes([], answer_invalid_submission(lambda user: "acme"))[0]
    consumer = Broker(amqp_url, producer="scheduler/test", identity="trust_all", declare_topology=False)
    connection = await aio_pika.connect(amqp_url)
    handled: list[Any] = []
    try:
        await consumer.connect(timeout_s=10)

        async def take(message: Any) -> None:
            handled.append(message)

        await consumer.consume(lane, take)
        channel = await connection.channel(publisher_confirms=True)
        answers = await channel.declare_queue("", exclusive=True)
        await answers.bind(EVENTS_EXCHANGE, "job.rejected.#")
        job_id = uuid.uuid4()
        body = json.dumps({"type": "job.submit", "job_id": str(job_id), "spec": {
            "run": {"runtime": "process", "argv": ["python"]}, "labels": {"pad": "x" * (2 * 1024 * 1024)}}}).encode()
        assert MAX_MESSAGE_BYTES < len(body) < BROKER_MAX_MESSAGE_BYTES
        submit = await channel.get_exchange(SUBMIT_EXCHANGE)
        await submit.publish(aio_pika.Message(body, message_id="big", user_id="guest"), "job.submit")
        async with asyncio.timeout(20):
            while (answer := await answers.get(no_ack=True, fail=False)) is None:
                await asyncio.sleep(0.05)
        rejected = json.loads(answer.body)
        assert rejected["job_id"] == str(job_id) and "exceeds" in rejected["reason"]
        assert answer.routing_key == "job.rejected.acme"
        [letter] = await peek(amqp_url, [LANE], 10)
        assert letter.message_id == "big" and "exceeds" in letter.reason and handled == []
    finally:
        await consumer.close()
        await connection.close()
