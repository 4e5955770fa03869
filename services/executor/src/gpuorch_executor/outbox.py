"""The executor's outbox: each placement's events wait in its record until the broker confirmed them.

Guarantees: events of one placement are published in the order they were appended; an event leaves the outbox
(and the record on disk) only after the publisher confirmed it, so publication is at-least-once across crashes;
message ids are deterministic (``domain.lifecycle.event_id``), so consumers that dedupe by ``message_id`` see
each event once. One publication of a placement's outbox runs at a time (a lock per placement).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable

from gpuorch_contracts import MESSAGE_TYPES, Message
from gpuorch_messaging.abc import Publisher, PublishError
from gpuorch_observability import get_logger

from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.placement_store import PlacementStore

log = get_logger(__name__)


class EventOutbox:
    def __init__(self, publisher: Publisher, store: PlacementStore) -> None:
        self.publisher = publisher
        self.store = store
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}

    @staticmethod
    def append(record: PlacementRecord, event: Message) -> None:
        """Queue ``event`` in ``record`` (the caller saves the record in the same write as the state it reports)."""
        record.outbox = [*record.outbox, event.model_dump(mode="json")]

    async def flush(self, record: PlacementRecord, *, raise_errors: bool = False) -> bool:
        """Publish the record's outbox in order; each event leaves the outbox only once confirmed.

        Returns whether the outbox is empty; raises ``PublishError`` when ``raise_errors`` (handlers, so that the
        command is redelivered) and leaves the rest for the publish loop otherwise.
        """
        async with self._lock(record.placement_id):
            while record.outbox:
                head = record.outbox[0]
                message = MESSAGE_TYPES[head["type"]].model_validate(head)
                headers = {"traceparent": record.traceparent} if record.traceparent else None
                try:
                    await self.publisher.publish(message, headers=headers)
                except PublishError as exc:
                    log.warning("publish.deferred", placement_id=str(record.placement_id), type=message.TYPE,
                                error=str(exc))
                    if raise_errors:
                        raise
                    return False
                if record.outbox and record.outbox[0] is head:
                    record.outbox = record.outbox[1:]
                    self.store.save(record, durable=False)
        return True

    async def flush_all(self, records: Iterable[PlacementRecord]) -> None:
        for record in list(records):
            if record.outbox:
                await self.flush(record)

    def forget(self, placement_id: uuid.UUID) -> None:
        self._locks.pop(placement_id, None)

    def _lock(self, placement_id: uuid.UUID) -> asyncio.Lock:
        return self._locks.setdefault(placement_id, asyncio.Lock())
