"""The executor's log endpoint: its jobs' output over HTTP, the way the kubelet serves ``kubectl logs``.

Served by Starlette on uvicorn (in the executor's own event loop; no signal handlers of its own).

    GET /jobs/<job_id>/logs[?follow=1&since=<unix time>&tail=<n>&timestamps=1]
                                            Authorization: Bearer <GPUORCH_LOGS_TOKEN> (this executor's own)
        401  no or another token;  400  a job id that is not a UUID, or a bad parameter;  404  no log of that job
        on this executor
        200  text/plain, the body ends when the connection closes: the job's newest placement log from its start;
             ``since``: from the first line that may have been written at or after that time (``log_times``: the
             sidecar index of when the log grew; a log without one is served whole); ``tail``: only the last n
             lines of that; ``timestamps``: each line prefixed with its time (RFC 3339, UTC, ms) and a space
             (the raw bytes otherwise, unchanged); with follow=1 it goes on sending what the job writes until that
             placement is no longer active here and the file is drained, or the client goes away
    ANY /jobs/<job_id>/proxy/<path>         Authorization: the same credential; an interactive session's port
        404  no running session of that job here;  502  the session does not answer on its port
        otherwise the session's own answer: the request goes to 127.0.0.1:<its GPUORCH_PORT> as ``/<path>`` (or
        ``/sessions/<job_id>/<path>`` when the session keeps the prefix), without the credential and hop-by-hop
        headers, and the answer streams back; a WebSocket is accepted with the subprotocol the session chose and
        relayed message by message until either side closes (refused before the handshake: the status above as
        an HTTP answer); every request, chunk and message counts as traffic (``requested(job_id)``), which keeps
        the session from being parked as idle
    POST /jobs/<job_id>/exec  {"argv": [...]}   the same credential; runs argv inside the job's running placement
        (``gpuctl exec``): its environment, cwd, cgroups and uid (``supervise.enter_sandbox``), judged by the
        tenant's allow-list like the job's own argv. 404 no running placement here; 403 refused (the reason);
        200 application/octet-stream: stdout and stderr as they come, then a last line ``\\0exit=<code>``; the
        command is killed if the client goes away
    GET /healthz                            200 (no token)

Every answer of the endpoint's own (not a session's) carries ``X-Gpuorch-Executor: 1``.

Configured by environment (read here, so the executor's own configuration is untouched):
    GPUORCH_LOGS_PORT    port to serve on (unset or empty: no endpoint; 0: any free port)
    GPUORCH_LOGS_HOST    address to listen on (default 0.0.0.0)
    GPUORCH_LOGS_URL     the URL to announce (default http://<hostname>:<port>); sent as ``ExecutorHeartbeat.logs_url``
    GPUORCH_LOGS_TOKEN   this executor's log credential, which the API presents (required when the port is set):
                         ``gpuorch_identity.log_credential(GPUORCH_LOGS_SECRET, its broker user)``, printed by
                         ``gpuctl setup logs-credential``; one node's credential opens no other node's endpoint

Only the job id from the request reaches the file system, and only after it parsed as a UUID: no path, no listing.
The proxy connects only to the loopback port this executor gave the session itself (never an address from a
request), so the credential that reads logs reaches sessions too, and nothing else.
A log is ``<node state dir>/logs/<job_id>/<placement_id>.log`` (``placement_store``); the newest one is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import uvicorn
import websockets
from gpuorch_observability import get_logger
from gpuorch_settings import ServiceSettings, SettingsError, setting
from pydantic import model_validator
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from gpuorch_executor.config import ConfigError
from gpuorch_executor.domain.sessions import proxied_path
from gpuorch_executor.log_times import read_index, start_offset, time_at
from gpuorch_executor.supervise import enter_sandbox

log = get_logger(__name__)

READ_CHUNK = 64 * 1024
MAX_EXEC_BODY = 64 * 1024
REQUEST_TIMEOUT_S = 10.0
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "host", "x-forwarded-prefix"}
PROXIED_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class LogEndpointSettings(ServiceSettings):
    """The logs endpoint's settings (``gpuorch_settings``, as the rest of the executor's)."""

    port: int | None = setting("GPUORCH_LOGS_PORT", None, "port of the jobs' logs endpoint (0: any free port; "
                               "unset: not served)", ge=0, le=65535)
    host: str = setting("GPUORCH_LOGS_HOST", "0.0.0.0", "address the logs endpoint listens on")
    token: str = setting("GPUORCH_LOGS_TOKEN", "", "this executor's log credential, which the API presents "
                         "(gpuctl setup logs-credential; required with the port)")
    url: str | None = setting("GPUORCH_LOGS_URL", None, "URL the API reaches this endpoint at (default: derived)")

    @model_validator(mode="after")
    def _token_with_port(self) -> LogEndpointSettings:
        if self.port is not None and not self.token:
            raise ValueError("GPUORCH_LOGS_PORT is set but GPUORCH_LOGS_TOKEN is not: logs are served to the API only")
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LogEndpointSettings | None:
        """None when ``GPUORCH_LOGS_PORT`` is unset; ``ConfigError`` when it is malformed or set without a token."""
        try:
            settings = cls.load(env)
        except SettingsError as exc:
            raise ConfigError(str(exc)) from exc
        return settings if settings.port is not None else None


class SessionTarget(NamedTuple):
    """Where a running session listens (``PlacementRecord.session_port``) and how it is served."""

    port: int
    strip_prefix: bool

class _DenialIsNoError(logging.Filter):
    """uvicorn's WebSocket protocol logs "returned without completing handshake" as an error after a denial response
    (``send_denial_response``: our 401/404/502 before a handshake), which is an answer, not an application bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing handshake" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_DenialIsNoError())


class Refused(Exception):
    """An answer of the endpoint's own instead of what was asked (``status``: 400, 401, 403, 404, 502)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class LogServer:
    """Serves the logs under ``log_dirs`` (one per node this executor serves). ``active(job_id)`` says whether a
    placement of the job is still active here (what ``follow`` waits on); ``session(job_id)`` where a running
    session of the job listens (None: not here), ``requested(job_id)`` is told of each proxied request."""

    def __init__(self, token: str, log_dirs: Sequence[Path], active: Callable[[uuid.UUID], bool],
                 *, poll_s: float = 0.25,
                 session: Callable[[uuid.UUID], SessionTarget | None] = lambda job_id: None,
                 requested: Callable[[uuid.UUID], None] = lambda job_id: None,
                 exec_launch: Callable[[uuid.UUID, list[str]], dict[str, Any] | str | None] = lambda j, a: None,
                 ) -> None:
        self.token = token
        self.exec_launch = exec_launch
        self.log_dirs = list(log_dirs)
        self.active = active
        self.session = session
        self.requested = requested
        self.poll_s = poll_s
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._http: httpx.AsyncClient | None = None
        self.app = Starlette(routes=[
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/jobs/{job_id}/proxy", self._proxy, methods=PROXIED_METHODS),
            Route("/jobs/{job_id}/proxy/{rest:path}", self._proxy, methods=PROXIED_METHODS),
            WebSocketRoute("/jobs/{job_id}/proxy", self._proxy_websocket),
            WebSocketRoute("/jobs/{job_id}/proxy/{rest:path}", self._proxy_websocket),
            Route("/jobs/{job_id}/exec", self._exec, methods=["POST"]),
            Route("/jobs/{job_id:path}/logs", self._logs, methods=["GET"]),  # any id reaches the UUID check: 400
        ], exception_handlers={Refused: _refusal, HTTPException: _refusal})  # type: ignore[dict-item]

    async def start(self, host: str, port: int, url: str | None = None) -> str:
        """Listen; returns the URL announced (``url``, else ``http://<hostname>:<bound port>``)."""
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                date_header=False, proxy_headers=False, timeout_graceful_shutdown=1,
                                timeout_keep_alive=int(REQUEST_TIMEOUT_S), h11_max_incomplete_event_size=16 * 1024)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        # startup() without serve(): no signal handlers of uvicorn's (the executor's own stop the process), no
        # main loop (nothing to tick: no Date header, no request limit)
        await server.startup(sockets=[listener])
        self._server = server
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), follow_redirects=False,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
                                       trust_env=False)
        bound = listener.getsockname()[1]
        announced_host = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = url or f"http://{announced_host}:{bound}"
        log.info("logs_http.listening", url=self.url, port=bound)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.shutdown(), 3)
        if self._http is not None:
            await self._http.aclose()

    def log_file(self, job_id: uuid.UUID) -> Path | None:
        """The newest placement log of the job on this executor, if any."""
        found = [p for d in self.log_dirs for p in (d / str(job_id)).glob("*.log") if p.is_file()]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    def _job(self, headers: Headers, job_text: str) -> uuid.UUID:
        """The job id of an authorized request (Refused 401 before the id is even read, 400 when not a UUID)."""
        presented = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(presented.encode(), self.token.encode()):
            raise Refused(401, "a valid service token is required")
        try:
            return uuid.UUID(job_text)
        except ValueError:
            raise Refused(400, "the job id must be a UUID") from None

    async def _healthz(self, _: Request) -> Response:
        return _reply(200, "ok")

    # -- logs -------------------------------------------------------------------------------------------------

    async def _logs(self, request: Request) -> Response:
        job_id = self._job(request.headers, request.path_params["job_id"])
        query = request.query_params
        try:
            since = float(query["since"]) if query.get("since") else None
            tail = int(query["tail"]) if query.get("tail") else None
            if tail is not None and tail < 0:
                raise ValueError("tail must be 0 or more")
        except ValueError as exc:
            raise Refused(400, f"bad parameter: {exc}") from None
        path = self.log_file(job_id)
        if path is None:
            raise Refused(404, f"no log of job {job_id} on this executor")
        start = start_offset(path, read_index(path), since) if since is not None else 0
        if tail is not None:
            start = max(start, tail_offset(path, tail))
        chunks = self._stream(path, job_id, start=start, follow=_flag(query.get("follow")))
        if _flag(query.get("timestamps")):
            chunks = _timestamped(chunks, path, start)
        return StreamingResponse(chunks, media_type="text/plain; charset=utf-8",
                                 headers={"Cache-Control": "no-cache"})

    async def _stream(self, path: Path, job_id: uuid.UUID, *, start: int, follow: bool) -> AsyncIterator[bytes]:
        with path.open("rb") as handle:
            handle.seek(start)
            while True:
                chunk = handle.read(READ_CHUNK)
                if chunk:
                    yield chunk
                    continue
                if not follow:
                    return
                if not self.active(job_id):
                    rest = handle.read()  # what it wrote before its placement ended
                    if rest:
                        yield rest
                    return
                await asyncio.sleep(self.poll_s)

    # -- sessions ---------------------------------------------------------------------------------------------

    def _target(self, headers: Headers, job_text: str) -> tuple[uuid.UUID, SessionTarget]:
        job_id = self._job(headers, job_text)
        target = self.session(job_id)
        if target is None:
            raise Refused(404, f"no running session of job {job_id} on this executor")
        return job_id, target

    def _upstream(self, scope: Mapping[str, Any], job_id: uuid.UUID, target: SessionTarget) -> tuple[str, list[
            tuple[str, str]]]:
        """The session's request target (``proxied_path`` of the raw, undecoded path) and the headers it gets."""
        parts = scope["raw_path"].decode("latin-1").split("/", 4)  # '', 'jobs', <id>, 'proxy', <rest>
        rest = parts[4] if len(parts) > 4 else ""
        path = proxied_path(job_id, rest, scope["query_string"].decode("latin-1"), target.strip_prefix)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in NOT_FORWARDED]
        if target.strip_prefix:
            headers.append(("x-forwarded-prefix", f"/sessions/{job_id}"))
        return path, headers

    async def _proxy(self, request: Request) -> Response:
        job_id, target = self._target(request.headers, request.path_params["job_id"])
        path, headers = self._upstream(request.scope, job_id, target)
        self.requested(job_id)
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        assert self._http is not None
        upstream = self._http.build_request(
            request.method, f"http://127.0.0.1:{target.port}{path}", headers=headers,
            content=self._counted(request.stream(), job_id) if has_body else None)
        try:
            response = await self._http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            raise Refused(502, f"the session does not answer on its port yet ({exc!r})") from exc
        answer = StreamingResponse(self._counted(_raw(response), job_id), status_code=response.status_code)
        answer.raw_headers = [(k.lower(), v) for k, v in response.headers.raw
                              if k.decode("latin-1").lower() not in HOP_BY_HOP]
        return answer

    async def _counted(self, chunks: AsyncIterator[bytes], job_id: uuid.UUID) -> AsyncIterator[bytes]:
        """``chunks``, each one counted as traffic of the session."""
        async for chunk in chunks:
            self.requested(job_id)
            yield chunk

    async def _proxy_websocket(self, websocket: WebSocket) -> None:
        try:
            job_id, target = self._target(websocket.headers, websocket.path_params["job_id"])
            path, headers = self._upstream(websocket.scope, job_id, target)
            offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")
                       if p.strip()]
            forwarded = [(k, v) for k, v in headers if not k.lower().startswith("sec-websocket-")
                         and k.lower() != "user-agent"]
            self.requested(job_id)
            try:
                upstream = await websockets.connect(
                    f"ws://127.0.0.1:{target.port}{path}", additional_headers=forwarded,
                    subprotocols=offered or None, open_timeout=REQUEST_TIMEOUT_S,  # type: ignore[arg-type]
                    user_agent_header=websocket.headers.get("user-agent"), max_size=16 * 1024 * 1024)
            except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
                raise Refused(502, f"the session does not answer on its port yet ({exc!r})") from exc
        except Refused as refused:
            with contextlib.suppress(RuntimeError):
                await websocket.send_denial_response(_reply(refused.status, refused.text))
                return
            await websocket.close(code=1008 if refused.status < 500 else 1011)
            return
        await websocket.accept(subprotocol=upstream.subprotocol)
        async with upstream:
            await _relay_websocket(websocket, upstream, lambda: self.requested(job_id))

    # -- exec -------------------------------------------------------------------------------------------------

    async def _exec(self, request: Request) -> Response:
        job_id = self._job(request.headers, request.path_params["job_id"])
        try:
            length = int(request.headers.get("content-length", "0"))
            if not 0 < length <= MAX_EXEC_BODY:
                raise ValueError(f"a JSON body of at most {MAX_EXEC_BODY} bytes is required")
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                body = json.loads(await request.body())
            argv = body["argv"]
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty list of strings")
        except (ValueError, KeyError, TypeError, TimeoutError) as exc:
            raise Refused(400, f"bad exec request: {exc}") from None
        launch = self.exec_launch(job_id, argv)
        if launch is None:
            raise Refused(404, f"no running placement of job {job_id} on this executor")
        if isinstance(launch, str):
            raise Refused(403, launch)
        try:
            process = await asyncio.create_subprocess_exec(
                *launch["argv"], executable=launch.get("executable"), env=launch["env"],
                cwd=None if launch.get("user") is not None else launch.get("cwd"), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: enter_sandbox(launch))
        except (OSError, subprocess.SubprocessError) as exc:
            raise Refused(403, f"cannot start it in the job's sandbox: {exc}") from None
        log.info("logs_http.exec", job_id=str(job_id), argv0=argv[0], pid=process.pid)
        return StreamingResponse(_exec_output(process), media_type="application/octet-stream",
                                 headers={"Cache-Control": "no-cache"})


async def _exec_output(process: asyncio.subprocess.Process) -> AsyncIterator[bytes]:
    """The command's output as it comes, then ``\\0exit=<code>``; the command is killed if this stops early."""
    assert process.stdout is not None
    try:
        while chunk := await process.stdout.read(READ_CHUNK):
            yield chunk
        code = await process.wait()
        yield f"\0exit={code}\n".encode()
    finally:
        if process.returncode is None:  # the client went away: the command goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def _raw(response: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream answer's bytes as they come (as sent: no decoding), until it ends or breaks."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        return
    finally:
        await response.aclose()


async def _relay_websocket(websocket: WebSocket, upstream: Any, traffic: Callable[[], None]) -> None:
    """Messages both ways until either side closes; each one is traffic."""
    async def to_session() -> None:
        with contextlib.suppress(WebSocketDisconnect, websockets.ConnectionClosed):
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                traffic()
                if message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
                elif message.get("text") is not None:
                    await upstream.send(message["text"])

    async def from_session() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in upstream:
                traffic()
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


async def _timestamped(chunks: AsyncIterator[bytes], path: Path, start: int) -> AsyncIterator[bytes]:
    """``chunks`` (the log from ``start``) as lines, each prefixed with its time (``log_times``) and a space."""
    entries = read_index(path)
    offset = start
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        out = []
        for line in lines:
            offset += len(line) + 1
            when = time_at(entries, offset)
            if when is None:  # written after the index's last entry: read it again, else it is being written now
                entries = read_index(path)
                when = time_at(entries, offset) or time.time()
            out.append(_stamp(when) + line + b"\n")
        if out:
            yield b"".join(out)
    if pending:  # a last line without its newline
        yield _stamp(time_at(entries, offset + len(pending)) or time.time()) + pending


def _stamp(when: float) -> bytes:
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z").encode() + b" "


def tail_offset(path: Path, lines: int) -> int:
    """Where the last ``lines`` lines of the file start (a last line without its newline counts)."""
    with path.open("rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        if lines == 0:
            return end
        position, seen = end, 0
        if end and (handle.seek(end - 1), handle.read(1))[1] == b"\n":
            seen = -1  # the newline that ends the last line starts no line
        while position > 0:
            step = min(READ_CHUNK, position)
            position -= step
            handle.seek(position)
            block = handle.read(step)
            index = len(block)
            while (index := block.rfind(b"\n", 0, index)) >= 0:
                seen += 1
                if seen == lines:
                    return position + index + 1
        return 0


def _flag(value: str | None) -> bool:
    return value in ("1", "true", "yes")


def _reply(status: int, text: str) -> Response:
    return PlainTextResponse(text + "\n", status_code=status, headers={"X-Gpuorch-Executor": "1"})


async def _refusal(_: Request | WebSocket, exc: Exception) -> Response:
    if isinstance(exc, Refused):
        return _reply(exc.status, exc.text)
    assert isinstance(exc, HTTPException)
    return _reply(exc.status_code, exc.detail)


async def start_log_endpoint(log_dirs: Sequence[Path], active: Callable[[uuid.UUID], bool],
                             session: Callable[[uuid.UUID], SessionTarget | None] = lambda job_id: None,
                             requested: Callable[[uuid.UUID], None] = lambda job_id: None,
                             exec_launch: Callable[[uuid.UUID, list[str]], dict[str, Any] | str | None]
                             = lambda j, a: None) -> LogServer | None:
    """Start the endpoint the environment asks for (see the module docstring); None when it asks for none."""
    settings = LogEndpointSettings.from_env()
    if settings is None or settings.port is None:
        return None
    server = LogServer(settings.token, log_dirs, active, session=session, requested=requested,
                       exec_launch=exec_launch)
    await server.start(settings.host, settings.port, settings.url)
    return server
