"""Snapshots of a folded stream: the state after applying every event up to and including ``position``.

Contract: ``load_latest_snapshot`` returns the snapshot with the highest position for the stream and
``state_version`` (the shape of ``state``; bump it when the fold's state changes shape, so old snapshots are
ignored and the log is replayed instead). Saving the same (stream, state_version, position) twice keeps the
last state. Each save keeps only the newest ``keep`` snapshots of that stream and state_version.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

DEFAULT_KEEP = 3


async def save_snapshot(
    conn: Any,
    stream: str,
    position: int,
    state: Mapping[str, Any] | str,
    *,
    state_version: int = 1,
    keep: int = DEFAULT_KEEP,
) -> None:
    """Store ``state`` (a mapping, or its JSON text) as of event ``position``, keep the newest ``keep``; joins
    ``conn``'s transaction."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    if not conn.is_in_transaction():
        async with conn.transaction():
            await save_snapshot(conn, stream, position, state, state_version=state_version, keep=keep)
            return
    await conn.execute(
        """
        INSERT INTO snapshots (stream, position, state_version, state) VALUES ($1, $2, $3, $4::text::jsonb)
        ON CONFLICT (stream, state_version, position) DO UPDATE SET state = excluded.state, created_at = now()
        """,
        stream,
        position,
        state_version,
        state if isinstance(state, str) else json.dumps(state),
    )
    await conn.execute(
        """
        DELETE FROM snapshots
        WHERE stream = $1 AND state_version = $2 AND position < (
            SELECT min(position) FROM (
                SELECT position FROM snapshots WHERE stream = $1 AND state_version = $2
                ORDER BY position DESC LIMIT $3
            ) AS newest
        )
        """,
        stream,
        state_version,
        keep,
    )


async def load_latest_snapshot(
    conn_or_pool: Any, stream: str, *, state_version: int = 1
) -> tuple[int, dict[str, Any]] | None:
    """``(position, state)`` of the newest snapshot of ``stream`` in ``state_version``, or ``None``."""
    row = await conn_or_pool.fetchrow(
        """
        SELECT position, state::text AS state FROM snapshots
        WHERE stream = $1 AND state_version = $2
        ORDER BY position DESC LIMIT 1
        """,
        stream,
        state_version,
    )
    if row is None:
        return None
    return int(row["position"]), json.loads(row["state"])
