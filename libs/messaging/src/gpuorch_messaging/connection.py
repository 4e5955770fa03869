"""One process's connection to RabbitMQ: robust, with its state visible to publishers and readiness probes.

    connect(timeout_s) ──retry every 0.5 s until timeout_s (None: for ever, backing off to 10 s)──> aio_pika robust
                       connection
        dropped ──> connected_event cleared, disconnected_since set ──> aio-pika reconnects (1 s interval),
                    re-opens its channels, re-declares what they declared ──> connected_event set again

Guarantees: ``connect`` returns connected or raises ``ConnectionError`` (the URL's password never appears in the
message); ``channel`` opens a channel on the current connection (the caller owns it); ``close`` is idempotent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection
from gpuorch_observability import get_logger

log = get_logger(__name__)


@dataclass
class BrokerConnection:
    """A robust AMQP connection and whether it is up (``is_connected``, ``connected_event``, ``disconnected_since``:
    the monotonic time it went down, None while up)."""

    url: str
    connection_name: str
    heartbeat_s: int | None = None
    """AMQP heartbeat timeout to negotiate (None: the broker's)."""
    _connection: AbstractRobustConnection | None = field(default=None, init=False, repr=False)
    connected_event: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    disconnected_since: float | None = field(default=None, init=False)

    @property
    def user_id(self) -> str:
        """The broker user of this connection (``guest`` when the URL names none, as the AMQP client does)."""
        return user_of(self.url)

    async def connect(self, *, timeout_s: float | None = 30.0) -> None:
        """Connect, retrying while the broker cannot be reached: until ``timeout_s``, then ``ConnectionError``;
        with ``timeout_s=None`` for as long as it takes (a service's start: a broker down at start is waited for,
        never a reason to exit), logging ``broker.unreachable`` at each try with a backoff doubling to 10 s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        backoff = 0.5
        while True:
            try:
                options: dict[str, Any] = {} if self.heartbeat_s is None else {"heartbeat": self.heartbeat_s}
                self._connection = await aio_pika.connect_robust(
                    self.url, client_properties={"connection_name": self.connection_name}, reconnect_interval=1.0,
                    **options)
                break
            except (OSError, aiormq.exceptions.AMQPConnectionError) as exc:
                if deadline is not None and time.monotonic() > deadline:
                    raise ConnectionError(f"cannot reach RabbitMQ at {safe_url(self.url)}: {exc}") from exc
                if deadline is None:
                    log.warning("broker.unreachable", url=safe_url(self.url), error=repr(exc)[:300], retry_s=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                else:
                    await asyncio.sleep(0.5)
        self._connection.close_callbacks.add(self._on_close)
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        self.connected_event.set()
        self.disconnected_since = None

    async def channel(self, **options: Any) -> AbstractRobustChannel:
        """A new channel (``publisher_confirms``, ``on_return_raises`` ... as aio-pika takes them)."""
        if self._connection is None:
            raise ConnectionError("broker not connected: call connect() first")
        return await self._connection.channel(**options)  # type: ignore[return-value]

    @property
    def opened(self) -> bool:
        """``connect`` succeeded and ``close`` was not called (the link may be down meanwhile)."""
        return self._connection is not None

    @property
    def is_connected(self) -> bool:
        return self._connection is not None and not self._connection.is_closed and self.connected_event.is_set()

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
        self._connection = None

    def _on_close(self, *_: Any) -> None:
        if self.disconnected_since is None:
            self.disconnected_since = time.monotonic()
        self.connected_event.clear()

    def _on_reconnect(self, *_: Any) -> None:
        self.disconnected_since = None
        self.connected_event.set()
        log.info("broker.reconnected")


def user_of(url: str) -> str:
    """The broker user an AMQP URL logs in as (``guest`` when it names none)."""
    username = urlsplit(url).username
    return unquote(username) if username else "guest"


def safe_url(url: str) -> str:
    """``url`` without its credentials (for messages and logs)."""
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
