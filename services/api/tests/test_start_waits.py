"""A database that is not there when the API starts is waited for: the API serves 503 with why, then becomes ready
(decision 43); before, it gave up after 60 s and exited."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest
from gpuorch_api.entrypoint import Settings, create_app
from gpuorch_messaging import Broker
from gpuorch_observability import READINESS

from .conftest import auth, serve

pytestmark = pytest.mark.integration


async def test_the_api_serves_not_ready_until_a_late_database_appears(
    late_database: tuple[str, Callable[[], Awaitable[None]]], amqp_url: str
) -> None:
    dsn, appear = late_database
    declarer = Broker(amqp_url, producer="test")  # the exchanges the API looks up
    await declarer.connect()
    READINESS.clear()
    settings = Settings(amqp_url=amqp_url, database_url=dsn, identity="trust_all", rate_limit="")
    try:
        async with serve(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            not_ready = await http.get("/readyz")
            assert not_ready.status_code == 503
            jobs = await http.get("/api/v1/jobs", headers=auth("acme"))
            assert jobs.status_code == 503 and "not ready" in jobs.json()["detail"]
            await appear()
            deadline = asyncio.get_running_loop().time() + 30
            while (ready := await http.get("/readyz")).status_code != 200:
                assert asyncio.get_running_loop().time() < deadline, ready.text
                await asyncio.sleep(0.1)
    finally:
        await declarer.close()
        READINESS.clear()
