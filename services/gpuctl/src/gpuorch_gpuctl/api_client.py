"""gpuctl's client of the gpuorch API (services/api): one request per call, errors as one line and an exit code
(errors.py: ``fail``).

    ApiClient(endpoint).get("/api/v1/jobs", state="queued") -> decoded JSON
        API unreachable                  -> "gpuctl: cannot reach the gpuorch API at URL: ..."  exit 1
        401 / 403 / 404 / 409 / 5xx      -> "gpuctl: <the problem's detail>"                     exit 1
        400 / 422 (a bad value)          -> "gpuctl: <error>"                                    exit 2
    stream(path) -> iterator of text lines (Server-Sent Events, followed logs), same errors before the first line
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpuorch_gpuctl.contexts import Endpoint, context_endpoint, explicit_endpoint
from gpuorch_gpuctl.errors import USAGE, fail
from gpuorch_gpuctl.settings import this_run

if TYPE_CHECKING:
    import httpx

TIMEOUT_S, CONNECT_TIMEOUT_S = 30.0, 5.0
"""A request's timeouts; httpx itself loads with the first client (``gpuctl --help`` does not import it)."""


class ApiClient:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
        import httpx

        self.http = httpx.Client(base_url=endpoint.server, headers=headers,
                                 timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(self, path: str, **params: Any) -> Any:
        return self._json(self._send("GET", path, params=_clean(params)))

    def find(self, path: str) -> Any:
        """Like ``get``, but None for 404 (a job just submitted is not in the read model yet)."""
        import httpx

        try:
            response = self.http.get(path)
        except httpx.HTTPError as exc:
            fail(self._unreachable(exc))
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            fail(*self._refusal(response))
        return self._json(response)

    def post(self, path: str, body: Any = None) -> Any:
        return self._json(self._send("POST", path, json=body))

    def delete(self, path: str, **params: Any) -> Any:
        return self._json(self._send("DELETE", path, params=_clean(params)))

    def stream_lines(self, path: str, **params: Any) -> Iterator[str]:
        """Lines of a long response as they arrive (``?follow`` logs, live events)."""
        with self._streamed("GET", path, params=_clean(params)) as response:
            yield from response.iter_lines()

    def stream_bytes(self, method: str, path: str, body: Any = None) -> Iterator[bytes]:
        """A long response's bytes as they arrive (``gpuctl exec``)."""
        with self._streamed(method, path, json=body) as response:
            yield from response.iter_raw()

    @contextlib.contextmanager
    def _streamed(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        import httpx

        request = self.http.build_request(method, path, timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S, read=None),
                                          **kwargs)
        try:
            response = self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            fail(self._unreachable(exc))
        try:
            if response.status_code >= 400:
                response.read()
                fail(*self._refusal(response))
            yield response
        except httpx.HTTPError as exc:
            fail(f"the stream from {self.endpoint.server} broke: {exc}")
        finally:
            response.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            fail(self._unreachable(exc))
        if response.status_code >= 400:
            fail(*self._refusal(response))
        return response

    def _unreachable(self, exc: Exception) -> str:
        """The error for an API out of reach (exit 1)."""
        where = f"context {self.endpoint.context}: " if self.endpoint.context else ""
        return f"cannot reach the gpuorch API at {where}{self.endpoint.server}: {type(exc).__name__}: {exc}"

    def _refusal(self, response: httpx.Response) -> tuple[str, int]:
        """The error and exit code for an answer >= 400 (the module doc's table)."""
        try:
            body = response.json()
            message = body.get("detail") or body.get("error") or response.text  # problem details, or older APIs
        except ValueError:
            message = response.text or response.reason_phrase
        if response.status_code == 401 and not self.endpoint.token:
            message += " (set a token: gpuctl config set-context ... --token, or GPUCTL_TOKEN)"
        return f"{message} (HTTP {response.status_code})", USAGE if response.status_code in (400, 422) else 1

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            fail(f"the API answered something other than JSON: {response.text[:200]}")


def _clean(params: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v is not None}


def api() -> ApiClient:
    """The API this run talks to (contexts.py: options, environment, config file), or a one-line error saying
    how to name one."""
    run = this_run()
    endpoint = explicit_endpoint(run) or context_endpoint(run)
    if endpoint is None:
        fail("no gpuorch API configured: gpuctl config set-context NAME --server URL --token TOKEN "
             "(or --server/GPUCTL_SERVER; `gpuctl demo --keep` writes a context)")
    return ApiClient(endpoint)


def api_or_dsn(direct: str | None) -> ApiClient | str:
    """An API named explicitly (``--server``, ``--context``, ``GPUCTL_SERVER``), else ``direct`` when given (a
    ``--dsn`` or ``--amqp-url``: the direct path for scripts, decision 31), else the current context's API."""
    endpoint = explicit_endpoint(this_run())
    if endpoint is not None:
        return ApiClient(endpoint)
    if direct:
        return direct
    return api()
