"""An acknowledged delivery straight from aiormq, for the consume path (``consuming.Consumers``), without aio-pika's
``IncomingMessage`` (which decodes every AMQP property, timestamps and expiration included) and the second task
aio-pika starts per delivery.

    aiormq DeliveredMessage ──► RawDelivery: body, headers, user_id, message_id, correlation_id, exchange,
                                routing_key, channel, delivery_tag; ack / nack / reject on the delivery's channel

It answers what the consume path reads of an ``IncomingMessage`` and settles the delivery the same way: once
(a second ack, nack or reject raises ``MessageProcessError``, as aio-pika's does), on the channel that delivered it
(after a reconnect that channel is closed and the broker redelivers; the ack fails there and is dropped).
"""

from __future__ import annotations

from typing import Any

from aio_pika.exceptions import MessageProcessError
from aiormq.abc import DeliveredMessage


class RawDelivery:
    """One delivery of an acknowledged queue as the consume path sees it (see the module docstring)."""

    __slots__ = ("_settled", "body", "channel", "correlation_id", "delivery_tag", "exchange", "headers",
                 "message_id", "routing_key", "user_id")

    def __init__(self, delivered: DeliveredMessage) -> None:
        properties = delivered.header.properties
        self.body: bytes = delivered.body
        self.channel: Any = delivered.channel
        self.delivery_tag: int | None = delivered.delivery_tag
        self.exchange: str | None = delivered.exchange
        self.routing_key: str | None = delivered.routing_key
        self.headers: dict[str, Any] = properties.headers or {}
        self.user_id: str | None = properties.user_id
        self.message_id: str | None = properties.message_id
        self.correlation_id: str | None = properties.correlation_id
        self._settled = False

    def _settle(self) -> None:
        if self._settled:
            raise MessageProcessError("Message already processed", self)  # type: ignore[arg-type]
        self._settled = True

    async def ack(self, multiple: bool = False) -> None:
        self._settle()
        await self.channel.basic_ack(delivery_tag=self.delivery_tag, multiple=multiple)

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self._settle()
        await self.channel.basic_nack(delivery_tag=self.delivery_tag, multiple=multiple, requeue=requeue)

    async def reject(self, requeue: bool = False) -> None:
        self._settle()
        await self.channel.basic_reject(delivery_tag=self.delivery_tag, requeue=requeue)
