"""Transactional outbox: messages are written with the decision that caused them and published by a relay.

Guarantees:
- ``add_to_outbox`` writes in the caller's transaction: a rolled-back decision leaves no message; a committed
  one is eventually published (no command exists without a committed decision, every committed decision is
  sent).
- Idempotent on ``message_id``: adding a message whose id is already in the outbox adds nothing.
- Rows get ids in commit order (``add_to_outbox`` takes the same write-order lock as ``events.append``, inside its
  one ``INSERT`` statement), and
  the relay publishes in id order: a message is published only after every earlier row was confirmed.
  With ``pipeline=True`` (the scheduler's relay) a whole batch is published before its confirms are awaited, on
  one channel (in one ``publish_raw_batch`` call when the publisher is a ``BatchPublisher``), so the broker still
  routes it in id order and a batch starts only after the one before was confirmed or parked; but a failed row is retried after rows of its batch that followed it (order holds except
  around a failure). That is what makes thousands of rows a second possible: one round trip per batch.
- The relay marks a row sent only after the publisher returned (broker confirm + routed), in the same
  transaction that locked the row. A failed publish leaves the row unsent (``attempts``/``last_error``
  updated) and stops the batch there (pipelined: ends it with an error); the relay retries it after an
  exponential backoff. A crash between publish and commit republishes: delivery is at-least-once and receivers
  dedupe by ``message_id``.
- One undeliverable row never blocks the outbox: a row the broker *refused* (returned as unroutable, nacked; see
  ``is_refusal``) ``park_after`` times is parked (``parked_at`` set, never published, never purged) and the rows
  after it flow. Order is kept otherwise: a row is published only after every earlier row was confirmed or
  parked. A broker outage (no answer, connection lost) never counts towards parking: it only delays.
- Each parked row is handed to the ``on_parked`` hook after the parking committed, until the hook returns
  (``parked_reported_at``): at-least-once, so the hook must be idempotent (e.g. fail or requeue the job only if
  its placement is still the one the message was about). A hook that raises is called again on a later pass.
  ``parked_rows``/``outbox_backlog`` (and ``gpuctl db status``) show what is parked and why.
- Only one relay publishes at a time per database (a transaction advisory lock; the rows are also taken ``FOR
  UPDATE SKIP LOCKED``); standby relays find the lock taken and wait.
- Sent rows are deleted after a retention period by ``purge_sent`` (the relay does it periodically).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from gpuorch_contracts import MAX_MESSAGE_BYTES, Message, decode, encode, route

from gpuorch_store.events import _INSERT as _EVENTS_INSERT
from gpuorch_store.events import EVENT_WRITE_LOCK_KEY, LOCKED_FIRST, NewEvent, event_columns

OUTBOX_CHANNEL = "gpuorch_outbox"
"""NOTIFY channel signalled (by a trigger, at commit) whenever outbox rows are inserted."""

RELAY_LOCK_KEY = 0x67707552_0000_0003
"""Transaction advisory lock key held by the relay that is publishing a batch."""

log = logging.getLogger(__name__)


class RawPublisher(Protocol):
    async def publish_raw(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str, headers: dict[str, Any]
    ) -> None:
        """Return only once the broker confirmed and routed the message; raise on any failure."""
        ...


@dataclass(frozen=True)
class OutgoingMessage:
    """An outbox row as a ``BatchPublisher`` receives it (the arguments of one ``publish_raw``)."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    headers: dict[str, Any]


class BatchPublisher(RawPublisher, Protocol):
    """A publisher that can also take a pipelined relay's whole batch at once (e.g. every message's frames in one
    socket write, every confirm in flight together), instead of one ``publish_raw`` call, and task, per row."""

    async def publish_raw_batch(self, messages: Sequence[OutgoingMessage]) -> Sequence[BaseException | None]:
        """Publish ``messages`` in order on one channel; return once each is settled, one outcome per message,
        in order: ``None`` once the broker confirmed and routed it, else the exception ``publish_raw`` would have
        raised for it (``is_refusal`` tells a refusal from an outage). Never raises for one message's failure."""
        ...


def is_refusal(exc: BaseException) -> bool:
    """Whether a failed publish was the broker saying no to this message (counts towards parking).

    An exception's own ``refused`` attribute decides (``gpuorch_messaging.PublishRefused`` is refused, a
    ``PublishError`` the broker never answered is not); without one, ``OSError``/``TimeoutError`` are outages and
    anything else is a refusal.
    """
    refused = getattr(exc, "refused", None)
    if isinstance(refused, bool):
        return refused
    return not isinstance(exc, (OSError, TimeoutError))


@dataclass(frozen=True)
class ParkedRow:
    """An outbox row set aside after ``park_after`` refusals: it was never published and never will be."""

    id: int
    message_id: uuid.UUID
    type: str
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    attempts: int
    refusals: int
    last_error: str | None
    created_at: datetime
    parked_at: datetime

    @property
    def message(self) -> Message:
        """The message as it was added (e.g. the ``LaunchJob`` whose job must now be failed or requeued)."""
        return decode(self.body)


OnParked = Callable[[ParkedRow], Awaitable[None]]
"""Called once a row is parked (after the commit), until it returns; at-least-once, so be idempotent."""

_PARKED_COLUMNS = """
    id, message_id, type, exchange, routing_key, body, headers::text AS headers, attempts, refusals, last_error,
    created_at, parked_at
"""


def _parked_row(row: Any) -> ParkedRow:
    return ParkedRow(
        id=row["id"], message_id=row["message_id"], type=row["type"], exchange=row["exchange"],
        routing_key=row["routing_key"], body=bytes(row["body"]), headers=json.loads(row["headers"]),
        attempts=row["attempts"], refusals=row["refusals"], last_error=row["last_error"],
        created_at=row["created_at"], parked_at=row["parked_at"],
    )


async def parked_rows(conn_or_pool: Any, *, limit: int = 10) -> list[ParkedRow]:
    """The newest ``limit`` parked rows, newest first."""
    rows = await conn_or_pool.fetch(
        f"SELECT {_PARKED_COLUMNS} FROM outbox WHERE sent_at IS NULL AND parked_at IS NOT NULL "
        "ORDER BY parked_at DESC, id DESC LIMIT $1",
        limit,
    )
    return [_parked_row(r) for r in rows]


_INSERT = """
INSERT INTO outbox (message_id, type, exchange, routing_key, body, headers)
SELECT o.message_id, o.type, o.exchange, o.routing_key, o.body, o.headers::jsonb
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[])
     WITH ORDINALITY AS o(message_id, type, exchange, routing_key, body, headers, ordinal)
WHERE """ + LOCKED_FIRST.format(key="$7") + """
ORDER BY o.ordinal
ON CONFLICT (message_id) DO NOTHING
RETURNING id
"""


async def add_to_outbox(conn: Any, messages: Sequence[Message],
                        headers: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                        bodies: Sequence[bytes] | None = None) -> list[int]:
    """Queue ``messages`` for publishing, in order, in ``conn``'s transaction (one statement); return the new row
    ids.

    Exchange and routing key come from ``gpuorch_contracts.route``, the body from ``encode``. ``headers``
    (e.g. a ``traceparent``; one mapping for all, or one per message) are stored with each message, plus ``type``
    (the message type, as
    ``Broker.publish`` sets it), and passed to the publisher. ``bodies``, when given, are the messages already
    encoded (``encode(message)``; a caller that logged them has the JSON). Raises ``ValueError``
    for a body over ``MAX_MESSAGE_BYTES`` (it could never be published). Messages already in the outbox are
    skipped.
    """
    if not messages:
        return []
    if not conn.is_in_transaction():
        async with conn.transaction():
            return await add_to_outbox(conn, messages, headers, bodies)
    rows = await conn.fetch(_INSERT, *_outbox_columns(messages, headers, bodies), EVENT_WRITE_LOCK_KEY)
    return [int(r["id"]) for r in rows]


def _outbox_columns(messages: Sequence[Message], headers: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                    bodies: Sequence[bytes] | None) -> tuple[list[Any], ...]:
    """The outbox rows of ``messages`` as the six column arrays of ``_INSERT`` (``$1``..``$6``); raises
    ``ValueError`` for a body over ``MAX_MESSAGE_BYTES``."""
    per_message = list(headers) if isinstance(headers, Sequence) else [headers or {}] * len(messages)
    bodies = list(bodies) if bodies is not None else [encode(m) for m in messages]
    for message, body in zip(messages, bodies, strict=True):
        if len(body) > MAX_MESSAGE_BYTES:
            raise ValueError(f"{message.type} {message.message_id} is {len(body)} bytes > {MAX_MESSAGE_BYTES}")
    routes = [route(m) for m in messages]
    return ([m.message_id for m in messages], [m.type for m in messages], [exchange for exchange, _ in routes],
            [key for _, key in routes], bodies,
            [json.dumps({**h, "type": m.type}) for m, h in zip(messages, per_message, strict=True)])


_APPEND_WITH_OUTBOX = (
    "WITH logged AS (" + _EVENTS_INSERT.replace("$8", "$14") + "), queued AS ("
    + re.sub(r"\$(\d+)", lambda p: f"${int(p.group(1)) + 7}", _INSERT)
    + ") SELECT position, message_id FROM logged UNION ALL SELECT id, NULL FROM queued"
)
"""Both inserts in one statement (two data-modifying CTEs, each taking the write-order lock before it draws an id,
as alone): one round trip where ``append`` then ``add_to_outbox`` took two."""


async def append_with_outbox(conn: Any, events: Sequence[NewEvent], messages: Sequence[Message],
                             headers: Sequence[Mapping[str, Any]] | None = None,
                             bodies: Sequence[bytes] | None = None) -> list[int | None]:
    """``append_reporting_duplicates(conn, events)`` and ``add_to_outbox(conn, messages, headers, bodies)`` in
    one statement, with the guarantees of each (the same transaction, write-order lock, idempotence, id order).
    Returns, per event, its new position or ``None`` for a duplicate. Raises ``ValueError`` as ``add_to_outbox``
    does (nothing written)."""
    if not events and not messages:
        return []
    if not conn.is_in_transaction():
        async with conn.transaction():
            return await append_with_outbox(conn, events, messages, headers, bodies)
    queued = _outbox_columns(messages, headers, bodies)
    rows = await conn.fetch(_APPEND_WITH_OUTBOX, *event_columns(events), *queued, EVENT_WRITE_LOCK_KEY)
    inserted = {row["message_id"]: row["position"] for row in rows if row["message_id"] is not None}
    return [inserted.pop(event.message_id, None) for event in events]


_TAKE_BATCH = """
SELECT relay.held, o.id, o.message_id, o.exchange, o.routing_key, o.body, o.headers
FROM (SELECT pg_try_advisory_xact_lock($2) AS held) AS relay
LEFT JOIN LATERAL (
    SELECT id, message_id, exchange, routing_key, body, headers::text AS headers
    FROM outbox WHERE relay.held AND sent_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT $1
    FOR UPDATE SKIP LOCKED
) AS o ON true
ORDER BY o.id
"""
"""A relay's batch in one round trip: the relay lock (tried first; ``held`` false: another relay publishes, no row
is locked) and up to ``$1`` waiting rows in id order, locked; one row of NULLs when none waits."""


@dataclass(frozen=True)
class RelayBatch:
    """Outcome of one ``relay_once``: ``sent`` rows confirmed and marked; ``error`` of the row that stopped the
    batch (or of the ``on_parked`` hook); ``parked`` rows set aside in this batch."""

    sent: int
    error: str | None = None
    parked: int = 0
    busy: bool = False
    """Another relay held the relay lock; nothing was attempted."""
    more: bool = False
    """The batch was full: more unsent rows are probably waiting."""


@dataclass(frozen=True)
class OutboxBacklog:
    unsent: int
    """Rows waiting to be published (parked rows not included)."""
    oldest_unsent_at: datetime | None
    failing_attempts: int
    """Failed attempts of the head waiting row (the one the relay retries now), 0 if it never failed."""
    last_error: str | None
    parked: int = 0
    """Rows set aside after ``park_after`` refusals (see ``parked_rows``)."""


async def outbox_backlog(conn_or_pool: Any) -> OutboxBacklog:
    """How many rows wait, since when, the attempts/error of the head waiting row, and how many are parked."""
    row = await conn_or_pool.fetchrow(
        """
        SELECT count(*) FILTER (WHERE parked_at IS NULL) AS unsent,
               min(created_at) FILTER (WHERE parked_at IS NULL) AS oldest,
               count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
               (SELECT attempts FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT 1)
                   AS attempts,
               (SELECT last_error FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT 1)
                   AS last_error
        FROM outbox WHERE sent_at IS NULL
        """
    )
    return OutboxBacklog(row["unsent"], row["oldest"], row["attempts"] or 0, row["last_error"], row["parked"])


async def purge_sent(conn_or_pool: Any, older_than: timedelta) -> int:
    """Delete rows sent more than ``older_than`` ago; return how many. Unsent rows are never deleted."""
    result = await conn_or_pool.execute(
        "DELETE FROM outbox WHERE sent_at IS NOT NULL AND sent_at < now() - $1::interval", older_than
    )
    return int(result.split()[-1])


class OutboxRelay:
    """Publishes outbox rows in id order through ``publisher`` and marks them sent.

    ``run_forever`` loops: publish a batch; when idle, wait for a NOTIFY on ``OUTBOX_CHANNEL`` or
    ``poll_interval``; after a failure, back off exponentially from ``retry_initial`` up to ``retry_max``.
    A row refused ``park_after`` times is parked and handed to ``on_parked`` (see the module docstring): with
    the defaults that is about 3 s (0.2 + 0.4 + 0.8 + 1.6) of head-of-line waiting at most.
    ``stop()`` makes it return after the current batch. ``relay_once`` publishes one batch (tests, or callers
    with their own loop). The LISTEN holds one pooled connection for the relay's lifetime, so give the pool at
    least two (with one, the relay only polls).
    """

    def __init__(
        self,
        pool: Any,
        publisher: RawPublisher,
        *,
        batch_size: int = 100,
        poll_interval: float = 1.0,
        retry_initial: float = 0.2,
        retry_max: float = 30.0,
        retention: timedelta | None = timedelta(hours=24),
        retention_every: timedelta = timedelta(minutes=10),
        park_after: int = 5,
        on_parked: OnParked | None = None,
        pipeline: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if park_after < 1:
            raise ValueError("park_after must be at least 1")
        self._park_after = park_after
        self._on_parked = on_parked
        self._pipeline = pipeline
        self._pool = pool
        self._publisher = publisher
        self._batch_size = batch_size
        self._poll_interval = poll_interval
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._retention = retention
        self._retention_every = retention_every
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    async def relay_once(self) -> RelayBatch:
        """Publish up to ``batch_size`` waiting rows in id order; commit ``sent_at`` for those confirmed.

        A failing row gets ``attempts`` + 1 and ``last_error`` (and ``refusals`` + 1 if the broker refused it):
        once refused ``park_after`` times it is parked and the batch goes on; otherwise the batch stops there.
        Then parked rows not yet reported are handed to ``on_parked``.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            taken = await conn.fetch(_TAKE_BATCH, self._batch_size, RELAY_LOCK_KEY)
            if not taken[0]["held"]:
                return RelayBatch(sent=0, busy=True)
            rows = [row for row in taken if row["id"] is not None]
            sent_ids: list[int] = []
            parked = 0
            error: str | None = None
            if self._pipeline:  # all at once; the broker still routes them in id order (one channel)
                outcomes = await self._publish_together(rows)
            for k, row in enumerate(rows):
                if self._pipeline:
                    outcome = outcomes[k]
                else:
                    try:
                        await self._publish_row(row)
                        outcome = None
                    except Exception as exc:
                        outcome = exc
                if outcome is None:
                    sent_ids.append(row["id"])
                    continue
                if isinstance(outcome, asyncio.CancelledError) and _cancelling():
                    raise outcome
                failure = f"{type(outcome).__name__}: {outcome}"[:2000]
                if await self._record_failure(conn, row, outcome, failure):
                    parked += 1
                    continue
                error = error or failure
                if not self._pipeline:
                    break  # strict order: nothing after it is published
            if sent_ids:
                await conn.execute(
                    """
                    UPDATE outbox SET sent_at = now(), attempts = attempts + 1, last_attempt_at = now()
                    WHERE id = ANY($1::bigint[])
                    """,
                    sent_ids,
                )
            more = error is None and len(rows) == self._batch_size
        report_error = await self.report_parked()
        return RelayBatch(sent=len(sent_ids), error=error or report_error, parked=parked, more=more)

    async def _record_failure(self, conn: Any, row: Any, outcome: BaseException, failure: str) -> bool:
        """Count a failed attempt on ``row``; park it once refused ``park_after`` times. True if now parked."""
        parked_at = await conn.fetchval(
            """
            UPDATE outbox SET attempts = attempts + 1, last_attempt_at = now(), last_error = $2,
                   refusals = refusals + $3::int,
                   parked_at = CASE WHEN refusals + $3::int >= $4::int THEN now() END
            WHERE id = $1
            RETURNING parked_at
            """,
            row["id"], failure, int(isinstance(outcome, Exception) and is_refusal(outcome)), self._park_after,
        )
        if parked_at is not None:
            log.error("outbox row %s parked after %d refusals, later rows go on: %s",
                      row["id"], self._park_after, failure)
            return True
        log.warning("outbox publish failed for row %s: %s", row["id"], failure)
        return False

    async def _publish_row(self, row: Any) -> None:
        await self._publisher.publish_raw(
            row["exchange"], row["routing_key"], bytes(row["body"]), message_id=str(row["message_id"]),
            headers=json.loads(row["headers"]),
        )

    async def _publish_together(self, rows: Sequence[Any]) -> list[BaseException | None]:
        """Publish a pipelined batch, every confirm in flight together: through ``publish_raw_batch`` in one call
        when the publisher has it (``BatchPublisher``), else one concurrent ``publish_raw`` per row. One outcome
        per row, in order."""
        if not rows:
            return []
        publish_batch = getattr(self._publisher, "publish_raw_batch", None)
        if publish_batch is None:
            return list(await asyncio.gather(*(self._publish_row(row) for row in rows), return_exceptions=True))
        outcomes = list(await publish_batch([
            OutgoingMessage(row["exchange"], row["routing_key"], bytes(row["body"]), str(row["message_id"]),
                            json.loads(row["headers"])) for row in rows]))
        if len(outcomes) != len(rows):
            raise RuntimeError(f"publish_raw_batch answered {len(outcomes)} outcomes for {len(rows)} messages")
        return outcomes

    async def report_parked(self) -> str | None:
        """Hand each parked, unreported row to ``on_parked``; mark it reported once the hook returned. The relay
        does this after each batch; a process that only answers parked rows (its relay runs elsewhere) calls it."""
        if self._on_parked is None:
            return None
        rows = await self._pool.fetch(
            f"SELECT {_PARKED_COLUMNS} FROM outbox "
            "WHERE sent_at IS NULL AND parked_at IS NOT NULL AND parked_reported_at IS NULL ORDER BY id LIMIT 100"
        )
        for row in rows:
            parked = _parked_row(row)
            try:
                await self._on_parked(parked)
            except Exception as exc:
                log.warning("outbox on_parked hook failed for row %s (called again later): %r", parked.id, exc)
                return f"on_parked failed for row {parked.id}: {type(exc).__name__}: {exc}"[:2000]
            await self._pool.execute("UPDATE outbox SET parked_reported_at = now() WHERE id = $1", parked.id)
        return None

    def stop(self) -> None:
        """Ask ``run_forever`` to return after the batch in progress (safe to call from any task)."""
        self._stopping.set()
        self._wake.set()

    async def run_forever(self) -> None:
        """Relay until ``stop()``; database errors are logged and retried with backoff, never raised."""
        listen_conn: Any = None
        failures = 0
        loop = asyncio.get_running_loop()
        next_purge = loop.time()
        try:
            while not self._stopping.is_set():
                if listen_conn is not None and _closed(listen_conn):
                    await self._unlisten(listen_conn)
                    listen_conn = None
                if listen_conn is None:
                    listen_conn = await self._listen()
                self._wake.clear()
                try:
                    batch = await self.relay_once()
                    if self._retention is not None and loop.time() >= next_purge:
                        await purge_sent(self._pool, self._retention)
                        next_purge = loop.time() + self._retention_every.total_seconds()
                except Exception as exc:
                    log.warning("outbox relay database error: %s", exc)
                    batch = RelayBatch(sent=0, error=str(exc))
                if batch.error is not None:
                    failures += 1
                    delay = min(self._retry_max, self._retry_initial * 2 ** (failures - 1))
                    await self._sleep(delay, wake_on_notify=False)
                    continue
                failures = 0
                if batch.more:
                    continue
                await self._sleep(self._poll_interval, wake_on_notify=True)
        finally:
            if listen_conn is not None:
                await self._unlisten(listen_conn)

    async def _sleep(self, seconds: float, *, wake_on_notify: bool) -> None:
        event = self._wake if wake_on_notify else self._stopping
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=seconds)

    def _on_notify(self, *_args: Any) -> None:
        self._wake.set()

    async def _listen(self) -> Any:
        """A pooled connection LISTENing on ``OUTBOX_CHANNEL``, or None (then the relay only polls).

        With a pool of one connection the relay never listens: holding the only connection would starve
        ``relay_once``.
        """
        max_size = getattr(self._pool, "get_max_size", lambda: 2)()
        if max_size < 2:
            return None
        try:
            conn = await self._pool.acquire()
        except Exception as exc:
            log.warning("outbox relay cannot LISTEN, polling only: %s", exc)
            return None
        try:
            await conn.add_listener(OUTBOX_CHANNEL, self._on_notify)
        except Exception as exc:
            log.warning("outbox relay cannot LISTEN, polling only: %s", exc)
            await self._pool.release(conn)
            return None
        return conn

    async def _unlisten(self, conn: Any) -> None:
        with contextlib.suppress(Exception):
            await conn.remove_listener(OUTBOX_CHANNEL, self._on_notify)
        with contextlib.suppress(Exception):
            await self._pool.release(conn)


def _closed(conn: Any) -> bool:
    """Whether a pooled connection is gone: closed, or (its session terminated) already detached by the pool."""
    try:
        return bool(conn.is_closed())
    except Exception:  # noqa: BLE001 - asyncpg's InterfaceError for a proxy the pool took back
        return True


def _cancelling() -> bool:
    """Is the current task itself being cancelled (rather than a publish's confirm cancelled under it)?"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
