"""gpuorch event store on PostgreSQL: migrations, the append-only event log, snapshots, and the outbox relay.

See README.md for the tables, the guarantees, and the pipeline.
"""

from gpuorch_store.events import (
    EVENT_WRITE_LOCK_KEY,
    NewEvent,
    StoredEvent,
    append,
    append_reporting_duplicates,
    last_position,
    read,
    take_write_order_lock,
)
from gpuorch_store.migrations import MigrationError, ensure_database, migrate, pending_migrations, status
from gpuorch_store.outbox import (
    OUTBOX_CHANNEL,
    BatchPublisher,
    OnParked,
    OutboxBacklog,
    OutboxRelay,
    OutgoingMessage,
    ParkedRow,
    RawPublisher,
    RelayBatch,
    add_to_outbox,
    append_with_outbox,
    is_refusal,
    outbox_backlog,
    parked_rows,
    purge_sent,
)
from gpuorch_store.snapshots import load_latest_snapshot, save_snapshot
from gpuorch_store.unreachable import DATABASE_UNREACHABLE

append_events = append
read_events = read

__all__ = [
    "BatchPublisher",
    "DATABASE_UNREACHABLE",
    "EVENT_WRITE_LOCK_KEY",
    "OUTBOX_CHANNEL",
    "MigrationError",
    "NewEvent",
    "OutboxBacklog",
    "OnParked",
    "OutboxRelay",
    "OutgoingMessage",
    "ParkedRow",
    "RawPublisher",
    "RelayBatch",
    "StoredEvent",
    "add_to_outbox",
    "append",
    "append_events",
    "append_reporting_duplicates",
    "append_with_outbox",
    "ensure_database",
    "is_refusal",
    "last_position",
    "load_latest_snapshot",
    "migrate",
    "outbox_backlog",
    "parked_rows",
    "pending_migrations",
    "purge_sent",
    "read",
    "read_events",
    "save_snapshot",
    "status",
    "take_write_order_lock",
]
