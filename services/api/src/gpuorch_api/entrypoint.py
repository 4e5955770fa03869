"""gpuorch-api: the HTTP API and dashboard (FastAPI on uvicorn).

    environment -> Settings -> create_app(settings): FastAPI
        RequestGuard (limits.py, outermost): NUL in the path -> 400, body over the limit -> 413 before it is read,
                     a caller over its rate limit -> 429, before any route parses or authenticates anything
        lifespan: in the background, migrate the database (0300_api: the API's role and table) and open_backends
                  (pool, broker, streams), waiting for as long as either server is down: 503 until then
        routes.router, dlq_routes.router, reservation_routes.router (handlers) -> readmodels / gateway / live -> domain.views
        errors: problem details (problems.py, application/problem+json): ApiError with its status (401 with
                WWW-Authenticate: Bearer); a bad query or body -> 422 with every invalid field; the broker
                refusing a publish -> 503

Any number of instances may run side by side: the API keeps no state of its own but ``api_submissions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from gpuorch_identity import IdentityMap, configured_identity_map
from gpuorch_messaging import PublishError
from gpuorch_observability import READINESS, configure, get_logger, start_metrics_server, until_up
from gpuorch_settings import ServiceSettings, load_or_exit, setting
from pydantic import PrivateAttr, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuorch_api import metrics, schemas
from gpuorch_api.auth import ApiError
from gpuorch_api.auth_routes import router as auth_router
from gpuorch_api.backends import Backends, open_backends
from gpuorch_api.dlq_routes import router as dlq_router
from gpuorch_api.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_RATE_LIMIT, RateLimits, RequestGuard
from gpuorch_api.node_logs import LogsUnavailable
from gpuorch_api.problems import documented_as_problems, invalid_fields, problem, validation_detail
from gpuorch_api.reservation_routes import router as reservation_router
from gpuorch_api.routes import router
from gpuorch_api.sessions import router as sessions_router

log = get_logger(__name__)

class Settings(ServiceSettings):
    """The API's settings (``gpuorch_settings``: environment variables, an optional TOML/JSON file under them;
    ``gpuorch-api --help`` lists them). Derived at load: ``identity_map`` and ``quotas_by_tenant``."""

    amqp_url: str = setting("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/",
                            "RabbitMQ URL: the API's own broker user (a gateway identity)")
    database_url: str = setting("GPUORCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/gpuorch",
                                "PostgreSQL DSN: a user in role gpuorch_api")
    identity_map_path: str = setting("GPUORCH_IDENTITY_MAP", "", "identity map (JSON) with the sha256 digests of "
                                     "the API tokens (its 'tokens')")
    identity: Literal["strict", "trust_all"] = setting("GPUORCH_IDENTITY", "strict", "strict; trust_all (local "
                                                       "development) allows running without an identity map")
    host: str = setting("GPUORCH_API_HOST", "0.0.0.0", "address to listen on")
    port: int = setting("GPUORCH_API_PORT", 8080, "HTTP port: API, /openapi.json, /healthz, /readyz, dashboard",
                        ge=0, le=65535)
    quotas: str = setting("GPUORCH_QUOTAS", "", "tenant quotas as JSON, as the scheduler reads them (shown "
                          "against allocation)")
    quotas_file: str = setting("GPUORCH_QUOTAS_FILE", "", "path of a JSON file with the quotas (GPUORCH_QUOTAS "
                               "wins)")
    jaeger_url: str | None = setting("GPUORCH_JAEGER_URL", None, "Jaeger UI base URL for trace links, e.g. "
                                     "http://localhost:16686 (unset: no links)")
    dlq_amqp_url: str | None = setting("GPUORCH_DLQ_AMQP_URL", None, "RabbitMQ URL of an operator broker user "
                                       "(gpuctl-operator) for the dead-letter routes (unset: GPUORCH_AMQP_URL, "
                                       "whose user then needs read on *.dlq)")
    max_body_bytes: int = setting("GPUORCH_API_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, "largest request body "
                                  "accepted (413 above it, before the body is read or the caller authenticated)",
                                  ge=1024)
    rate_limit: str = setting("GPUORCH_API_RATE_LIMIT", DEFAULT_RATE_LIMIT, "requests per caller (token, else "
                              "client address) to /api/, as 'limits' items: '50/second;1500/minute' ('' : none)")
    rate_limit_storage: str = setting("GPUORCH_API_RATE_LIMIT_STORAGE", "memory://", "where the rate limits count: "
                                      "memory:// (this process) or a shared limits storage, e.g. redis://host:6379")
    metrics_port: int = setting("GPUORCH_METRICS_PORT", 0, "internal port of /metrics (and /healthz, /readyz) for "
                                "Prometheus; the API's port serves no /metrics (0: off)", ge=0, le=65535)
    logs_secret: str | None = setting("GPUORCH_LOGS_SECRET", None, "the secret each executor's log credential is "
                                      "derived from (gpuctl setup logs-credential; unset: no job logs)")

    _identity_map: IdentityMap | None = PrivateAttr(default=None)
    _quotas: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _derive(self) -> Settings:
        RateLimits(self.rate_limit, self.rate_limit_storage)  # a malformed limit or storage fails at start
        self._identity_map = configured_identity_map(self.identity_map_path, self.identity)
        self._quotas = _quotas(self.quotas, self.quotas_file)
        return self

    @property
    def identity_map(self) -> IdentityMap:
        assert self._identity_map is not None
        return self._identity_map

    @property
    def quotas_by_tenant(self) -> dict[str, dict[str, Any]]:
        return self._quotas


def _quotas(text: str, path: str) -> dict[str, dict[str, Any]]:
    """``{tenant: {"gpus": n, ...}}`` from GPUORCH_QUOTAS, else from the file GPUORCH_QUOTAS_FILE names."""
    if not text and path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"GPUORCH_QUOTAS_FILE: {exc}") from exc
    try:
        quotas = json.loads(text) if text else {}
    except ValueError as exc:
        raise ValueError(f"GPUORCH_QUOTAS: {exc}") from exc
    if not isinstance(quotas, dict) or not all(isinstance(v, dict) for v in quotas.values()):
        raise ValueError('GPUORCH_QUOTAS: expected {"<tenant>": {"gpus": <n>, ...}, ...}')
    return quotas


def create_app(settings: Settings | None = None, *, backends: Backends | None = None,
               max_body_bytes: int | None = None, rate_limits: RateLimits | None = None) -> FastAPI:
    """The ASGI app. With ``settings`` it migrates and connects once it started, for as long as the servers are
    down (``_connect``); tests may pass ready ``backends`` (and
    their own ``max_body_bytes`` and ``rate_limits``; else the settings', else the defaults)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if backends is not None:
            app.state.backends = backends
            yield
            return
        assert settings is not None
        connecting = asyncio.create_task(_connect(app, settings), name="api-connect")
        try:
            yield
        finally:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a failed start was logged already
                await connecting
            if getattr(app.state, "backends", None) is not None:
                await app.state.backends.close()

    app = FastAPI(title="gpuorch API", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Jobs, fleet, queues and tenants of gpuorch; submissions and cancels on the "
                              "caller's behalf; live events. Authenticate with `Authorization: Bearer <token>`; errors are problem details (RFC 9457).")
    app.include_router(router, responses=schemas.ERRORS)
    app.include_router(auth_router, responses=schemas.ERRORS)
    app.include_router(dlq_router, responses=schemas.ERRORS)
    app.include_router(reservation_router, responses=schemas.ERRORS)
    app.include_router(sessions_router, responses=schemas.ERRORS)
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = documented_as_problems(plain_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    _install_error_handlers(app)
    app.middleware("http")(metrics.record_request)
    if rate_limits is None:
        rate_limits = (RateLimits(settings.rate_limit, settings.rate_limit_storage) if settings is not None
                       else RateLimits())
    if max_body_bytes is None:
        max_body_bytes = settings.max_body_bytes if settings is not None else DEFAULT_MAX_BODY_BYTES
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, rate_limits=rate_limits)  # outermost
    _serve_docs(app)
    _mount_dashboard(app)
    return app


SWAGGER_ASSETS = "/vendor/swagger-ui"
"""Where the dashboard's static files hold swagger-ui-dist's bundle, stylesheet and icon (no CDN: a browser
without internet access still shows ``/docs``)."""


def _serve_docs(app: FastAPI) -> None:
    """Swagger UI at ``/docs`` from the vendored assets (FastAPI's default loads them from a CDN); no ReDoc."""
    from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
    from fastapi.responses import HTMLResponse

    redirect = "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - docs",
                                   swagger_js_url=f"{SWAGGER_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{SWAGGER_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{SWAGGER_ASSETS}/favicon-32x32.png",
                                   oauth2_redirect_url=redirect)

    @app.get(redirect, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()


async def _connect(app: FastAPI, settings: Settings) -> None:
    """Migrate and open the backends, waiting as long as PostgreSQL or RabbitMQ is down (or the database not
    created yet): the API serves meanwhile, ``/readyz`` and every route that needs them answer 503 with why. Any
    other error (credentials, a failed migration) is logged and stays the reason of those 503s."""
    from gpuorch_store import DATABASE_UNREACHABLE
    from gpuorch_store.migrations import migrate

    READINESS.mark("backends", "connecting to PostgreSQL and RabbitMQ")
    try:
        await until_up("database", lambda: migrate(settings.database_url), transient=DATABASE_UNREACHABLE,
                       failing="PostgreSQL unreachable")
        app.state.backends = await open_backends(
            amqp_url=settings.amqp_url, database_url=settings.database_url, identity_map=settings.identity_map,
            quotas=settings.quotas_by_tenant, jaeger_url=settings.jaeger_url, logs_secret=settings.logs_secret,
            identity=settings.identity, dlq_amqp_url=settings.dlq_amqp_url, timeout_s=None)
    except Exception as exc:  # a refusal waiting cannot mend (credentials, a failed migration): say it, stay up
        log.error("api.start_failed", error=repr(exc))
        READINESS.mark("backends", f"start failed: {exc!r}"[:300])
        raise
    READINESS.mark("backends", None)
    log.info("api.ready", port=settings.port)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as problem details (problems.py), whoever raised it."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return problem(exc.status, exc.message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = invalid_fields(exc.errors())
        return problem(422, validation_detail(fields), errors=fields)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        log.error("api.request_failed", error=repr(exc))
        return problem(500, f"internal error: {type(exc).__name__}")

    @app.exception_handler(LogsUnavailable)
    async def no_logs(_: Request, exc: LogsUnavailable) -> JSONResponse:
        return problem(exc.status, exc.message)

    @app.exception_handler(PublishError)
    async def not_published(_: Request, exc: PublishError) -> JSONResponse:
        return problem(503, f"not published: {exc} (is the scheduler running?)")


def _mount_dashboard(app: FastAPI) -> None:
    """The dashboard's static files (``static/``) at ``/``, when they are present; the chart library and its
    helpers at ``/charts/`` from ``gpuorch_report`` (the one copy the weekly report's HTML inlines too)."""
    from fastapi.staticfiles import StaticFiles
    from gpuorch_report.charts import WEB_ASSETS

    app.mount("/charts", StaticFiles(directory=WEB_ASSETS), name="charts")
    static = Path(__file__).parent / "static"
    if (static / "index.html").exists():
        app.mount("/", StaticFiles(directory=static, html=True), name="dashboard")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    settings, _ = load_or_exit(Settings, argv, prog="gpuorch-api", description="gpuorch's HTTP API and dashboard.")
    configure("gpuorch-api", log_level=settings.log_level, otlp_endpoint=settings.otlp_endpoint)
    start_metrics_server(settings.metrics_port)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
