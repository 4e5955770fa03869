"""Job logs from any node: where each node's executor serves them, and the proxy to it.

    executor.heartbeat (gpuorch.events) --> api.nodes.<hex> (exclusive, auto-delete, latest-wins: drop-head)
        --> NodeLogEndpoints: node id -> the ``logs_url`` its executor announced last
    GET /api/v1/jobs/{id}/logs?follow=1 --> (route checks authorize_job_access) --> open(job's node, job id)
        --> GET <logs_url>/jobs/<id>/logs?follow=1 with the service token (GPUORCH_LOGS_TOKEN) --> bytes streamed

The map is learned from heartbeats (every few seconds per node). An API that has not heard from a job's node yet
(it just started) waits up to ``announce_wait_s`` (a few heartbeats) for that node's next heartbeat before it
answers ``LogsUnavailable``; a node whose heartbeats announce no endpoint is answered at once. Nothing is stored.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aio_pika
import httpx
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from gpuorch_contracts import EVENTS_EXCHANGE, ExecutorHeartbeat, decode


class LogsUnavailable(Exception):
    """The node's log endpoint is unknown or did not answer: ``status`` for the caller and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class NodeLogEndpoints:
    """Node id -> the log endpoint its executor announced last (``urls``), and the proxy to it.

    ``announce_wait_s``: how long ``open`` waits for the first heartbeat of a node it has not heard from.
    """

    def __init__(self, token: str | None, *, announce_wait_s: float = 15.0) -> None:
        self.token = token
        self.announce_wait_s = announce_wait_s
        self.urls: dict[str, str] = {}
        self.without_logs: set[str] = set()  # nodes whose heartbeats announce no endpoint
        self._heard: dict[str, asyncio.Event] = {}  # nodes a request waits for -> set by their next heartbeat
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def watch(self, connection: AbstractRobustConnection) -> None:
        """Follow executor heartbeats on ``connection`` (a queue of this process's own)."""
        self._channel = await connection.channel()
        await self._channel.set_qos(prefetch_count=200)
        exchange = await self._channel.get_exchange(EVENTS_EXCHANGE)
        queue = await self._channel.declare_queue(
            f"api.nodes.{uuid.uuid4().hex}", exclusive=True, auto_delete=True,
            arguments={"x-max-length": 10_000, "x-overflow": "drop-head"})
        await queue.bind(exchange, ExecutorHeartbeat.TYPE)
        await queue.consume(self._on_heartbeat, no_ack=True)

    async def _on_heartbeat(self, incoming: AbstractIncomingMessage) -> None:
        try:
            beat = decode(incoming.body)
        except Exception:  # noqa: BLE001 - gpuorch validated what it published; a stray body changes nothing
            return
        if isinstance(beat, ExecutorHeartbeat):
            if beat.logs_url:
                self.urls[beat.node_id] = beat.logs_url
                self.without_logs.discard(beat.node_id)
            else:
                self.urls.pop(beat.node_id, None)
                self.without_logs.add(beat.node_id)
            heard = self._heard.pop(beat.node_id, None)
            if heard is not None:
                heard.set()

    @property
    def awaited(self) -> frozenset[str]:
        """Nodes a request is waiting to hear from."""
        return frozenset(self._heard)

    async def _endpoint(self, node_id: str) -> str | None:
        """The node's endpoint, waiting up to ``announce_wait_s`` for a node not heard from yet."""
        url = self.urls.get(node_id)
        if url is not None or node_id in self.without_logs or self.announce_wait_s <= 0:
            return url
        heard = self._heard.setdefault(node_id, asyncio.Event())
        try:
            async with asyncio.timeout(self.announce_wait_s):
                await heard.wait()
        except TimeoutError:
            return None
        return self.urls.get(node_id)

    async def open(self, node_id: str, job_id: uuid.UUID, *, follow: bool) -> AsyncIterator[bytes]:
        """The job's log from its node's executor, as it arrives; raises LogsUnavailable before the first byte."""
        if not self.token:
            raise LogsUnavailable(503, "this API reads no node's logs: it needs GPUORCH_LOGS_TOKEN (the token the "
                                       "executors' log endpoints take)")
        url = await self._endpoint(node_id)
        if url is None:
            raise LogsUnavailable(503, f"node {node_id} has not announced a log endpoint (its executor serves logs "
                                       "when GPUORCH_LOGS_PORT is set; no heartbeat of it named one within "
                                       f"{self.announce_wait_s:g} s)")
        client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
        try:
            request = client.build_request("GET", f"{url.rstrip('/')}/jobs/{job_id}/logs",
                                           params={"follow": "1" if follow else "0"},
                                           headers={"Authorization": f"Bearer {self.token}"})
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            raise LogsUnavailable(502, f"node {node_id}'s log endpoint did not answer: {exc!r}") from exc
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace").strip()
            await response.aclose()
            await client.aclose()
            status = 404 if response.status_code == 404 else 502
            raise LogsUnavailable(status, f"node {node_id}: {text or response.status_code}")
        return _relay(client, response)


async def _relay(client: httpx.AsyncClient, response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        return  # the node went away mid-stream: the log ends here
    finally:
        await response.aclose()
        await client.aclose()
