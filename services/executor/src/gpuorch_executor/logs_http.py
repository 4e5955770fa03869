"""The executor's log endpoint: its jobs' output over HTTP, the way the kubelet serves ``kubectl logs``.

    GET /jobs/<job_id>/logs[?follow=1]      Authorization: Bearer <GPUORCH_LOGS_TOKEN> (this executor's own)
        401  no or another token;  400  a job id that is not a UUID;  404  no log of that job on this executor
        200  text/plain, the body ends when the connection closes: the job's newest placement log from its start;
             with follow=1 it goes on sending what the job writes until that placement is no longer active here
             and the file is drained, or the client goes away
    GET /healthz                            200 (no token)

Configured by environment (read here, so the executor's own configuration is untouched):
    GPUORCH_LOGS_PORT    port to serve on (unset or empty: no endpoint; 0: any free port)
    GPUORCH_LOGS_HOST    address to listen on (default 0.0.0.0)
    GPUORCH_LOGS_URL     the URL to announce (default http://<hostname>:<port>); sent as ``ExecutorHeartbeat.logs_url``
    GPUORCH_LOGS_TOKEN   this executor's log credential, which the API presents (required when the port is set):
                         ``gpuorch_identity.log_credential(GPUORCH_LOGS_SECRET, its broker user)``, printed by
                         ``gpuctl setup logs-credential``; one node's credential opens no other node's endpoint

Only the job id from the request reaches the file system, and only after it parsed as a UUID: no path, no listing.
A log is ``<node state dir>/logs/<job_id>/<placement_id>.log`` (``placement_store``); the newest one is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from gpuorch_observability import get_logger
from gpuorch_settings import ServiceSettings, SettingsError, setting
from pydantic import model_validator

from gpuorch_executor.config import ConfigError

log = get_logger(__name__)

READ_CHUNK = 64 * 1024
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


class LogServer:
    """Serves the logs under ``log_dirs`` (one per node this executor serves). ``active(job_id)`` says whether a
    placement of the job is still active here (what ``follow`` waits on)."""

    def __init__(self, token: str, log_dirs: Sequence[Path], active: Callable[[uuid.UUID], bool],
                 *, poll_s: float = 0.25) -> None:
        self.token = token
        self.log_dirs = list(log_dirs)
        self.active = active
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
            await self._answer(request_line, headers, writer)
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request_line: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        method, _, rest = request_line.partition(" ")
        target = rest.rsplit(" ", 1)[0]
        url = urlsplit(target)
        parts = url.path.strip("/").split("/")
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
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}[status]
    body = (text + "\n").encode()
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def start_log_endpoint(log_dirs: Sequence[Path], active: Callable[[uuid.UUID], bool]) -> LogServer | None:
    """Start the endpoint the environment asks for (see the module docstring); None when it asks for none."""
    settings = LogEndpointSettings.from_env()
    if settings is None or settings.port is None:
        return None
    server = LogServer(settings.token, log_dirs, active)
    await server.start(settings.host, settings.port, settings.url)
    return server
