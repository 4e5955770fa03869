"""The executor's log endpoint: its jobs' output over HTTP, the way the kubelet serves ``kubectl logs``.

    GET /jobs/<job_id>/logs[?follow=1]      Authorization: Bearer <GPUORCH_LOGS_TOKEN> (this executor's own)
        401  no or another token;  400  a job id that is not a UUID;  404  no log of that job on this executor
        200  text/plain, the body ends when the connection closes: the job's newest placement log from its start;
             with follow=1 it goes on sending what the job writes until that placement is no longer active here
             and the file is drained, or the client goes away
    ANY /jobs/<job_id>/proxy/<path>         Authorization: the same credential; an interactive session's port
        404  no running session of that job here;  502  the session does not answer on its port
        otherwise the session's own answer: the request (HTTP, or a WebSocket upgrade) goes to 127.0.0.1:<its
        GPUORCH_PORT> as ``/<path>`` (or ``/sessions/<job_id>/<path>`` when the session keeps the prefix), without
        the credential, and bytes flow both ways until either side closes; every request and every chunk counts as
        traffic (``requested(job_id)``), which keeps the session from being parked as idle
    POST /jobs/<job_id>/exec  {"argv": [...]}   the same credential; runs argv inside the job's running placement
        (``gpuctl exec``): its environment, cwd, cgroups and uid (``supervise.enter_sandbox``), judged by the
        tenant's allow-list like the job's own argv. 404 no running placement here; 403 refused (the reason);
        200 application/octet-stream: stdout and stderr as they come, then a last line ``\0exit=<code>``; the
        command is killed if the client goes away
    GET /healthz                            200 (no token)

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
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from gpuorch_observability import get_logger
from gpuorch_settings import ServiceSettings, SettingsError, setting
from pydantic import model_validator

from gpuorch_executor.config import ConfigError
from gpuorch_executor.domain.sessions import proxied_path
from gpuorch_executor.supervise import enter_sandbox

log = get_logger(__name__)

READ_CHUNK = 64 * 1024
MAX_EXEC_BODY = 64 * 1024
REQUEST_TIMEOUT_S = 10.0


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
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, url: str | None = None) -> str:
        """Listen; returns the URL announced (``url``, else ``http://<hostname>:<bound port>``)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=16 * 1024)
        bound = self._server.sockets[0].getsockname()[1]
        announced_host = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = url or f"http://{announced_host}:{bound}"
        log.info("logs_http.listening", url=self.url, port=bound)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def log_file(self, job_id: uuid.UUID) -> Path | None:
        """The newest placement log of the job on this executor, if any."""
        found = [p for d in self.log_dirs for p in (d / str(job_id)).glob("*.log") if p.is_file()]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                request_line = (await reader.readline()).decode("latin-1").strip()
                headers: dict[str, str] = {}
                while True:
                    line = (await reader.readline()).decode("latin-1").strip()
                    if not line:
                        break
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            await self._answer(request_line, headers, writer, reader)
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request_line: str, headers: dict[str, str], writer: asyncio.StreamWriter,
                      reader: asyncio.StreamReader) -> None:
        method, _, rest = request_line.partition(" ")
        target = rest.rsplit(" ", 1)[0]
        url = urlsplit(target)
        parts = url.path.strip("/").split("/")
        if len(parts) >= 3 and parts[0] == "jobs" and parts[2] == "proxy":
            return await self._proxy(method, url.path, url.query, parts[1], headers, reader, writer)
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "exec" and method == "POST":
            return await self._exec(parts[1], headers, reader, writer)
        if method != "GET":
            return await _reply(writer, 405, "only GET")
        if parts == ["healthz"]:
            return await _reply(writer, 200, "ok")
        if len(parts) != 3 or parts[0] != "jobs" or parts[2] != "logs":
            return await _reply(writer, 404, "no such route")
        presented = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(presented.encode(), self.token.encode()):
            return await _reply(writer, 401, "a valid service token is required")
        try:
            job_id = uuid.UUID(parts[1])
        except ValueError:
            return await _reply(writer, 400, "the job id must be a UUID")
        path = self.log_file(job_id)
        if path is None:
            return await _reply(writer, 404, f"no log of job {job_id} on this executor")
        follow = parse_qs(url.query).get("follow", ["0"])[0] in ("1", "true", "yes")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                     b"Cache-Control: no-cache\r\n\r\n")
        await writer.drain()
        await self._stream(path, job_id, follow, writer)

    def _authorized(self, headers: dict[str, str]) -> bool:
        presented = headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(presented.encode(), self.token.encode())

    async def _proxy(self, method: str, path: str, query: str, job_text: str, headers: dict[str, str],
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._authorized(headers):
            return await _reply(writer, 401, "a valid service token is required")
        try:
            job_id = uuid.UUID(job_text)
        except ValueError:
            return await _reply(writer, 400, "the job id must be a UUID")
        target = self.session(job_id)
        if target is None:
            return await _reply(writer, 404, f"no running session of job {job_id} on this executor")
        rest = path[len(f"/jobs/{job_text}/proxy"):]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target.port)
        except OSError as exc:
            return await _reply(writer, 502, f"the session does not answer on its port yet ({exc.strerror})")
        self.requested(job_id)
        upgrade = "upgrade" in headers.get("connection", "").lower() and "upgrade" in headers
        head = [f"{method} {proxied_path(job_id, rest, query, target.strip_prefix)} HTTP/1.1",
                f"Host: 127.0.0.1:{target.port}", "Connection: Upgrade" if upgrade else "Connection: close"]
        head += [f"{name}: {value}" for name, value in headers.items()
                 if name not in ("authorization", "host", "connection", "x-forwarded-prefix")]
        if target.strip_prefix:
            head.append(f"X-Forwarded-Prefix: /sessions/{job_id}")
        upstream_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        to_session = asyncio.create_task(self._pump(reader, upstream_writer, job_id, half_close=True))
        try:
            await self._pump(upstream_reader, writer, job_id, half_close=False)
        finally:
            to_session.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await to_session
            upstream_writer.close()

    async def _exec(self, job_text: str, headers: dict[str, str], reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        if not self._authorized(headers):
            return await _reply(writer, 401, "a valid service token is required")
        try:
            job_id = uuid.UUID(job_text)
            length = int(headers.get("content-length", "0"))
            if not 0 < length <= MAX_EXEC_BODY:
                raise ValueError(f"a JSON body of at most {MAX_EXEC_BODY} bytes is required")
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                body = json.loads(await reader.readexactly(length))
            argv = body["argv"]
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty list of strings")
        except (ValueError, KeyError, TypeError, asyncio.IncompleteReadError) as exc:
            return await _reply(writer, 400, f"bad exec request: {exc}")
        launch = self.exec_launch(job_id, argv)
        if launch is None:
            return await _reply(writer, 404, f"no running placement of job {job_id} on this executor")
        if isinstance(launch, str):
            return await _reply(writer, 403, launch)
        try:
            process = await asyncio.create_subprocess_exec(
                *launch["argv"], executable=launch.get("executable"), env=launch["env"],
                cwd=None if launch.get("user") is not None else launch.get("cwd"), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: enter_sandbox(launch))
        except (OSError, subprocess.SubprocessError) as exc:
            return await _reply(writer, 403, f"cannot start it in the job's sandbox: {exc}")
        log.info("logs_http.exec", job_id=str(job_id), argv0=argv[0], pid=process.pid)
        assert process.stdout is not None
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n"
                         b"Cache-Control: no-cache\r\n\r\n")
            while chunk := await process.stdout.read(READ_CHUNK):
                writer.write(chunk)
                await writer.drain()
            code = await process.wait()
            writer.write(f"\0exit={code}\n".encode())
            await writer.drain()
        finally:
            if process.returncode is None:  # the client went away: the command goes too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, job_id: uuid.UUID, *,
                    half_close: bool) -> None:
        """Copy bytes until ``source`` ends; each chunk is traffic of the session."""
        with contextlib.suppress(ConnectionError):
            while chunk := await source.read(READ_CHUNK):
                self.requested(job_id)
                sink.write(chunk)
                await sink.drain()
            if half_close and sink.can_write_eof():
                sink.write_eof()

    async def _stream(self, path: Path, job_id: uuid.UUID, follow: bool, writer: asyncio.StreamWriter) -> None:
        with path.open("rb") as handle:
            while True:
                chunk = handle.read(READ_CHUNK)
                if chunk:
                    writer.write(chunk)
                    await writer.drain()
                    continue
                if not follow or writer.is_closing():
                    return
                if not self.active(job_id):
                    rest = handle.read()  # what it wrote before its placement ended
                    if rest:
                        writer.write(rest)
                        await writer.drain()
                    return
                await asyncio.sleep(self.poll_s)


async def _reply(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
              405: "Method Not Allowed", 502: "Bad Gateway"}[status]
    body = (text + "\n").encode()
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nX-Gpuorch-Executor: 1\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()


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
