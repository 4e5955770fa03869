"""The session proxy against the real PostgreSQL and RabbitMQ: API -> the node's executor endpoint (the executor's
real ``logs_http.LogServer``, with the credential derived for it) -> a stand-in session app on its port, for HTTP
and WebSocket; only the owner's tenant and operators get through; a parked session answers "resuming" and is
resumed on the caller's behalf."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
import websockets
from gpuorch_contracts import ChangeSession, decode
from gpuorch_executor.logs_http import LogServer, SessionTarget
from gpuorch_identity import log_credential
from gpuorch_messaging import Broker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from .conftest import TOKENS, RunningApi, announce, auth, serve

pytestmark = pytest.mark.integration
SPEC = {"run": {"runtime": "process", "argv": ["python", "-m", "http.server", "$(GPUORCH_PORT)"]},
        "resources": {"gpus": 1}, "tier": "interactive"}


async def _seed(dsn: str, running: uuid.UUID, parked: uuid.UUID) -> None:
    conn = await asyncpg.connect(dsn)
    now = datetime.now(UTC)
    try:
        insert = """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, assignments, node_ids,
                        submitted_at, started_at, session_parks)
                    VALUES ($1, 'nb', 'acme', 'interactive', 'normal', $2, $3::text::jsonb, '[]', $4, $5, $5,
                            $6::text::jsonb)"""
        await conn.execute(insert, running, "running", json.dumps(SPEC), ["n1"], now - timedelta(minutes=1), None)
        parks = [[now.timestamp() - 7200, now.timestamp() - 3600, 2.0], [now.timestamp() - 60, None, 1.0]]
        await conn.execute(insert, parked, "parked", json.dumps(SPEC), [], now - timedelta(minutes=1),
                           json.dumps(parks))
    finally:
        await conn.close()


def _session_app() -> Starlette:
    async def page(request: Request) -> PlainTextResponse:
        body = (await request.body()).decode()
        return PlainTextResponse(f"{request.method} {request.url.path}?{request.url.query} {body} "
                                 f"prefix={request.headers.get('x-forwarded-prefix')} "
                                 f"auth={request.headers.get('authorization')}")

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        while True:
            text = await websocket.receive_text()
            await websocket.send_text(f"echo {text}")

    return Starlette(routes=[WebSocketRoute("/ws", echo), Route("/{path:path}", page, methods=["GET", "POST"])])


async def test_the_owner_reaches_the_session_over_http_and_websocket_others_do_not(
        api: RunningApi, migrated_dsn: str, amqp_url: str) -> None:
    running, parked = uuid.uuid4(), uuid.uuid4()
    await _seed(migrated_dsn, running, parked)
    api.backends.logs.secret = "issuing-secret"
    requested: list[uuid.UUID] = []
    publisher = Broker(amqp_url, producer="executor")
    await publisher.connect()
    async with serve(_session_app()) as session_url:
        port = int(session_url.rsplit(":", 1)[1])
        executor = LogServer(log_credential("issuing-secret", "guest"), [], lambda job_id: False,
                             session=lambda job_id: SessionTarget(port, True) if job_id == running else None,
                             requested=requested.append, exec_launch=lambda job_id, argv: {
                                 "argv": argv, "env": {"PATH": os.environ["PATH"]}} if job_id == running else None)
        node_url = await executor.start("127.0.0.1", 0)
        try:
            await announce(api, publisher, node_url)
            async with httpx.AsyncClient(base_url=api.url) as http:
                listed = {s["id"]: s for s in (await http.get("/api/v1/sessions", headers=auth("acme"))).json()}
                assert listed[str(parked)]["parked_gpu_hours"] == pytest.approx(2 + 1 / 60, abs=0.01)
                assert listed[str(running)]["url"] == f"/sessions/{running}/"
                assert (await http.get("/api/v1/sessions", headers=auth("research"))).json() == []
                assert (await http.post(f"/api/v1/sessions/{parked}/park", headers=auth("acme"))).status_code == 409
                assert (await http.post(f"/api/v1/sessions/{running}/park",
                                        headers=auth("research"))).status_code == 404
                assert (await http.post(f"/api/v1/sessions/{running}/park", headers=auth("acme"))).status_code == 202
                message = decode((await asyncio.wait_for(api.submissions.get(), 30)).body)
                assert isinstance(message, ChangeSession) and message.action == "park"
                path = f"/sessions/{running}/notebooks/a?x=1"
                answer = await http.get(path, headers=auth("acme"))
                assert answer.status_code == 200, answer.text
                # the prefix is stripped, and the session never sees the caller's token nor the node's credential
                assert answer.text == f"GET /notebooks/a?x=1  prefix=/sessions/{running} auth=None"
                posted = await http.post(f"/sessions/{running}/save", headers=auth("acme"), content=b"cell 1")
                assert posted.text.startswith("POST /save? cell 1")
                assert requested and set(requested) == {running}
                assert (await http.get(path, headers=auth("ops"))).status_code == 200  # operators pass
                assert (await http.get(path, headers=auth("research"))).status_code == 404  # not disclosed
                assert (await http.get(path)).status_code == 401
                # a browser: ?token= once, then the cookie (for this session's path only)
                first = await http.get(f"/sessions/{running}/?token={TOKENS['acme']}")
                assert first.status_code == 303 and first.headers["location"] == f"/sessions/{running}/"
                assert "httponly" in first.headers["set-cookie"].lower()
                again = await http.get(f"/sessions/{running}/", headers={"cookie": f"gpuorch_session={TOKENS['acme']}"})
                assert again.status_code == 200 and again.text.startswith("GET /?")
                # a parked session: the page, and a resume published on the caller's behalf
                waiting = await http.get(f"/sessions/{parked}/", headers=auth("acme"))
                assert waiting.status_code == 202 and "resuming, estimated start in" in waiting.text
                assert "http-equiv='refresh'" in waiting.text
                message = decode((await asyncio.wait_for(api.submissions.get(), 30)).body)
                assert isinstance(message, ChangeSession)
                assert (message.job_id, message.action, message.on_behalf_of) == (parked, "resume", "acme-ci")
                # the scheduler refused that resume (the owner's caps): the page says why, and asks again
                db = await asyncpg.connect(migrated_dsn)
                await db.execute("UPDATE jobs SET pending_reason = 'resume refused: acme-ci already has 1 live "
                                 "session(s), its cap' WHERE job_id = $1", parked)
                await db.close()
                refused = await http.get(f"/sessions/{parked}/", headers=auth("acme"))
                assert refused.headers["x-gpuorch-resume-refused"] == "1" and "resuming" not in refused.text
                assert "resume refused: acme-ci already has 1 live session(s), its cap" in refused.text
                message = decode((await asyncio.wait_for(api.submissions.get(), 30)).body)
                assert isinstance(message, ChangeSession) and message.action == "resume"
                # gpuctl exec: into the job's sandbox on its node, output streamed, the exit code last
                ran = await http.post(f"/api/v1/jobs/{running}/exec", headers=auth("acme"),
                                      json={"argv": ["python", "-c", "print('inside')"]})
                assert (ran.status_code, ran.content) == (200, b"inside\n\0exit=0\n")
                assert (await http.post(f"/api/v1/jobs/{running}/exec", headers=auth("research"),
                                        json={"argv": ["id"]})).status_code == 404
                assert (await http.post(f"/api/v1/jobs/{parked}/exec", headers=auth("acme"),
                                        json={"argv": ["id"]})).status_code == 409
            ws_url = api.url.replace("http", "ws", 1) + f"/sessions/{running}/ws"
            async with websockets.connect(ws_url, additional_headers=auth("acme")) as socket:
                await socket.send("hi")
                assert await asyncio.wait_for(socket.recv(), 10) == "echo hi"
            with pytest.raises(websockets.InvalidStatus):
                async with websockets.connect(ws_url, additional_headers=auth("research")):
                    pass
            # a WebSocket to a parked session resumes it and is told to come back (503), not refused as if unknown
            with pytest.raises(websockets.InvalidStatus) as not_yet:
                async with websockets.connect(api.url.replace("http", "ws", 1) + f"/sessions/{parked}/ws",
                                              additional_headers=auth("acme")):
                    pass
            assert not_yet.value.response.status_code == 503
            assert not_yet.value.response.headers["retry-after"] == "3"
            message = decode((await asyncio.wait_for(api.submissions.get(), 30)).body)
            assert isinstance(message, ChangeSession) and (message.job_id, message.action) == (parked, "resume")
        finally:
            await executor.close()
            await publisher.close()
