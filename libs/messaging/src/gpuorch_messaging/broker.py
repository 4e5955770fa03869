"""``Broker``: one process's RabbitMQ, as handlers and services see it (aio-pika underneath).

    Broker ──> BrokerConnection   (connection.py)   robust connection, reconnects by itself
           ├─> ConfirmedPublisher (publishing.py)   publish / publish_many / publish_raw with confirms
           ├─> Consumers          (consuming.py)    consume: judge, handle, ack or dead-letter with the reason
           └─> topology.py                          declare (development) or look up (runtime users) names

Guarantees (each module states its own in detail):
- ``publish`` returns only after the broker confirmed the message and routed it to at least one queue; a returned
  or nacked message raises ``PublishRefused`` at once; a connection lost mid-publish is retried after the
  reconnect until ``publish_timeout_s``, then ``PublishError`` (at-least-once: receivers dedupe by
  ``message_id``).
- ``consume`` acks a delivery only after the handler returned; an undecodable, invalid or refused body is
  dead-lettered at once with the reason; a handler that keeps raising is dead-lettered on its queue's last allowed
  delivery; a handler is not cancelled by a connection drop.
- Identity: every publish carries the connection's AMQP ``user_id`` (RabbitMQ refuses another). A queue with
  ``QueueSpec.accepts`` takes only those types and, with ``identity="strict"`` (the default), only from the
  senders listed for each, judged by the message's *original* publisher (``provenance.py``: a dead letter
  replayed by an operator is judged as its first publisher; a forged claim is refused). ``trust_all`` checks the
  types only (a local stack where every process is ``guest``).
- Topology: ``declare_topology=True`` (the default) declares exchanges on connect and each consumer's queue,
  dead-letter queue and bindings; ``False`` only looks them up (passive declares need no right), waiting up to
  ``topology_wait_s`` for the setup step (``topology.py``): what a least-privilege runtime user does.

This module reads no environment: services pass their ``BrokerSettings.broker_options()``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import Message, decode

from gpuorch_messaging.connection import BrokerConnection
from gpuorch_messaging.consuming import (
    ConsumerPolicy,
    Consumers,
    Decoder,
    Handler,
    PlainHandler,
    SenderAwareHandler,
)
from gpuorch_messaging.publishing import ConfirmedPublisher
from gpuorch_messaging.senders import IdentityMode
from gpuorch_messaging.topology import DEFAULT_WAIT_S, QueueSpec, declare_queue, queue_depths, unbind


@dataclass
class Broker:
    """One process's connection to RabbitMQ: a confirmed publishing channel plus one channel per consumer.

    ``identity``: ``strict`` (production) checks each queue's ``accepts`` senders; ``trust_all`` (a local stack
    where everyone is ``guest``) checks message types only. ``node_scopes``: broker users that speak for several
    nodes (user -> node ids), overriding the naming convention of ``senders.py``. ``declare_topology``: declare
    (True) or only look up (False) exchanges and consumed queues; a Broker that looks up needs no configure right
    (``gpuctl-submit``, the API, every runtime service user of a least-privilege deployment).
    """

    url: str
    producer: str = "gpuorch"
    publish_timeout_s: float = 30.0
    connection_name: str | None = None
    identity: IdentityMode = "strict"
    node_scopes: Mapping[str, Collection[str]] = field(default_factory=dict)
    declare_topology: bool = True
    topology_wait_s: float = DEFAULT_WAIT_S
    heartbeat_s: int | None = None
    """AMQP heartbeat timeout asked of the broker (None: the broker's, 60 s): a process that stops answering
    (paused) loses its connection, and with it its single-active-consumer place and unacked deliveries, after
    about this long. The scheduler leader uses its lease."""
    _link: BrokerConnection = field(init=False, repr=False)
    _publisher: ConfirmedPublisher = field(init=False, repr=False)
    _consumers: Consumers = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.identity not in ("strict", "trust_all"):
            raise ValueError(f"identity must be 'strict' or 'trust_all', not {self.identity!r}")
        self._link = BrokerConnection(self.url, self.connection_name or self.producer, heartbeat_s=self.heartbeat_s)
        self._publisher = ConfirmedPublisher(self._link, producer=self.producer,
                                             publish_timeout_s=self.publish_timeout_s)
        self._consumers = Consumers(self._link, self._publisher, ConsumerPolicy(
            identity=self.identity, node_scopes=self.node_scopes, declare=self.declare_topology,
            wait_s=self.topology_wait_s))

    # -- connection -------------------------------------------------------------------------------------------

    @property
    def user_id(self) -> str:
        """The broker user of this connection (``guest`` when the URL names none, as the AMQP client does)."""
        return self._link.user_id

    async def connect(self, *, timeout_s: float | None = 30.0) -> None:
        """Connect (retrying until ``timeout_s``; None: as long as the broker is down, as a service's start does),
        open the publishing channel and declare or look up the exchanges."""
        await self._link.connect(timeout_s=timeout_s)
        await self._publisher.open(declare=self.declare_topology, wait_s=self.topology_wait_s)

    @property
    def is_connected(self) -> bool:
        return self._link.is_connected

    @property
    def disconnected_since(self) -> float | None:
        return self._link.disconnected_since

    async def close(self) -> None:
        await self._consumers.close()
        await self._link.close()

    # -- publishing -------------------------------------------------------------------------------------------

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        """Publish with confirms and ``mandatory``; raises ``PublishError`` unless the broker took it."""
        await self._publisher.publish(message, headers=headers)

    async def publish_many(self, messages: Iterable[Message]) -> None:
        """Publish concurrently; returns when every one is confirmed, raises if any was not."""
        await self._publisher.publish_many(messages)

    async def publish_raw_batch(self, messages: Sequence[Any]) -> list[BaseException | None]:
        """A whole batch in one socket write, confirms in flight together (``ConfirmedPublisher.publish_raw_batch``;
        the outbox relay's ``BatchPublisher``)."""
        return await self._publisher.publish_raw_batch(messages)

    async def publish_raw(self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
                          headers: Mapping[str, Any] | None = None) -> None:
        """Publish bytes (the outbox relay, dead-letter replays) with the guarantees of ``publish``."""
        await self._publisher.publish_raw(exchange, routing_key, body, message_id=message_id, headers=headers)

    # -- topology and consuming -------------------------------------------------------------------------------

    async def declare_queue(self, spec: QueueSpec) -> None:
        """Declare ``spec``'s queue, its dead-letter queue and its bindings (idempotent; needs configure rights:
        the setup step, or development)."""
        channel = await self._link.channel()
        try:
            await declare_queue(channel, spec)
        finally:
            await channel.close()

    async def queue_depths(self, names: Collection[str]) -> dict[str, int]:
        """Messages in each named queue that exists (``topology.queue_depths``; no right needed)."""
        return await queue_depths(self._link, names)

    async def unbind(self, queue: str, bindings: Sequence[tuple[str, str]]) -> None:
        """Remove ``bindings`` (exchange, key) from ``queue`` where they exist: a topology change for a queue that
        outlives releases. Only when this Broker declares topology; otherwise the setup step does it."""
        if self.declare_topology:
            await unbind(self._link, queue, bindings)

    async def consume(self, spec: QueueSpec, handler: Handler | SenderAwareHandler | PlainHandler, *,
                      decoder: Decoder = decode, with_sender: bool = False) -> None:
        """Declare (or look up) the queue and start delivering to ``handler``.

        ``with_sender=True`` calls ``handler(message, publisher)`` (a ``SenderAwareHandler``), the message's
        original publisher: what admission needs to apply the identity map
        (``gpuorch_identity.authorize_submission``). Returns once consuming started; deliveries run as tasks of
        the connection's loop; a latest-wins queue's (``acknowledged=False``) may be a plain function, run inline
        as its delivery is read (``consuming.PlainHandler``).
        """
        await self._consumers.consume(spec, handler, decoder=decoder, with_sender=with_sender)
