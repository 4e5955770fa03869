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
import functools
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
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
    read_interval_s: float | None = None
    """Once ``pace_reads`` was called: read the socket at most once per this many seconds, taking everything that
    arrived meanwhile in one read (``PacedReads``). For a connection that carries only latest-wins state
    (heartbeats): one wake-up per interval instead of one per message; each message waits at most this long."""
    _connection: AbstractRobustConnection | None = field(default=None, init=False, repr=False)
    connected_event: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _pacing: PacedReads | None = field(default=None, init=False, repr=False)
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
                if self.read_interval_s is not None:
                    self._pacing = PacedReads(self.read_interval_s)
                    options["connection_class"] = functools.partial(_PacedConnection, pacing=self._pacing)
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

    def pace_reads(self) -> None:
        """Start pacing this connection's reads (``read_interval_s``; nothing without it): called once its
        consumers are set up, so that setting them up is not slowed by an interval per reply."""
        if self._pacing is not None:
            self._pacing.enabled = True

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


class PacedReads(TransportFactory):
    """aiormq's transport (TCP or TLS by the URL's scheme) whose socket is read at most once per ``interval_s``
    once ``enabled``: after each read, reading pauses for the interval and then takes everything that arrived
    (``pause_reading``/``resume_reading``; the kernel holds the bytes meanwhile, and RabbitMQ's flow control
    applies as for any slow reader). Every frame is still read, in order; each waits at most ``interval_s``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.enabled = False

    async def create(self, url: Any, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        inner = TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        reader, writer = await inner.create(url, **kwargs)
        transport: Any = writer.transport  # a read-write transport (WriteTransport is its declared type)
        loop = asyncio.get_running_loop()
        protocol: Any = transport.get_protocol()
        received = protocol.data_received

        def resume() -> None:
            if not transport.is_closing():
                transport.resume_reading()

        def data_received(data: bytes) -> None:
            received(data)
            if self.enabled and not transport.is_closing() and transport.is_reading():
                transport.pause_reading()
                loop.call_later(self.interval_s, resume)

        protocol.data_received = data_received
        return reader, writer


class _PacedConnection(aio_pika.RobustConnection):
    """A robust connection whose every (re)connection reads through ``pacing``."""

    def __init__(self, url: Any, loop: Any = None, *, pacing: PacedReads, **kwargs: Any) -> None:
        super().__init__(url, loop, **kwargs)
        self.kwargs["transport_factory"] = pacing


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
