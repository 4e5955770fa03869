"""Job logs from any node: where each node's executor serves them (as that executor said, under its own broker
identity), and the proxy to it with that node's own credential.

    executor.heartbeat (gpuorch.events) --> api.nodes.<hex> (exclusive, auto-delete, latest-wins: drop-head)
        --> judged: the verified publisher (AMQP user_id, ``gpuorch_messaging.provenance``) must be the executor of
            the node the heartbeat names (``log_endpoint_accepts``); anything else is ignored and counted
            (``refused``), so no other identity can move a node's endpoint
        --> NodeLogEndpoints: node id -> (the logs_url its own executor announced last, that executor's identity)
    GET /api/v1/jobs/{id}/logs?follow=1&since=10m --> (route checks authorize_job_access; ``log_since``)
        --> open(job's node, job id) --> GET <logs_url>/jobs/<id>/logs?follow=1&since=<unix time>
            with log_credential(GPUORCH_LOGS_SECRET, announcing identity)
        --> bytes streamed

No shared token: the API holds the issuing secret and sends each executor the credential derived for that
executor's own identity, so the only party that can make the API send a credential to an address is the executor
the credential belongs to (which holds it already), and one node's credential reads no other node's logs
(services/executor ``logs_http`` checks its own). Under ``trust_all`` (development: every process is ``guest``)
the node check is off, as on every queue.

The map is learned from heartbeats (every few seconds per node). An API that has not heard from a job's node yet
(it just started) waits up to ``announce_wait_s`` (a few heartbeats) for that node's next heartbeat before it
answers ``LogsUnavailable``; a node whose heartbeats announce no endpoint is answered at once. Nothing is stored.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aio_pika
import httpx
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from gpuorch_contracts import EVENTS_EXCHANGE, ExecutorHeartbeat, decode
from gpuorch_identity import log_credential
from gpuorch_messaging import judged_publisher, refusal
from gpuorch_messaging.senders import IdentityMode, log_endpoint_accepts
from gpuorch_observability import get_logger
from gpuorch_report import parse_when

log = get_logger(__name__)
DIRECTORY = "api.nodes"
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


def log_since(text: str, now: datetime) -> float:
    """``?since=`` of a log as a unix time: ``30s`` (and ``10m``, ``2h``, ``7d``, ``2w``) back from ``now``, or a
    time (``2026-12-05T09:00``; UTC without a zone). ValueError with one line otherwise."""
    seconds = _SECONDS.match(text)
    if seconds is not None:
        return now.timestamp() - float(seconds.group(1))
    try:
        return parse_when(text, now).timestamp()
    except ValueError as exc:
        raise ValueError(f"{exc}; or seconds back, e.g. 30s") from None


class LogsUnavailable(Exception):
    """The node's log endpoint is unknown or did not answer: ``status`` for the caller and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Endpoint:
    """Where a node serves its logs, and the broker identity (its executor) that said so."""

    url: str
    identity: str


class NodeLogEndpoints:
    """Node id -> its executor's log endpoint (``endpoints``), and the proxy to it.

    ``secret``: the issuing secret of node log credentials (``GPUORCH_LOGS_SECRET``); ``identity``/``node_scopes``:
    how heartbeats are judged (as on every queue). ``announce_wait_s``: how long ``open`` waits for the first
    heartbeat of a node it has not heard from.
    """

    def __init__(self, secret: str | None, *, identity: IdentityMode = "strict",
                 node_scopes: Mapping[str, Collection[str]] | None = None, announce_wait_s: float = 15.0) -> None:
        self.secret = secret
        self.identity: IdentityMode = identity
        self.node_scopes = node_scopes or {}
        self.announce_wait_s = announce_wait_s
        self.endpoints: dict[str, Endpoint] = {}
        self.without_logs: set[str] = set()  # nodes whose heartbeats announce no endpoint
        self.refused = 0
        """Heartbeats ignored because their publisher does not speak for the node they name."""
        self._heard: dict[str, asyncio.Event] = {}  # nodes a request waits for -> set by their next heartbeat
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def watch(self, connection: AbstractRobustConnection) -> None:
        """Follow executor heartbeats on ``connection`` (a queue of this process's own)."""
        self._channel = await connection.channel()
        await self._channel.set_qos(prefetch_count=200)
        exchange = await self._channel.get_exchange(EVENTS_EXCHANGE)
        queue = await self._channel.declare_queue(
            f"{DIRECTORY}.{uuid.uuid4().hex}", exclusive=True, auto_delete=True,
            arguments={"x-max-length": 10_000, "x-overflow": "drop-head"})
        await queue.bind(exchange, ExecutorHeartbeat.TYPE)
        await queue.consume(self._on_heartbeat, no_ack=True)

    async def _on_heartbeat(self, incoming: AbstractIncomingMessage) -> None:
        try:
            beat = decode(incoming.body)
        except Exception:  # noqa: BLE001 - gpuorch validated what it published; a stray body changes nothing
            return
        if not isinstance(beat, ExecutorHeartbeat):
            return
        judged = judged_publisher(incoming.user_id, incoming.headers, mode=self.identity,
                                  node_scopes=self.node_scopes)
        refused = judged.refused or refusal(log_endpoint_accepts(), beat, judged.publisher, queue=DIRECTORY,
                                            mode=self.identity, node_scopes=self.node_scopes)
        if refused is not None:
            self.refused += 1
            log.warning("api.heartbeat_refused", node_id=beat.node_id, user_id=incoming.user_id, reason=refused)
            return
        if beat.logs_url:
            self.endpoints[beat.node_id] = Endpoint(beat.logs_url, judged.publisher or "")
            self.without_logs.discard(beat.node_id)
        else:
            self.endpoints.pop(beat.node_id, None)
            self.without_logs.add(beat.node_id)
        heard = self._heard.pop(beat.node_id, None)
        if heard is not None:
            heard.set()

    @property
    def awaited(self) -> frozenset[str]:
        """Nodes a request is waiting to hear from."""
        return frozenset(self._heard)

    async def _endpoint(self, node_id: str) -> Endpoint | None:
        """The node's endpoint, waiting up to ``announce_wait_s`` for a node not heard from yet."""
        endpoint = self.endpoints.get(node_id)
        if endpoint is not None or node_id in self.without_logs or self.announce_wait_s <= 0:
            return endpoint
        heard = self._heard.setdefault(node_id, asyncio.Event())
        try:
            async with asyncio.timeout(self.announce_wait_s):
                await heard.wait()
        except TimeoutError:
            return None
        return self.endpoints.get(node_id)

    async def executor(self, node_id: str) -> tuple[str, str]:
        """(URL, credential) of the node's executor endpoint, the credential derived for the executor that
        announced it (the session proxy uses the same path); raises LogsUnavailable."""
        if not self.secret:
            raise LogsUnavailable(503, "this API reaches no node's executor: it needs GPUORCH_LOGS_SECRET (from "
                                       "which each executor's credential is derived)")
        endpoint = await self._endpoint(node_id)
        if endpoint is None:
            raise LogsUnavailable(503, f"node {node_id} has not announced a log endpoint (its executor serves logs "
                                       "when GPUORCH_LOGS_PORT is set; no heartbeat of it named one within "
                                       f"{self.announce_wait_s:g} s)")
        return endpoint.url.rstrip("/"), log_credential(self.secret, endpoint.identity)

    async def open(self, node_id: str, job_id: uuid.UUID, *, follow: bool, since: float | None = None,
                   tail: int | None = None, timestamps: bool = False) -> AsyncIterator[bytes]:
        """The job's log from its node's executor, as it arrives; raises LogsUnavailable before the first byte.
        ``since`` (unix time), ``tail`` (lines) and ``timestamps`` as the executor's ``logs_http`` serves them."""
        params = {"follow": "1" if follow else "0"}
        if since is not None:
            params["since"] = f"{since:.3f}"
        if tail is not None:
            params["tail"] = str(tail)
        if timestamps:
            params["timestamps"] = "1"
        return await self.stream(node_id, "GET", f"/jobs/{job_id}/logs", params=params)

    async def stream(self, node_id: str, method: str, path: str, *, params: dict[str, str] | None = None,
                     json: Any = None) -> AsyncIterator[bytes]:
        """``method path`` on the node's executor endpoint with its credential; the answer's bytes as they come.
        LogsUnavailable before the first byte (the executor's 403 and 404 kept, anything else 502)."""
        base, credential = await self.executor(node_id)
        client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), follow_redirects=False)
        try:
            request = client.build_request(method, f"{base}{path}", params=params, json=json,
                                           headers={"Authorization": f"Bearer {credential}"})
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            raise LogsUnavailable(502, f"node {node_id}'s log endpoint did not answer: {exc!r}") from exc
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace").strip()
            await response.aclose()
            await client.aclose()
            status = response.status_code if response.status_code in (403, 404) else 502
            raise LogsUnavailable(status, f"node {node_id}: {text[:300] or response.status_code}")
        return relay(client, response)


async def relay(client: httpx.AsyncClient, response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        return  # the node went away mid-stream: the log ends here
    finally:
        await response.aclose()
        await client.aclose()
