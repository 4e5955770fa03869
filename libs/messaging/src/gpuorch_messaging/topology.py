"""The broker's topology: gpuorch's exchanges, a queue's shape (``QueueSpec``), and the two ways to meet them.

    install (one setup identity, once per release or node):       runtime (every service, each start):
      declare_exchanges  gpuorch.{submit,events,commands,dlx}       look_up(exchanges, queues) passive declares:
                         + gpuorch.unrouted, gpuorch.submit.shared      no right needed; a missing name is waited
      declare_queue      Q.dlq (bound to gpuorch.dlx with key Q),       for (``wait_s``), then ``TopologyMissing``
                         Q (quorum arguments), Q's bindings           consume Q
      unbind             bindings a release dropped

Who declares (decision 39): a setup identity at install (``gpuctl setup broker``, or RabbitMQ's own import of
deploy/rabbitmq/definitions.json, generated from the same ``gpuorch_messaging.queues`` catalogue). Runtime users
have no ``configure`` right and no write on queues, so they can neither declare, delete nor bind anything shared;
they look names up passively. ``Broker(declare_topology=True)`` (the library's default; ``GPUORCH_BROKER_TOPOLOGY=
declare`` for a service) declares as before: development and tests, where every process is ``guest``.

RabbitMQ fixes a queue's and an exchange's arguments at first declaration (a re-declaration with others fails
``PRECONDITION_FAILED``): changing a bound means deleting the entity (or a policy), which is the setup step's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aio_pika
import aiormq.exceptions
from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    EVENTS_EXCHANGE,
    SUBMIT_EXCHANGE,
    SUBMIT_SHARED_EXCHANGE,
)
from gpuorch_observability import get_logger

from gpuorch_messaging.connection import BrokerConnection
from gpuorch_messaging.rejections import InvalidHook
from gpuorch_messaging.senders import Accepts

log = get_logger(__name__)

T = TypeVar("T")

EXCHANGES = (SUBMIT_EXCHANGE, EVENTS_EXCHANGE, COMMANDS_EXCHANGE, DEAD_LETTER_EXCHANGE)
"""The topic exchanges every publisher addresses."""
UNROUTED = "gpuorch.unrouted"
"""Alternate exchange (and bounded queue) of ``gpuorch.events``: an event nobody subscribes to yet is kept here
for inspection instead of being returned; commands have no alternate, so theirs raise (submissions go to the
shared lane, and raise when its queue does not exist yet)."""
UNROUTED_MAX_LENGTH = 10_000
UNROUTED_MAX_BYTES = 64 * 1024 * 1024
"""``gpuorch.unrouted`` keeps at most this many messages and bytes, dropping its oldest (``drop-head``): an event
nobody subscribes to is worth less the older it is, and a full alternate queue must never refuse (a nack would
block the publisher's outbox behind an event nobody wants)."""
EXCHANGE_ARGUMENTS: dict[str, dict[str, Any]] = {
    EVENTS_EXCHANGE: {"alternate-exchange": UNROUTED},
    SUBMIT_EXCHANGE: {"alternate-exchange": SUBMIT_SHARED_EXCHANGE},
}
"""Declaration arguments of the topic exchanges (every declarer must use the same: RabbitMQ refuses a
re-declaration with other arguments). ``gpuorch.submit``'s alternate is the submissions' shared lane (a fanout
the ``scheduler.submit`` queue is bound to): a key no tenant lane takes lands there instead of being returned."""
FANOUT_EXCHANGES = (UNROUTED, SUBMIT_SHARED_EXCHANGE)
DEAD_LETTER_MAX_LENGTH = 100_000
DEAD_LETTER_MAX_BYTES = 64 * 1024 * 1024
"""Default bounds of every ``Q.dlq`` (messages, bytes: 16 dead letters of the broker's largest message, or some
100,000 ordinary ones): past either the oldest dead letters are dropped (``drop-head``), so a poison flood cannot
fill the broker's disk; ``gpuctl dlq`` shows what is kept. A dead-letter queue never refuses: a refusal would send
the message back to the queue it poisoned."""
BOUNDED_QUEUES_POLICY = {
    "name": "gpuorch-bounds", "pattern": r"^(gpuorch\.unrouted|.+\.dlq)$", "apply-to": "queues", "priority": 0,
    "definition": {"max-length-bytes": DEAD_LETTER_MAX_BYTES, "overflow": "drop-head"},
}
"""The byte bound as a RabbitMQ policy, for queues declared by a release without it (arguments are fixed at a
queue's first declaration; a policy applies to existing queues, and the smaller of the two bounds wins):
deploy/rabbitmq/definitions.json carries it, or ``rabbitmqctl set_policy`` (docs/decisions.md 42)."""
BROKER_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""RabbitMQ's ``max_message_size`` in every gpuorch deployment (deploy/rabbitmq/rabbitmq.conf, the k8s
RabbitmqCluster): a larger publish is refused by the broker itself, which closes the publisher's channel with
``PRECONDITION_FAILED`` and says why (the answer to the sender). It is 16 times ``MAX_MESSAGE_BYTES`` (a dead letter
carries its body plus our headers): what gets through and is still too large for gpuorch is dead-lettered by its
consumer with the reason, answered when it names a job, and kept out of replays (``dead_letters``). RabbitMQ's
default (128 MiB) let a 60 MB dead letter stall every replay of its queue."""
DEFAULT_WAIT_S = 60.0
"""How long a runtime user waits for a name the setup step has not declared yet (they may start together)."""
Overflow = Literal["drop-head", "reject-publish"]
"""What a full quorum queue does: ``drop-head`` drops its oldest message (latest-wins state such as heartbeats);
``reject-publish`` nacks the new one, so a confirmed publisher gets ``PublishRefused`` and is told."""


class TopologyMissing(RuntimeError):
    """An exchange or queue a runtime user looks up does not exist: the setup step did not declare it."""


@dataclass(frozen=True)
class QueueSpec:
    """A consumer's own queue and what it is bound to.

    ``max_length`` with ``overflow="drop-head"`` makes a latest-wins queue (heartbeats); with
    ``overflow="reject-publish"`` a full queue refuses new messages and their publishers get ``PublishRefused``
    (back-pressure instead of a growing backlog; a quorum queue takes the one message that crosses the bound,
    then refuses). ``single_active_consumer`` lets standbys wait on the same queue
    while one consumer is active. ``dead_letter_max_length``/``dead_letter_overflow`` bound ``<name>.dlq``.

    ``accepts`` (message type -> allowed ``Sender``s, see ``senders.py``) is the queue's allow-list: None takes
    every type from anyone (a queue not yet given one). ``on_invalid`` is awaited after an undecodable body was
    dead-lettered (see ``rejections.py``). ``prefetch`` is the consumer's, not the queue's.

    ``acknowledged=False`` is for latest-wins state only (heartbeats): the consumer takes deliveries without
    acknowledgements (no ack frame per message, no prefetch window) and runs its handler inline; a delivery lost to
    a crash or a handler error is simply replaced by the next one. Invalid or refused deliveries are still
    dead-lettered with their reason. The handler must be cheap and idempotent.
    """

    name: str
    bindings: Sequence[tuple[str, str]]
    prefetch: int = 32
    delivery_limit: int = 5
    max_length: int | None = None
    overflow: Overflow = "drop-head"
    single_active_consumer: bool = False
    dead_letter: bool = True
    dead_letter_max_length: int = DEAD_LETTER_MAX_LENGTH
    dead_letter_overflow: Overflow = "drop-head"
    accepts: Accepts | None = None
    on_invalid: InvalidHook | None = None
    acknowledged: bool = True

    def __post_init__(self) -> None:
        for name, overflow in (("overflow", self.overflow), ("dead_letter_overflow", self.dead_letter_overflow)):
            if overflow not in ("drop-head", "reject-publish"):
                raise ValueError(f"{name} must be 'drop-head' or 'reject-publish' (quorum queues), not {overflow!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("max_length must be at least 1")
        if self.dead_letter_max_length < 1:
            raise ValueError("dead_letter_max_length must be at least 1")

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.name}.dlq"

    def dead_letter_arguments(self) -> dict[str, Any]:
        return {"x-queue-type": "quorum", "x-max-length": self.dead_letter_max_length,
                "x-max-length-bytes": DEAD_LETTER_MAX_BYTES, "x-overflow": self.dead_letter_overflow}

    def arguments(self) -> dict[str, Any]:
        args: dict[str, Any] = {"x-queue-type": "quorum", "x-delivery-limit": self.delivery_limit}
        if self.dead_letter:
            args["x-dead-letter-exchange"] = DEAD_LETTER_EXCHANGE
            args["x-dead-letter-routing-key"] = self.name
        if self.max_length is not None:
            args["x-max-length"] = self.max_length
            args["x-overflow"] = self.overflow
        if self.single_active_consumer:
            args["x-single-active-consumer"] = True
        return args


def unrouted_arguments() -> dict[str, Any]:
    """Arguments of the ``gpuorch.unrouted`` queue."""
    return {"x-queue-type": "quorum", "x-max-length": UNROUTED_MAX_LENGTH, "x-max-length-bytes": UNROUTED_MAX_BYTES,
            "x-overflow": "drop-head"}


# -- install: declaring (a setup identity, or any user in development) -----------------------------------------

async def declare_exchanges(channel: Any) -> dict[str, Any]:
    """Declare the exchanges (and the bounded ``gpuorch.unrouted`` queue); idempotent. Returns the topic
    exchanges by name. ``RuntimeError`` when one exists with other arguments (an older release declared it)."""
    unrouted = await channel.declare_exchange(UNROUTED, aio_pika.ExchangeType.FANOUT, durable=True)
    queue = await _declare_bounded(channel, UNROUTED, unrouted_arguments())
    await queue.bind(unrouted)
    await channel.declare_exchange(SUBMIT_SHARED_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    exchanges = {}
    for name in EXCHANGES:
        try:
            exchanges[name] = await channel.declare_exchange(
                name, aio_pika.ExchangeType.TOPIC, durable=True, arguments=EXCHANGE_ARGUMENTS.get(name))
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise RuntimeError(
                f"exchange {name} exists with other arguments than {EXCHANGE_ARGUMENTS.get(name)} (declared by an "
                f"older gpuorch): delete it once (rabbitmqadmin delete exchange name={name}) and restart: {exc}"
            ) from exc
    return exchanges


async def declare_queue(channel: Any, spec: QueueSpec) -> Any:
    """Declare the exchanges, ``spec``'s dead-letter queue, the queue and its bindings (idempotent)."""
    await declare_exchanges(channel)
    if spec.dead_letter:
        dlq = await _declare_bounded(channel, spec.dead_letter_queue, spec.dead_letter_arguments())
        await dlq.bind(DEAD_LETTER_EXCHANGE, routing_key=spec.name)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments())
    for exchange, key in spec.bindings:
        await queue.bind(exchange, routing_key=key)
    return queue


async def _declare_bounded(channel: Any, name: str, arguments: dict[str, Any]) -> Any:
    """Declare a bounded queue; one declared by an older release with other bounds (RabbitMQ refuses the
    re-declaration: ``PRECONDITION_FAILED`` closes the channel) is taken as it is, with a warning: its new bounds
    come from the ``gpuorch-bounds`` policy (``BOUNDED_QUEUES_POLICY``) or from recreating it."""
    try:
        return await channel.declare_queue(name, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        log.warning("broker.queue_bounds_differ", queue=name, wanted=arguments, error=str(exc)[:200],
                    fix="an older release declared it: the gpuorch-bounds policy bounds it (deploy/rabbitmq "
                        "definitions, or rabbitmqctl set_policy), or delete it once to recreate it")
        await channel.reopen()
        return await channel.declare_queue(name, passive=True)


async def unbind(connection: BrokerConnection, queue: str, bindings: Sequence[tuple[str, str]]) -> None:
    """Remove ``bindings`` (exchange, key) from ``queue`` where they exist (a missing queue or binding is fine),
    on a channel of its own."""
    channel = await connection.channel()
    try:
        target = await channel.get_queue(queue, ensure=False)
        for exchange, key in bindings:
            await target.unbind(exchange, routing_key=key)
    except aiormq.exceptions.ChannelClosed as exc:  # NOT_FOUND: no such queue yet; ACCESS_REFUSED: not ours
        log.debug("broker.unbind_skipped", queue=queue, reason=str(exc))
    finally:
        with contextlib.suppress(Exception):
            await channel.close()


# -- runtime: looking up (no right needed) ----------------------------------------------------------------------

async def look_up(connection: BrokerConnection, *, exchanges: Collection[str] = (), queues: Collection[str] = (),
                  wait_s: float = DEFAULT_WAIT_S) -> None:
    """Return once every named exchange and queue exists (passive declares, which need no permission); wait up
    to ``wait_s`` for the setup step, logging what is missing, then raise ``TopologyMissing``."""
    deadline = time.monotonic() + wait_s
    missing = await _missing(connection, exchanges, queues)
    warned = False
    while missing:
        if time.monotonic() >= deadline:
            raise TopologyMissing(
                f"{', '.join(missing)} not declared on the broker: topology is declared at install by the setup "
                "identity (gpuctl setup broker, or the definitions file); runtime users only look it up "
                "(GPUORCH_BROKER_TOPOLOGY=declare lets a development user with every right declare it itself)")
        if not warned:
            log.warning("broker.waiting_for_topology", missing=missing, wait_s=wait_s)
            warned = True
        await asyncio.sleep(0.5)
        missing = await _missing(connection, exchanges, queues)


async def queue_depths(connection: BrokerConnection, names: Collection[str]) -> dict[str, int]:
    """Messages in each named queue that exists (passive declares, which need no right); a missing one is left
    out. What a bounded queue's fullness is read from (``drop-head`` drops are not counted by RabbitMQ)."""
    async def depth(channel: Any, name: str) -> int:
        queue = await channel.declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count or 0)

    return {name: found for name, found in (await _passively(connection, names, depth)).items() if found is not None}


async def _missing(connection: BrokerConnection, exchanges: Collection[str], queues: Collection[str]) -> list[str]:
    """The names (``exchange X`` / ``queue Q``) that do not exist."""
    async def exchange(channel: Any, name: str) -> bool:
        await channel.get_exchange(name, ensure=True)
        return True

    async def queue(channel: Any, name: str) -> bool:
        await channel.declare_queue(name, passive=True)
        return True

    found = {f"exchange {n}": v for n, v in (await _passively(connection, exchanges, exchange)).items()}
    found.update({f"queue {n}": v for n, v in (await _passively(connection, queues, queue)).items()})
    return [name for name, exists in found.items() if exists is None]


async def _passively(connection: BrokerConnection, names: Collection[str],
                     look: Callable[[Any, str], Awaitable[T]]) -> dict[str, T | None]:
    """``look(channel, name)`` for each name, None where it does not exist (a NOT_FOUND closes its channel, so
    each name that is missing costs a new one)."""
    results: dict[str, T | None] = {}
    channel = await connection.channel()
    try:
        for name in names:
            try:
                results[name] = await look(channel, name)
            except aiormq.exceptions.ChannelNotFoundEntity:
                results[name] = None
                with contextlib.suppress(Exception):
                    await channel.close()
                channel = await connection.channel()
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    return results
