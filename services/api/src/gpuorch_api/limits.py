"""What one request and one caller may cost the API, checked before any route parses or authenticates anything.

    request --RequestGuard (outermost ASGI middleware)-->
        a path with a NUL or another control character          -> 400 (never reaches a route, a file or SQL)
        Content-Length above max_body_bytes                     -> 413 at once; the body is never read
        a body without Content-Length that grows past the limit -> 413 when the limit is crossed (at most
                                                                   max_body_bytes are ever held)
        /api/ paths: one hit per rate limit for the caller       -> 429 with Retry-After when a limit is spent
            the caller: the token's sha256 when the identity map knows it, else the client address (a flood of
            made-up tokens shares its address's budget)
        -> the app (routes, metrics, dashboard)
Its refusals are problem details (problems.py), as the app's are.

Rate limits are ``limits`` library items ("20/second;600/minute", moving windows) kept in a ``limits`` storage:
``memory://`` per API process (the default), or a shared one (``redis://...``) so that several API instances
count together (docs/decisions.md). Health endpoints and the dashboard's static files are not rate limited.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gpuorch_identity import IdentityMap, token_digest
from limits import RateLimitItem, parse_many
from limits.aio.storage import Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string

from gpuorch_api.problems import MEDIA_TYPE, problem_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Above the largest valid submission (256 argv strings and 128 env values of 4 KiB each, JSON-escaped)."""
DEFAULT_RATE_LIMIT = "50/second;1500/minute"
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
RATE_LIMITED_PREFIX = "/api/"


async def _answer(send: Send, status: int, error: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(problem_body(status, error)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", MEDIA_TYPE.encode()), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class RateLimits:
    """Per-caller rate limits over a ``limits`` storage (module docstring)."""

    def __init__(self, spec: str = DEFAULT_RATE_LIMIT, storage_uri: str = "memory://") -> None:
        self.items: list[RateLimitItem] = parse_many(spec) if spec.strip() else []
        uri = storage_uri if storage_uri.startswith("async+") else f"async+{storage_uri}"
        storage = storage_from_string(uri)
        assert isinstance(storage, Storage)
        self.limiter = MovingWindowRateLimiter(storage)

    async def spent(self, key: str) -> tuple[RateLimitItem, float] | None:
        """None while ``key`` is within every limit (this request counted); else the limit spent and the seconds
        until it frees a request."""
        for item in self.items:
            if not await self.limiter.hit(item, key):
                stats = await self.limiter.get_window_stats(item, key)
                return item, max(0.0, stats.reset_time - time.time())
        return None


def caller_key(scope: Scope, identity_map: IdentityMap | None) -> str:
    """The rate-limit key of a request: its known token's digest, else its client address."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            digest = token_digest(token.strip())
            if scheme.lower() == "bearer" and identity_map is not None and digest in identity_map.tokens:
                return f"token:{digest}"
            break
    client = scope.get("client") or ("unknown", 0)
    return f"address:{client[0]}"


class RequestGuard:
    """The outermost ASGI middleware (module docstring). ``identity_map`` is read per request from the app's
    backends (they exist once the lifespan started)."""

    def __init__(self, app: App, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 rate_limits: RateLimits | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.rate_limits = rate_limits if rate_limits is not None else RateLimits()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if CONTROL.search(scope.get("path", "")):
            await _answer(send, 400, "the path holds a control character")
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        try:
            length = int(declared) if declared is not None else None
        except ValueError:
            await _answer(send, 400, "Content-Length is not a number")
            return
        if length is not None and length > self.max_body_bytes:
            await _answer(send, 413, f"the body is {length} bytes; the limit is {self.max_body_bytes}")
            return
        if scope.get("path", "").startswith(RATE_LIMITED_PREFIX) and self.rate_limits.items:
            backends = getattr(getattr(scope.get("app"), "state", None), "backends", None)
            spent = await self.rate_limits.spent(caller_key(scope, getattr(backends, "identity_map", None)))
            if spent is not None:
                item, retry_s = spent
                await _answer(send, 429, f"rate limit {item} spent for this caller; retry in {retry_s:.1f} s",
                              [(b"retry-after", str(max(1, math.ceil(retry_s))).encode())])
                return
        await self._guarded(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, counting the body it reads. Past the limit the client gets 413 (unless an answer had
        started), the app is told the client went away, and whatever it answers then is dropped."""
        received = 0
        started = answered = False

        async def counted_receive() -> Message:
            nonlocal received, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if not started:
                        await _answer(send, 413, f"the body is over the limit of {self.max_body_bytes} bytes")
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, tracked_send)
