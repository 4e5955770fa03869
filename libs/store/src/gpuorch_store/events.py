"""The append-only event log: idempotent appends in the caller's transaction, reads in global order.

Guarantees:
- ``append`` writes inside the caller's transaction (or its own, if the connection is not in one): the events
  commit or vanish together with whatever else that transaction wrote (state, outbox rows).
- Idempotent on ``message_id``: appending an event whose ``message_id`` is already stored (or appears earlier
  in the same batch) inserts nothing for it. ``append`` returns the positions of the rows it inserted;
  ``append_reporting_duplicates`` returns one entry per input, ``None`` for a duplicate.
- One statement per append, whatever the batch size: the rows go in as arrays (``unnest``), and the statement takes
  the write-order lock itself before it produces its first row (an uncorrelated sub-select in its ``WHERE``, which
  PostgreSQL evaluates once, first), so an append is one round trip.
- Gap-safe global order for readers: every append first takes the transaction-level advisory lock
  ``EVENT_WRITE_LOCK_KEY``, so positions are assigned in commit order. A reader that has seen position P will
  never later find a committed event with a position below P; ``read(after_position=P)`` therefore never skips
  an event. Positions may have holes (a rolled-back append consumes sequence values); readers must not expect
  ``P + 1``. The lock is held until the caller's transaction ends: append late in the transaction and commit
  promptly. Writers are serialized, which suits one active scheduler committing once per cycle.
- Rows are never updated or deleted (a trigger refuses UPDATE/DELETE).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpuorch_contracts import Message, decode

EVENT_WRITE_LOCK_KEY = 0x67707552_0000_0002
"""Transaction advisory lock key taken by every event (and outbox) write; orders positions by commit."""


@dataclass(frozen=True)
class NewEvent:
    """An event to append; ``payload`` JSON-serializable (or already a JSON text), ``headers`` JSON-serializable,
    ``occurred_at`` timezone-aware."""

    stream: str
    message_id: uuid.UUID
    type: str
    schema_version: int
    occurred_at: datetime
    payload: Mapping[str, Any] | str
    headers: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stream:
            raise ValueError("an event needs a stream")
        if self.occurred_at.tzinfo is None:
            raise ValueError("occurred_at must be timezone-aware")

    @classmethod
    def from_message(
        cls, stream: str, message: Message, *, headers: Mapping[str, Any] | None = None
    ) -> NewEvent:
        """The whole message (envelope included) is the payload; ``StoredEvent.to_message`` rebuilds it."""
        return cls(
            stream=stream,
            message_id=message.message_id,
            type=message.type,
            schema_version=message.schema_version,
            occurred_at=message.occurred_at,
            payload=message.model_dump_json(),
            headers=dict(headers or {}),
        )


@dataclass(frozen=True)
class StoredEvent:
    position: int
    stream: str
    message_id: uuid.UUID
    type: str
    schema_version: int
    occurred_at: datetime
    recorded_at: datetime
    payload: dict[str, Any]
    headers: dict[str, Any]

    def to_message(self) -> Message:
        """Decode the payload as a contract message (for events appended via ``NewEvent.from_message``)."""
        return decode(json.dumps(self.payload))


async def take_write_order_lock(conn: Any) -> None:
    """Take the event/outbox write-order lock for the rest of ``conn``'s transaction (re-entrant). ``append`` and
    ``add_to_outbox`` take it inside their own statement (``LOCKED_FIRST``); this is for other writers."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", EVENT_WRITE_LOCK_KEY)


LOCKED_FIRST = "(SELECT pg_advisory_xact_lock({key}::bigint)) IS NOT NULL"
"""A ``WHERE`` condition that takes the write-order lock (parameter ``{key}``) before the statement produces a row:
an uncorrelated sub-select is a one-time filter, evaluated once before the rows it guards, so the lock is held
before any ``position``/``id`` is drawn from its sequence."""


_INSERT = """
INSERT INTO events (stream, message_id, type, schema_version, occurred_at, payload, headers)
SELECT e.stream, e.message_id, e.type, e.schema_version, e.occurred_at, e.payload::jsonb, e.headers::jsonb
FROM unnest($1::text[], $2::uuid[], $3::text[], $4::int[], $5::timestamptz[], $6::text[], $7::text[])
     WITH ORDINALITY AS e(stream, message_id, type, schema_version, occurred_at, payload, headers, ordinal)
WHERE """ + LOCKED_FIRST.format(key="$8") + """
ORDER BY e.ordinal
ON CONFLICT (message_id) DO NOTHING
RETURNING position, message_id
"""


async def append_reporting_duplicates(conn: Any, events: Sequence[NewEvent]) -> list[int | None]:
    """Append ``events`` in order, in one statement; return, per input event, its new position or ``None`` for a
    duplicate.

    ``conn`` is an asyncpg connection; the write joins its open transaction, or runs in its own.
    """
    if not events:
        return []
    if not conn.is_in_transaction():
        async with conn.transaction():
            return await append_reporting_duplicates(conn, events)
    rows = await conn.fetch(_INSERT, *event_columns(events), EVENT_WRITE_LOCK_KEY)
    inserted = {row["message_id"]: row["position"] for row in rows}
    result: list[int | None] = []
    for event in events:
        result.append(inserted.pop(event.message_id, None))
    return result


def event_columns(events: Sequence[NewEvent]) -> tuple[list[Any], ...]:
    """``events`` as the seven column arrays of the append statement (``$1``..``$7``)."""
    return ([e.stream for e in events], [e.message_id for e in events], [e.type for e in events],
            [e.schema_version for e in events], [e.occurred_at for e in events],
            [e.payload if isinstance(e.payload, str) else json.dumps(e.payload) for e in events],
            [json.dumps(e.headers) for e in events])


async def append(conn: Any, events: Sequence[NewEvent]) -> list[int]:
    """Append ``events``; return the positions of the rows actually inserted, in input order.

    Events whose ``message_id`` is already stored are skipped (an empty list for one event means "duplicate").
    """
    return [p for p in await append_reporting_duplicates(conn, events) if p is not None]


_READ = """
SELECT position, stream, message_id, type, schema_version, occurred_at, recorded_at,
       payload::text AS payload, headers::text AS headers
FROM events
WHERE position > $1 AND ($3::text IS NULL OR stream = $3)
ORDER BY position
LIMIT $2
"""


async def read(
    conn_or_pool: Any, after_position: int = 0, limit: int = 1000, stream: str | None = None
) -> list[StoredEvent]:
    """Events with ``position > after_position`` (optionally of one stream), ascending, at most ``limit``.

    To follow the log, pass the last position you received as ``after_position``; no event is ever skipped
    (see the module docstring).
    """
    rows = await conn_or_pool.fetch(_READ, after_position, limit, stream)
    return [
        StoredEvent(
            position=r["position"],
            stream=r["stream"],
            message_id=r["message_id"],
            type=r["type"],
            schema_version=r["schema_version"],
            occurred_at=r["occurred_at"],
            recorded_at=r["recorded_at"],
            payload=json.loads(r["payload"]),
            headers=json.loads(r["headers"]),
        )
        for r in rows
    ]


async def last_position(conn_or_pool: Any, stream: str | None = None) -> int:
    """The highest committed position (of ``stream``, if given), 0 for an empty log."""
    value = await conn_or_pool.fetchval(
        "SELECT coalesce(max(position), 0) FROM events WHERE $1::text IS NULL OR stream = $1", stream
    )
    return int(value)
