"""A database that is not there when telemetry starts is waited for, not a reason to exit (decision 43)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from gpuorch_observability import READINESS
from gpuorch_telemetry.entrypoint import Settings, TelemetryService

pytestmark = pytest.mark.integration


async def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _check(name: str) -> str | None:
    return READINESS.report()[1].get(name)


async def test_telemetry_waits_for_a_database_that_appears_after_it_started(
    late_database: tuple[str, Callable[[], Awaitable[None]]], amqp_url: str
) -> None:
    dsn, appear = late_database
    READINESS.clear()
    service = TelemetryService(Settings(amqp_url=amqp_url, database_url=dsn, metrics_port=0,
                                        instance="telemetry/late-db"))
    starting = asyncio.create_task(service.start(serve_metrics=False))
    try:
        await _until(lambda: (_check("database") or "ok") != "ok")  # retrying, not ready, still running
        assert not starting.done()
        assert "PostgreSQL unreachable" in (_check("database") or "")
        assert not READINESS.report()[0]
        await appear()
        await asyncio.wait_for(starting, 30)
        await _until(lambda: READINESS.report()[0])  # every check passes, the database probe included
    finally:
        starting.cancel()
        await service.stop()
        READINESS.clear()
