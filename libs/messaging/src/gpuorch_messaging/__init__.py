"""RabbitMQ messaging for gpuorch: confirmed publishing, consumers that dead-letter with a reason.

See ``broker.py`` for the delivery guarantees and ``abc.py`` for the interfaces handlers depend on.
"""

from gpuorch_messaging.abc import Handler, Publisher, PublishError, PublishRefused
from gpuorch_messaging.broker import (
    DEAD_LETTER_MAX_LENGTH,
    EXCHANGE_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    ROUTING_KEY_HEADER,
    Broker,
    QueueSpec,
)

__all__ = [
    "DEAD_LETTER_MAX_LENGTH", "EXCHANGE_HEADER", "QUEUE_HEADER", "REASON_HEADER", "ROUTING_KEY_HEADER",
    "Broker", "Handler", "PublishError", "PublishRefused", "Publisher", "QueueSpec",
]
