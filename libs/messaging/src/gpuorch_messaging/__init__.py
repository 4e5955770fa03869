"""RabbitMQ messaging for gpuorch: confirmed publishing, consumers that dead-letter with a reason, identity kept
from the first publisher, and the topology a setup step declares.

Modules: ``broker`` (the ``Broker`` services use), ``connection``, ``publishing``, ``consuming``, ``topology``
(exchanges, ``QueueSpec``, declare or look up), ``queues`` (every gpuorch queue), ``senders`` (who may say what),
``provenance`` (who first said it), ``dead_letters`` (list, replay), ``rejections``, ``registry``, ``settings``;
``abc`` holds the interfaces handlers depend on.
"""

from gpuorch_messaging.abc import Handler, Publisher, PublishError, PublishRefused
from gpuorch_messaging.broker import Broker
from gpuorch_messaging.consuming import (
    EXCHANGE_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    ROUTING_KEY_HEADER,
    USER_ID_HEADER,
    SenderAwareHandler,
)
from gpuorch_messaging.provenance import ORIGINAL_PUBLISHER_HEADER, RELAYING_ROLES, judged_publisher
from gpuorch_messaging.queues import (
    Installation,
    executor_queue,
    node_agent_queue,
    scheduler_queues,
    submission_lanes,
    telemetry_queue,
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
from gpuorch_messaging.settings import BrokerSettings
from gpuorch_messaging.topology import (
    DEAD_LETTER_MAX_LENGTH,
    EXCHANGE_ARGUMENTS,
    QueueSpec,
    TopologyMissing,
)

__all__ = [
    "DEAD_LETTER_MAX_LENGTH", "EXCHANGE_ARGUMENTS", "EXCHANGE_HEADER", "QUEUE_HEADER", "REASON_HEADER", "ROUTING_KEY_HEADER",
    "ORIGINAL_PUBLISHER_HEADER", "RELAYING_ROLES", "USER_ID_HEADER",
    "Broker", "BrokerSettings", "Handler", "PublishError", "PublishRefused", "Publisher", "QueueSpec", "TopologyMissing",
    "InvalidDelivery", "SenderAwareHandler", "answer_invalid_submission", "job_id_of", "judged_publisher",
    "Sender", "Speaker", "executor_accepts", "node_agent_accepts", "refusal", "scheduler_accepts", "speaker_of",
    "telemetry_accepts", "Registry", "dispatch", "handler_for",
    "Installation", "executor_queue", "node_agent_queue", "scheduler_queues", "submission_lanes", "telemetry_queue",
]
