"""Interfaces of the messaging layer, so handlers and domain code depend on these and not on aio-pika.

Delivery guarantees (implemented by ``gpuorch_messaging.broker``):
- ``Publisher.publish`` returns only after the broker confirmed the message AND routed it to at least one queue
  (``mandatory``); an unroutable, nacked or unconfirmed message raises ``PublishError``. It never drops silently.
- A consumer handler is awaited before the delivery is acked; if it raises, the message is requeued and the
  queue's delivery limit eventually dead-letters it. A body that fails validation is dead-lettered at once with
  the reason in the ``x-gpuorch-dead-letter-reason`` header.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from gpuorch_contracts import Message


class PublishError(RuntimeError):
    """The broker did not take responsibility for a message (returned as unroutable, nacked, or timed out)."""

    refused = False
    """True when the broker answered no (see ``PublishRefused``); False when it never answered (connection lost,
    confirm timed out), which says nothing about the message itself."""


class PublishRefused(PublishError):
    """The broker answered no: returned as unroutable (``mandatory``), nacked (e.g. a full queue with
    ``x-overflow=reject-publish``), or refused before sending (too large). Publishing it again unchanged fails
    again until the topology changes."""

    refused = True


class Publisher(Protocol):
    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        """Publish ``message`` to the exchange and routing key given by ``gpuorch_contracts.route``."""
        ...


Handler = Callable[[Message], Awaitable[None]]
"""Applies one message; returns only when its effect is durable. Raising means 'retry later'."""
