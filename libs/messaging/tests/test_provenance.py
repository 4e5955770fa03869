"""Who first sent a message (``provenance.py``): the rules a consumer and a replay apply, table by table."""

from __future__ import annotations

import json

import pytest
from gpuorch_messaging.provenance import ORIGINAL_PUBLISHER_HEADER, judged_publisher, message_type, recorded_publisher
from gpuorch_messaging.queues import consumer_of

H = ORIGINAL_PUBLISHER_HEADER
SUBMIT = json.dumps({"type": "job.submit"}).encode()
LAUNCH = json.dumps({"type": "launch_job"}).encode()


@pytest.mark.parametrize(("user_id", "headers", "mode", "publisher", "refused"), [
    ("acme-ci", None, "strict", "acme-ci", None),                          # no claim: the verified publisher
    (None, {}, "strict", None, None),                                     # nothing verified, nothing claimed
    ("gpuctl-operator", {H: "acme-ci"}, "strict", "acme-ci", None),       # an operator's replay: the first one
    ("operator-2", {H: b"acme-ci"}, "strict", "acme-ci", None),           # headers may come as bytes
    ("gpuctl-operator", {H: ""}, "strict", None, None),                   # replay of an unidentified one: none
    ("acme-ci", {H: "research-ci"}, "strict", None, "only an operator"),  # a submitter's claim: refused
    ("executor-n1", {H: "scheduler"}, "strict", None, "role executor"),   # a service's claim: refused
    (None, {H: "research-ci"}, "strict", None, "without user_id"),
    ("guest", {H: "acme-ci"}, "trust_all", "acme-ci", None),              # development: taken as it is
    ("guest", {H: ""}, "trust_all", "guest", None),
])
def test_a_consumer_honours_an_original_publisher_only_from_a_relaying_role(
        user_id: str | None, headers: dict[str, object] | None, mode: str, publisher: str | None,
        refused: str | None) -> None:
    judged = judged_publisher(user_id, headers, mode=mode)  # type: ignore[arg-type]
    assert judged.publisher == publisher
    assert (judged.refused is None) == (refused is None)
    if refused is not None:
        assert refused in str(judged.refused)


@pytest.mark.parametrize(("queue", "letter_user", "headers", "body", "publisher", "refused"), [
    # written by the queue's consumer: the header names the first publisher
    ("scheduler.submit", "scheduler", {H: "acme-ci"}, SUBMIT, "acme-ci", None),
    ("scheduler.submit.acme", "scheduler-2", {H: "acme-ci"}, SUBMIT, "acme-ci", None),
    # dead-lettered by RabbitMQ itself (properties kept): its user_id is the first publisher
    ("scheduler.submit", "acme-ci", None, SUBMIT, "acme-ci", None),
    # published without a user_id: nobody to replay it as
    ("scheduler.submit", "scheduler", {H: ""}, SUBMIT, None, "without a user_id"),
    ("scheduler.submit", None, None, SUBMIT, None, "without a user_id"),
    # a header that names its own writer claims nothing
    ("executor.n1", "executor-n1", {H: "executor-n1"}, LAUNCH, "executor-n1", None),
    # a dead letter forged by someone who does not consume the queue
    ("scheduler.submit", "executor-n1", {H: "research-ci"}, SUBMIT, None, "not by the consumer"),
    # a node forging a submission into its own dead-letter queue: not a type its queue takes
    ("executor.n1", "executor-n1", {H: "research-ci"}, SUBMIT, None, "does not take job.submit"),
    # a queue outside gpuorch's catalogue: only its writer's own name is trusted
    ("test.lane", "guest", {H: "research-ci"}, SUBMIT, None, "not by the consumer"),
])
def test_a_replay_trusts_a_recorded_publisher_only_from_that_queues_consumer(
        queue: str, letter_user: str | None, headers: dict[str, object] | None, body: bytes,
        publisher: str | None, refused: str | None) -> None:
    judged = recorded_publisher(queue, letter_user, headers, body, accepts_of=consumer_of)
    assert judged.publisher == publisher
    assert (judged.refused is None) == (refused is None)
    if refused is not None:
        assert refused in str(judged.refused)


def test_message_type_never_raises() -> None:
    assert message_type(SUBMIT) == "job.submit"
    for body in (b"", b"[]", b'{"type": 1}', b"\xff", b"[" * 100_000):
        assert message_type(body) is None
