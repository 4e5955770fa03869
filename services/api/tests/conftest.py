"""The API in process on a real port (uvicorn), over a fresh migrated database and a fresh vhost whose gpuorch
exchanges exist, with an identity map of four tokens: an acme submitter, a research submitter, an operator and a
service. ``submissions`` is a queue bound where the scheduler's lanes would be: what the API published lands there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aio_pika
import pytest
import uvicorn
from gpuorch_api.backends import Backends, open_backends
from gpuorch_api.entrypoint import create_app
from gpuorch_contracts import SUBMIT_EXCHANGE, ExecutorHeartbeat
from gpuorch_identity import Identity, IdentityMap, token_digest
from gpuorch_messaging import Broker

TOKENS = {"acme": "acme-token", "research": "research-token", "ops": "ops-token", "svc": "svc-token"}
IDENTITY_MAP = IdentityMap(identities={
    "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme", max_priority="normal"),
    "research-ci": Identity(role="submitter", tenants=["research"], default_tenant="research"),
    "ops": Identity(role="operator", tenants=["*"], default_tenant="default", max_priority="critical"),
    "executor-n1": Identity(role="service", nodes=["n1"]),
    "guest": Identity(role="gateway"),
}, tokens={token_digest(TOKENS["acme"]): "acme-ci", token_digest(TOKENS["research"]): "research-ci",
           token_digest(TOKENS["ops"]): "ops", token_digest(TOKENS["svc"]): "executor-n1"})


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


@dataclass
class RunningApi:
    url: str
    backends: Backends
    submissions: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage]


async def announce(api: RunningApi, publisher: Broker, node_url: str, node_id: str = "n1") -> None:
    """What a node's executor does: a heartbeat naming its log endpoint; returns once the API took it."""
    await publisher.publish(ExecutorHeartbeat(node_id=node_id, sequence=1, fencing_deadline_s=30, interval_s=2,
                                              logs_url=node_url))
    async with asyncio.timeout(30):
        while node_id not in api.backends.logs.endpoints:
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def serve(app: object) -> AsyncIterator[str]:
    """Serve ``app`` on a free port of 127.0.0.1 until the block ends; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def api(migrated_dsn: str, amqp_url: str) -> AsyncIterator[RunningApi]:
    declarer = Broker(amqp_url, producer="test")  # declares the gpuorch exchanges, as the services do
    await declarer.connect()
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    queue = await channel.declare_queue("test.submissions", exclusive=True)
    await queue.bind(SUBMIT_EXCHANGE, "job.#")
    submissions: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
    await queue.consume(submissions.put, no_ack=True)
    backends = await open_backends(amqp_url=amqp_url, database_url=migrated_dsn, identity_map=IDENTITY_MAP,
                                   quotas={"acme": {"gpus": 4}}, jaeger_url="http://jaeger.example:16686",
                                   identity="trust_all")  # every publisher here is guest
    try:
        async with serve(create_app(backends=backends)) as url:
            yield RunningApi(url, backends, submissions)
    finally:
        await backends.close()
        await connection.close()
        await declarer.close()
