"""What the handlers reach: the read models (PostgreSQL pool), the gateway (broker), live streams, settings.

``open_backends`` connects everything at start (retrying while the servers come up, for ever at a service's start) and ``close`` releases it;
the handlers only ever get a ``Backends``, so tests may build one over their own pool and broker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from gpuorch_contracts import JobSpec
from gpuorch_identity import IdentityMap
from gpuorch_messaging import Broker
from gpuorch_messaging.senders import IdentityMode
from gpuorch_observability import get_logger, until_up
from gpuorch_store import DATABASE_UNREACHABLE

from gpuorch_api.domain import share_sizing
from gpuorch_api.gateway import Gateway
from gpuorch_api.live import EventStreams
from gpuorch_api.node_logs import NodeLogEndpoints
from gpuorch_api.readmodels import ReadModels

log = get_logger(__name__)


@dataclass
class Backends:
    identity_map: IdentityMap
    read: ReadModels
    gateway: Gateway
    streams: EventStreams
    broker: Broker
    pool: asyncpg.Pool
    logs: NodeLogEndpoints
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)
    jaeger_url: str | None = None
    dlq_amqp_url: str | None = None
    """The broker URL the operator routes list and replay dead letters with (an operator broker user)."""

    async def problems(self) -> list[str]:
        """Why the API is not ready: an unreachable database or broker (empty: ready)."""
        found = []
        try:
            await asyncio.wait_for(self.read.ping(), 5)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            found.append(f"database unreachable: {exc!r}")
        if not self.broker.is_connected:
            found.append("broker unreachable")
        return found

    async def close(self) -> None:
        await self.streams.close()
        await self.broker.close()
        await self.pool.close()


async def open_backends(*, amqp_url: str, database_url: str, identity_map: IdentityMap,
                        quotas: dict[str, dict[str, Any]] | None = None, jaeger_url: str | None = None,
                        logs_secret: str | None = None, identity: IdentityMode = "strict",
                        dlq_amqp_url: str | None = None,
                        timeout_s: float | None = 60.0) -> Backends:
    """Connect the pool, the publishing broker and the live-stream connection (retrying until ``timeout_s``; None:
    as long as either server is down, as the API's start does), and start following where each node serves its
    logs."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    async def create_pool() -> asyncpg.Pool:
        try:
            return await asyncpg.create_pool(database_url, min_size=1, max_size=8, timeout=10)
        except DATABASE_UNREACHABLE as exc:
            if deadline is not None and time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach PostgreSQL: {exc}") from exc
            raise

    pool = await until_up("database", create_pool, transient=DATABASE_UNREACHABLE, failing="PostgreSQL unreachable",
                          max_s=10.0 if deadline is None else 0.5)
    broker = Broker(amqp_url, producer="gpuorch-api", connection_name="gpuorch-api", declare_topology=False)
    await broker.connect(timeout_s=None if deadline is None else max(1.0, deadline - time.monotonic()))
    streams = EventStreams(amqp_url)
    await streams.connect()
    logs = NodeLogEndpoints(logs_secret, identity=identity, node_scopes=identity_map.node_scopes)
    await logs.watch(streams.connection)
    read = ReadModels(pool)

    async def size_share(spec: JobSpec) -> JobSpec:
        """Without telemetry's tables (or the right to read them) the share keeps its default size."""
        try:
            peaks = await read.run_peaks(spec.name, spec.tenant, share_sizing.RUNS)
        except asyncpg.PostgresError as exc:
            log.warning("api.share_history_unread", error=repr(exc))
            peaks = []
        return share_sizing.sized_from_use(spec, peaks)

    return Backends(identity_map=identity_map, read=read, gateway=Gateway(broker, identity_map, size_share),
                    streams=streams, broker=broker, pool=pool, logs=logs, quotas=quotas or {},
                    jaeger_url=jaeger_url, dlq_amqp_url=dlq_amqp_url or amqp_url)
