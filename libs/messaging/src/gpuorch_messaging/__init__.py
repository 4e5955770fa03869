"""RabbitMQ messaging for gpuorch: confirmed publishing, consumers that dead-letter with a reason.

See ``broker.py`` for the delivery guarantees and ``abc.py`` for the interfaces handlers depend on.
"""

from gpuorch_messaging.abc import Handler, Publisher, PublishError, PublishRefused
from gpuorch_messaging.broker import (
    DEAD_LETTER_MAX_LENGTH,
    EXCHANGE_ARGUMENTS,
    EXCHANGE_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    ROUTING_KEY_HEADER,
    USER_ID_HEADER,
    Broker,
    QueueSpec,
    SenderAwareHandler,
)
from gpuorch_messaging.registry import Registry, dispatch, handler_for
from gpuorch_messaging.rejections import InvalidDelivery, answer_invalid_submission, job_id_of
from gpuorch_messaging.senders import (
    Sender,
    Speaker,
    executor_accepts,
    node_agent_accepts,
    refusal,
    scheduler_accepts,
    speaker_of,
    telemetry_accepts,
)

__all__ = [
    "DEAD_LETTER_MAX_LENGTH", "EXCHANGE_ARGUMENTS", "EXCHANGE_HEADER", "QUEUE_HEADER", "REASON_HEADER", "ROUTING_KEY_HEADER",
    "Broker", "Handler", "PublishError", "PublishRefused", "Publisher", "QueueSpec",
    "USER_ID_HEADER", "InvalidDelivery", "SenderAwareHandler", "answer_invalid_submission", "job_id_of",
    "Sender", "Speaker", "executor_accepts", "node_agent_accepts", "refusal", "scheduler_accepts", "speaker_of",
    "telemetry_accepts", "Registry", "dispatch", "handler_for",
]
