"""Interactive sessions over HTTP: the authenticated proxy, and park/resume on the caller's behalf (issue 27).

    GET  /api/v1/sessions                         the caller's sessions (tier interactive), each with its URL and
                                                  the GPU-hours its parks gave back
    POST /api/v1/sessions/{id}/park               ChangeSession park   -> 202 (a running session)
    POST /api/v1/sessions/{id}/resume             ChangeSession resume -> 202 (a parked session)
    POST /api/v1/jobs/{id}/exec {"argv": [...]}   run argv inside any running process job's sandbox (its uid,
                                                  devices, cgroups, env, cwd; the tenant's allow-list judges it):
                                                  its output streamed, then a last line "\0exit=<code>"
    ANY  /sessions/{id}/{path}                    the session itself, HTTP or WebSocket:
        token: ``Authorization: Bearer``, else the ``gpuorch_session`` cookie, else ``?token=`` (answered with a
        redirect that sets the cookie for this session's path only and drops the token from the URL)
        another tenant's session (or none, or not a session)     -> 404 (as for every job read)
        a tenant the caller sees but may not act for             -> 403
        running   -> the node's executor (its URL from its own heartbeat, ``node_logs``; the credential derived for
                     that executor) -> /jobs/<id>/proxy/<path> -> the session's port on that node
        parked    -> a ChangeSession resume is published for the caller, and a page "resuming, estimated start in
                     N s" that reloads itself until the session answers; when the scheduler refused its last
                     resume (the owner's session caps: the row's pending reason), the page says so and why, and
                     each reload asks again
        queued, placed, not answering yet -> the same page, without publishing
        ended     -> 410
        a WebSocket handshake: the same, but a session that does not run yet (parked: resumed as above) answers
        503 with that page and Retry-After, and every other refusal is a 403 (the handshake's close before accept)

The node is the one the scheduler's read model assigns the job to, never a URL from the request. Nothing here keeps
state: a second API instance proxies the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import time
import uuid
from typing import Annotated, Any
from urllib.parse import urlencode

import httpx
import websockets
from fastapi import APIRouter, Depends, Request, Response, WebSocket
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse
from gpuorch_contracts.jobs import TERMINAL_STATES
from gpuorch_contracts.text import Arg
from gpuorch_identity import authorize_job_access
from pydantic import BaseModel, ConfigDict, Field
from starlette.websockets import WebSocketDisconnect

from gpuorch_api.auth import ApiError, Caller, Forbidden, Unauthorized, authenticate
from gpuorch_api.backends import Backends
from gpuorch_api.domain import views
from gpuorch_api.node_logs import LogsUnavailable, relay
from gpuorch_api.routes import BackendsDep, CallerDep, backends, connected_backends

router = APIRouter()
COOKIE = "gpuorch_session"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "authorization", "content-length"})
RELOAD_S = 3


def session_url(job_id: uuid.UUID | str) -> str:
    return f"/sessions/{job_id}/"


def parked_gpu_hours(parks_json: str | None, now: float) -> float:
    """GPU-hours a session gave back by its parks (``JobRecord.parks``; a park under way counts until ``now``)."""
    parks = json.loads(parks_json) if parks_json else []
    return sum(gpus * max(0.0, (now if ended is None else ended) - began) for began, ended, gpus in parks) / 3600.0


def _session_view(job: dict[str, Any]) -> dict[str, Any]:
    out = views.job_view(job)
    out["url"] = session_url(job["job_id"])
    out["parked_gpu_hours"] = round(parked_gpu_hours(job.get("session_parks"), time.time()), 4)
    out["parks"] = len(json.loads(job["session_parks"])) if job.get("session_parks") else 0
    return out


@router.get("/api/v1/sessions", tags=["sessions"])
async def list_sessions(who: CallerDep, svc: BackendsDep) -> list[dict[str, Any]]:
    """The caller's interactive sessions (operators: all), newest first, each with the path it is served at."""
    rows, _ = await svc.read.jobs(tenants=who.tenants, tier="interactive", limit=500)
    return [_session_view(row) for row in rows]


@router.post("/api/v1/sessions/{job_ref}/park", status_code=202, tags=["sessions"])
async def park_session(job_ref: str, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """Park a running session: checkpoint stop, GPU freed, work directory kept. 409 unless it runs."""
    job = await _session(svc, who, job_ref)
    if job["state"] not in ("running", "placed"):
        raise ApiError(409, f"session {job['job_id']} is {job['state']}: only a running session parks")
    await svc.gateway.change_session(who, job, "park")
    return {"job_id": job["job_id"], "status": "park requested"}


@router.post("/api/v1/sessions/{job_ref}/resume", status_code=202, tags=["sessions"])
async def resume_session(job_ref: str, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """Resume a parked session (queued again, placed wherever room is). 409 unless it is parked. Its owner's caps
    are the scheduler's to judge: a refused resume leaves it parked with the reason as its ``pending_reason`` (the
    row's ``updated_at`` moves)."""
    job = await _session(svc, who, job_ref)
    if job["state"] != "parked":
        raise ApiError(409, f"session {job['job_id']} is {job['state']}: only a parked session resumes")
    await svc.gateway.change_session(who, job, "resume")
    return {"job_id": job["job_id"], "status": "resume requested", "url": session_url(job["job_id"])}


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    argv: Annotated[list[Arg], Field(min_length=1, max_length=256)]


@router.post("/api/v1/jobs/{job_ref}/exec", tags=["jobs"], response_class=StreamingResponse)
async def exec_in_job(job_ref: str, body: ExecRequest, who: CallerDep, svc: BackendsDep) -> StreamingResponse:
    """Run a command inside a running job's sandbox on its node (``gpuctl exec``); its output as it comes."""
    job_id = await svc.read.resolve(job_ref, tenants=who.tenants)
    job = await svc.read.job(job_id) if job_id is not None else None
    if job is None:
        raise ApiError(404, f"no job {job_ref!r} (or several match: give more characters)")
    refused = authorize_job_access(svc.identity_map, who.name, job["tenant"])
    if refused is not None:
        raise Forbidden(refused.reason)
    if job["state"] != "running" or not job["node_ids"]:
        raise ApiError(409, f"job {job['job_id']} is {job['state']}: exec needs a running job")
    try:
        chunks = await svc.logs.stream(job["node_ids"][0], "POST", f"/jobs/{job['job_id']}/exec",
                                       json={"argv": body.argv})
    except LogsUnavailable as exc:
        raise ApiError(exc.status, exc.message) from exc
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={"Cache-Control": "no-cache"})


async def _session(svc: Backends, who: Caller, job_ref: str) -> dict[str, Any]:
    """The caller's session: 404 for none, another tenant's job, or a job that is no session; 403 for a tenant
    it sees but may not act for."""
    job_id = await svc.read.resolve(job_ref, tenants=who.tenants)
    job = await svc.read.job(job_id) if job_id is not None else None
    if job is None or job["tier"] != "interactive":
        raise ApiError(404, f"no session {job_ref!r}")
    refused = authorize_job_access(svc.identity_map, who.name, job["tenant"])
    if refused is not None:
        raise Forbidden(refused.reason)
    return job


def _token(headers: Any, cookies: dict[str, str]) -> str | None:
    bearer = headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        return str(bearer[7:].strip())
    return cookies.get(COOKIE)


def _forwarded_cookie(header: str | None) -> str | None:
    """The request's cookies minus ours (the session never sees the caller's API token)."""
    if not header:
        return None
    kept = [c for c in header.split(";") if c.strip() and not c.strip().startswith(f"{COOKIE}=")]
    return ";".join(kept) or None


@router.api_route("/sessions/{job_id}/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE",
                                                             "OPTIONS"], include_in_schema=False)
async def proxy(job_id: uuid.UUID, path: str, request: Request, svc: Annotated[Backends, Depends(backends)]
                ) -> Response:
    """The session's own answer (see the module docstring)."""
    token = request.query_params.get("token")
    if token:
        authenticate(svc.identity_map, token)  # 401 before any cookie is set
        query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        target = f"{session_url(job_id)}{path}" + (f"?{query}" if query else "")
        redirect = RedirectResponse(target, status_code=303)
        redirect.set_cookie(COOKIE, token, path=session_url(job_id), httponly=True, samesite="strict")
        return redirect
    who = authenticate(svc.identity_map, _token(request.headers, request.cookies))
    job = await _session(svc, who, str(job_id))
    if job["state"] in TERMINAL_STATES:
        raise ApiError(410, f"session {job_id} has ended ({job['state']})")
    if job["state"] == "parked":
        await svc.gateway.change_session(who, job, "resume", "its URL was opened")
        return _waiting_page(job, "resuming")
    if job["state"] != "running" or not job["node_ids"]:
        return _waiting_page(job, "starting")
    try:
        base, credential = await svc.logs.executor(job["node_ids"][0])
    except LogsUnavailable as exc:
        raise ApiError(exc.status, exc.message) from exc
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "cookie"]
    cookie = _forwarded_cookie(request.headers.get("cookie"))
    if cookie:
        headers.append(("cookie", cookie))
    headers += [("authorization", f"Bearer {credential}"), ("connection", "close")]
    client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), follow_redirects=False)
    upstream = client.build_request(request.method, f"{base}/jobs/{job_id}/proxy/{path}",
                                    params=request.url.query, headers=headers, content=request.stream())
    try:
        response = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        raise ApiError(502, f"node {job['node_ids'][0]}'s executor did not answer: {exc!r}") from exc
    if response.status_code in (404, 502) and response.headers.get("x-gpuorch-executor") is not None:
        body = await response.aread()  # the executor's own answer: the session does not listen there (yet)
        await response.aclose()
        await client.aclose()
        return _waiting_page(job, "starting", body.decode(errors="replace").strip())
    kept = [(k, v) for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP - {"content-length"}]
    return StreamingResponse(relay(client, response), status_code=response.status_code,
                             headers=dict(kept))


def _waiting_page(job: dict[str, Any], doing: str, detail: str | None = None) -> HTMLResponse:
    """"resuming (or starting), estimated start in N s", reloading itself every few seconds until it answers."""
    estimate = job.get("estimated_start")
    if estimate is not None and hasattr(estimate, "timestamp"):
        estimate = estimate.timestamp()
    seconds = max(0, round(float(estimate) - time.time())) if estimate is not None else None
    when = f"estimated start in {seconds} s" if seconds is not None else "estimated start in a few seconds"
    reason = job.get("pending_reason") or detail or job.get("reason") or ""
    refused = job["state"] == "parked" and bool(job.get("pending_reason"))
    headers = {"Cache-Control": "no-store", "Retry-After": str(RELOAD_S), "X-Gpuorch-Session-State": job["state"]}
    if refused:  # the scheduler refused its last resume (its owner's caps): say so, and keep asking
        doing, title = "parked", "parked, its owner's session cap refused the resume"
        then = ("Park or stop another of your sessions: this page asks again each time it reloads, and becomes "
                "the session once it runs.")
        headers["X-Gpuorch-Resume-Refused"] = "1"
    else:
        title = f"{doing}, {when}"
        then = "This page reloads into the session once it runs."
    body = (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{RELOAD_S}'>"
            f"<title>{doing} session</title></head><body style='font-family:sans-serif;margin:3em'>"
            f"<h1>Session {html.escape(str(job['job_id']))}: {html.escape(title)}</h1>"
            f"<p id='reason'>{html.escape(str(reason))}</p><p>{html.escape(then)}</p></body></html>")
    return HTMLResponse(body, status_code=202, headers=headers)


@router.websocket("/sessions/{job_id}/{path:path}")
async def proxy_websocket(websocket: WebSocket, job_id: uuid.UUID, path: str) -> None:
    """A WebSocket to the session, relayed message by message through the node's executor."""
    try:
        svc = connected_backends(websocket.app)
        who = authenticate(svc.identity_map, websocket.query_params.get("token") or _token(
            websocket.headers, websocket.cookies))
        job = await _session(svc, who, str(job_id))
        if job["state"] in ("parked", "queued", "placed") or (
                job["state"] == "running" and not job["node_ids"]):
            if job["state"] == "parked":
                await svc.gateway.change_session(who, job, "resume", "its URL was opened (WebSocket)")
            await _not_yet(websocket, _waiting_page(job, "resuming" if job["state"] == "parked" else "starting"))
            return
        if job["state"] != "running":
            raise ApiError(409, f"session {job_id} is {job['state']}")
        base, credential = await svc.logs.executor(job["node_ids"][0])
    except (ApiError, Unauthorized, LogsUnavailable):
        await websocket.close(code=1008)
        return
    query = urlencode([(k, v) for k, v in websocket.query_params.multi_items() if k != "token"])
    target = f"{base.replace('http', 'ws', 1)}/jobs/{job_id}/proxy/{path}" + (f"?{query}" if query else "")
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    try:
        upstream = await websockets.connect(target, additional_headers={"Authorization": f"Bearer {credential}"},
                                            subprotocols=offered or None, open_timeout=10,  # type: ignore[arg-type]
                                            max_size=16 * 1024 * 1024)
    except (OSError, websockets.InvalidHandshake, TimeoutError):
        await websocket.close(code=1011)
        return
    await websocket.accept(subprotocol=upstream.subprotocol)
    async with upstream:
        await _relay_websocket(websocket, upstream)


async def _not_yet(websocket: WebSocket, page: HTMLResponse) -> None:
    """Refuse a WebSocket to a session that does not run yet with the waiting page as a 503 (Retry-After: a
    client that reconnects gets through once it runs); a server without the denial-response extension closes with
    1013 (try again later)."""
    page.status_code = 503
    try:
        await websocket.send_denial_response(page)
    except RuntimeError:
        await websocket.close(code=1013)


async def _relay_websocket(websocket: WebSocket, upstream: Any) -> None:
    async def to_session() -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
                elif message.get("text") is not None:
                    await upstream.send(message["text"])

    async def from_session() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in upstream:
                if isinstance(message, bytes):
                    await websocket.send_bytes(message)
                else:
                    await websocket.send_text(message)

    tasks = [asyncio.create_task(to_session()), asyncio.create_task(from_session())]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    with contextlib.suppress(Exception):
        await websocket.close()


__all__ = ["router", "session_url"]
