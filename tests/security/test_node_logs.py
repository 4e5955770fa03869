"""Escalation 3 (issue 29): a forged heartbeat must not redirect the API's log requests nor collect a credential.

As reported: the API followed the ``logs_url`` of any ``executor.heartbeat`` and sent the shared
``GPUORCH_LOGS_TOKEN`` there, so one forged heartbeat collected the token that reads every node's logs. Here, on the
real broker with the generator's least-privilege users: node 1's executor serves a job's log (the executor's own
``LogServer``) and announces it; then node 2's executor (which may publish heartbeats, for its own node) announces
an endpoint of its own *for node 1*, once plainly, once claiming node 1's identity in the original-publisher
header, and a publisher without user_id does the same. The API's node-log directory (``NodeLogEndpoints``, as the
API runs it: strict, over the API user's connection) must ignore all three, keep reading node 1's log from node 1,
and the forger's server must never be asked anything. The credential the API sends is node 1's own, which node
2's credential cannot replace.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import httpx
import pytest
from gpuorch_api.node_logs import NodeLogEndpoints
from gpuorch_contracts import EVENTS_EXCHANGE, ExecutorHeartbeat
from gpuorch_executor.logs_http import LogServer
from gpuorch_identity import log_credential
from gpuorch_messaging import ORIGINAL_PUBLISHER_HEADER, Broker
from gpuorch_messaging.queues import Installation

from tests.deploy.broker_users import RoleUsers, gen

pytestmark = [pytest.mark.security, pytest.mark.integration]

SECRET = "the-api-issuing-secret"


def own_node_executor(name: str) -> object:
    """An executor user speaking for the node its name says (``executor-<node>``, the naming convention)."""
    return gen.executor(name, [name.removeprefix("executor-")])


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    roles = {"api": gen.api, "executor-1": own_node_executor, "executor-2": own_node_executor}
    with RoleUsers(amqp_vhost, roles).created() as created:
        yield created


class Trap:
    """An HTTP server that records every request it gets (the forger's endpoint)."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(await reader.read(4096))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nforged\n")
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> Trap:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def node_1_log(tmp_path: Path, users: RoleUsers) -> AsyncIterator[tuple[LogServer, uuid.UUID]]:
    """Node 1's real log endpoint, serving one job's log to node 1's credential only."""
    job_id = uuid.uuid4()
    (tmp_path / str(job_id)).mkdir()
    (tmp_path / str(job_id) / f"{uuid.uuid4()}.log").write_text("the real log of node 1\n")
    server = LogServer(log_credential(SECRET, users.names["executor-1"]), [tmp_path], lambda _: False)
    await server.start("127.0.0.1", 0)
    try:
        yield server, job_id
    finally:
        await server.close()


def beat(node: str, url: str, sequence: int) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(node_id=node, sequence=sequence, fencing_deadline_s=30, interval_s=2, logs_url=url)


async def test_a_forged_heartbeat_neither_redirects_log_requests_nor_collects_a_credential(
        users: RoleUsers, node_1_log: tuple[LogServer, uuid.UUID]) -> None:
    await users.install(Installation())
    server, job_id = node_1_log
    node_1 = users.names["executor-1"].removeprefix("executor-")
    directory = NodeLogEndpoints(SECRET, identity="strict", announce_wait_s=5)
    connection = await aio_pika.connect_robust(users.url("api"))
    executor_1 = Broker(users.url("executor-1"), producer="executor/1", declare_topology=False)
    executor_2 = Broker(users.url("executor-2"), producer="executor/2", declare_topology=False)
    try:
        await directory.watch(connection)  # as the API does, with the API user's rights
        for broker in (executor_1, executor_2):
            await broker.connect(timeout_s=10)
        assert server.url is not None
        await executor_1.publish(beat(node_1, server.url, 1))
        async with asyncio.timeout(20):
            while node_1 not in directory.endpoints:
                await asyncio.sleep(0.05)

        async with Trap() as trap:
            await executor_2.publish(beat(node_1, trap.url, 2))  # another node's executor speaking for node 1
            await executor_2.publish(beat(node_1, trap.url, 3),
                                     headers={ORIGINAL_PUBLISHER_HEADER: users.names["executor-1"]})
            anonymous = await aio_pika.connect(users.url("executor-2"))  # the same user, no user_id set
            try:
                exchange = await (await anonymous.channel()).get_exchange(EVENTS_EXCHANGE)
                await exchange.publish(aio_pika.Message(beat(node_1, trap.url, 4).model_dump_json().encode()),
                                       "executor.heartbeat")
            finally:
                await anonymous.close()
            async with asyncio.timeout(20):
                while directory.refused < 3:
                    await asyncio.sleep(0.05)

            assert directory.endpoints[node_1].url == server.url
            assert directory.endpoints[node_1].identity == users.names["executor-1"]
            chunks = await directory.open(node_1, job_id, follow=False)
            assert b"".join([chunk async for chunk in chunks]) == b"the real log of node 1\n"
            assert trap.requests == []

        async with httpx.AsyncClient() as http:  # one node's credential does not read another node's logs
            path = f"{server.url}/jobs/{job_id}/logs"
            other = log_credential(SECRET, users.names["executor-2"])
            assert (await http.get(path, headers={"Authorization": f"Bearer {other}"})).status_code == 401
            assert (await http.get(path, headers={"Authorization": f"Bearer {SECRET}"})).status_code == 401
    finally:
        for broker in (executor_1, executor_2):
            await broker.close()
        await connection.close()
