"""Telemetry process: settings -> broker consumer + periodic duties + ``/metrics``.

Settings (``Settings``; ``gpuorch-telemetry --help`` lists them): environment variables, or a TOML/JSON file
(``--config`` / ``GPUORCH_CONFIG_FILE``) under them, validated at start (``gpuorch_settings``). Required:
``GPUORCH_AMQP_URL`` and ``GPUORCH_DATABASE_URL`` (migrations applied). A database or broker that is down (or
a database not created yet) at start is waited for, never a reason to exit (``/readyz`` fails meanwhile). Every detection threshold has its variable
(``GPUORCH_TELEMETRY_<FIELD>`` of ``DetectionConfig``, e.g. ``GPUORCH_TELEMETRY_WINDOW_S=600``); the autoscaler
duty (``gpuorch_capacity``) is off unless ``GPUORCH_CAPACITY_MODE`` says advise or auto.

Several instances consume the one durable quorum queue ``telemetry.samples`` side by side (competing consumers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from gpuorch_capacity import Mode
from gpuorch_capacity.observe import pools_from_json
from gpuorch_contracts import utc_now
from gpuorch_identity import load_identity_map
from gpuorch_messaging import Broker, BrokerSettings, QueueSpec, telemetry_queue
from gpuorch_messaging.queues import TELEMETRY_QUEUE
from gpuorch_observability import READINESS, configure, connected, get_logger, keep_probing, until_up
from gpuorch_settings import load_or_exit, setting
from gpuorch_store import DATABASE_UNREACHABLE
from pydantic import create_model, model_validator

from gpuorch_telemetry import metrics
from gpuorch_telemetry.capacity import CapacityDuty, CapacitySettings
from gpuorch_telemetry.domain.detection import DetectionConfig
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.store import RetentionPolicy, TelemetryStore

log = get_logger(__name__)

QUEUE_NAME = TELEMETRY_QUEUE
METRICS_LOCK = "gpuorch.telemetry.metrics"


def queue_spec(prefetch: int = 1024) -> QueueSpec:
    return telemetry_queue(prefetch)


_DETECTION_FIELDS: dict[str, Any] = {
    f"detection_{f.name}": (float, setting(f"GPUORCH_TELEMETRY_{f.name.upper()}", f.default,
                                           f"detection threshold {f.name} (DetectionConfig)"))
    for f in dataclasses.fields(DetectionConfig)
}
_DetectionSettings: Any = create_model(  # one setting per DetectionConfig threshold: GPUORCH_TELEMETRY_<FIELD>
    "_DetectionSettings", __base__=BrokerSettings, **_DETECTION_FIELDS)


class Settings(_DetectionSettings):  # type: ignore[misc]
    """Telemetry's settings (``gpuorch_settings``: environment, optional file, validated)."""

    amqp_url: str = setting("GPUORCH_AMQP_URL", description="RabbitMQ URL")
    database_url: str = setting("GPUORCH_DATABASE_URL", description="PostgreSQL DSN (migrations applied)")
    metrics_port: int = setting("GPUORCH_METRICS_PORT", 9108, "port of /metrics, /healthz, /readyz (0: off)",
                                ge=0, le=65535)
    instance: str = setting("GPUORCH_TELEMETRY_INSTANCE", description="this instance's name",
                            default_factory=lambda: f"telemetry/{socket.gethostname()}-{os.getpid()}")
    prefetch: int = setting("GPUORCH_TELEMETRY_PREFETCH", 1024, "unacked deliveries in flight", ge=1)
    evaluation_interval_s: float = setting("GPUORCH_TELEMETRY_EVALUATION_INTERVAL_S", 60.0,
                                           "how often each running job is evaluated", gt=0)
    evaluation_tick_s: float = setting("GPUORCH_TELEMETRY_EVALUATION_TICK_S", 5.0, "seconds between evaluation "
                                       "rounds", gt=0)
    publish_tick_s: float = setting("GPUORCH_TELEMETRY_PUBLISH_TICK_S", 5.0, "seconds between retries of "
                                    "unpublished alert steps", gt=0)
    maintenance_tick_s: float = setting("GPUORCH_TELEMETRY_MAINTENANCE_TICK_S", 60.0, "seconds between "
                                        "partition/rollup/retention runs", gt=0)
    metrics_refresh_s: float = setting("GPUORCH_TELEMETRY_METRICS_REFRESH_S", 15.0, "seconds between refreshes "
                                       "of the fleet gauges", gt=0)
    metrics_freshness_s: float = setting("GPUORCH_TELEMETRY_METRICS_FRESHNESS_S", 25.0, "a GPU or job without a "
                                         "sample this recent is left out of the fleet gauges", gt=0)
    export_gpu_metrics: bool = setting("GPUORCH_TELEMETRY_EXPORT_GPU_METRICS", True, "export the DCGM-named "
                                       "per-GPU gauges (0: leave them to dcgm-exporter)")
    raw_retention_days: int = setting("GPUORCH_TELEMETRY_RAW_RETENTION_DAYS", 3, "days of raw samples kept", ge=1)
    rollup_retention_days: int = setting("GPUORCH_TELEMETRY_ROLLUP_RETENTION_DAYS", 180, "days of rollups kept",
                                         ge=1)
    bucket_s: int = setting("GPUORCH_TELEMETRY_BUCKET_S", 300, "rollup bucket width (s)", ge=1)
    sample_interval_s: float = setting("GPUORCH_TELEMETRY_SAMPLE_INTERVAL_S", 10.0, "nominal sampling period",
                                       gt=0)
    capacity_mode: Mode = setting("GPUORCH_CAPACITY_MODE", Mode.OFF, "the autoscaler: off, advise or auto")
    capacity_pools: str = setting("GPUORCH_CAPACITY_POOLS", "", 'its node pools, JSON: [{"name": "h100", '
                                  '"node_type": "h100x8", "floor": 1, ...}]')
    capacity_interval_s: float = setting("GPUORCH_CAPACITY_INTERVAL_S", 60.0, "seconds between its decisions",
                                         gt=0)
    identity_map: str | None = setting("GPUORCH_IDENTITY_MAP", None, "identity map (deploy/identity.json): "
                                       "which nodes a multi-node node-agent or executor user speaks for")

    @model_validator(mode="after")
    def _pools_parse(self) -> Settings:
        try:
            pools = pools_from_json(self.capacity_pools)
        except ValueError as exc:
            raise ValueError(f"GPUORCH_CAPACITY_POOLS: {exc}") from exc
        if self.capacity_mode is not Mode.OFF and not pools:
            raise ValueError("GPUORCH_CAPACITY_MODE needs GPUORCH_CAPACITY_POOLS (a JSON list of pools)")
        return self

    @property
    def detection(self) -> DetectionConfig:
        return DetectionConfig(**{f.name: getattr(self, f"detection_{f.name}")
                                  for f in dataclasses.fields(DetectionConfig)})

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(raw_days=self.raw_retention_days, rollup_days=self.rollup_retention_days,
                               bucket_s=self.bucket_s, sample_interval_s=self.sample_interval_s,
                               idle_util_pct=self.detection.idle_util_pct)

    @property
    def capacity(self) -> CapacitySettings:
        """The autoscaler duty (``capacity.py``)."""
        return CapacitySettings(self.capacity_mode, pools_from_json(self.capacity_pools), self.capacity_interval_s)


class TelemetryService:
    """One telemetry instance: consumes ``telemetry.samples``, runs the periodic duties, feeds ``/metrics``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        node_scopes = load_identity_map(settings.identity_map).node_scopes if settings.identity_map else {}
        self.broker = Broker(settings.amqp_url, producer=settings.instance, node_scopes=node_scopes,
                             **settings.broker_options())
        self.store: TelemetryStore | None = None
        self.handlers: TelemetryHandlers | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._leader_conn: asyncpg.Connection | None = None
        self.fleet = metrics.register_fleet_collector()
        self.capacity = CapacityDuty(settings.database_url, self.broker, settings.capacity, producer=settings.instance)

    async def start(self, *, serve_metrics: bool = True) -> None:
        """Open the store and the broker, waiting as long as either is down (``/readyz`` says which, a warning is
        logged at each try), then consume and start the duties."""
        s = self.settings
        READINESS.mark("consuming", "starting")
        if serve_metrics and s.metrics_port:
            metrics.serve_metrics(s.metrics_port)
        self.store = await until_up("database", lambda: TelemetryStore.open(s.database_url, s.retention),
                                    transient=DATABASE_UNREACHABLE, failing="PostgreSQL unreachable")
        READINESS.add("broker", connected(self.broker))
        await self.broker.connect(timeout_s=None)
        self.handlers = TelemetryHandlers(
            store=self.store, publisher=self.broker, detection=s.detection, producer=s.instance,
            evaluation_interval_s=s.evaluation_interval_s,
        )
        await self.handlers.maintain()
        await self.broker.consume(queue_spec(s.prefetch), self.handlers.handle)
        READINESS.mark("consuming", None)
        handlers = self.handlers
        store = self.store
        self._tasks = [
            asyncio.create_task(keep_probing("database", lambda: store.pool.fetchval("SELECT 1"),
                                             failing="PostgreSQL unreachable")),
            asyncio.create_task(self._every(s.evaluation_tick_s, "evaluate", handlers.evaluate_until_idle)),
            asyncio.create_task(self._every(s.publish_tick_s, "publish", handlers.publish_pending)),
            asyncio.create_task(self._every(s.maintenance_tick_s, "maintain", handlers.maintain)),
            asyncio.create_task(self._every(s.metrics_refresh_s, "metrics", self.refresh_fleet_metrics)),
        ]
        if s.capacity.mode.value != "off":
            self._tasks.append(asyncio.create_task(
                self._every(s.capacity.interval_s, "capacity", lambda: self.capacity.run_once(utc_now()))))
        log.info("telemetry.started", instance=s.instance, queue=QUEUE_NAME)

    async def _every(self, period_s: float, name: str, duty: Callable[[], Awaitable[object]]) -> None:
        while True:
            try:
                await duty()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("telemetry.duty_failed", duty=name, error=repr(exc))
            await asyncio.sleep(period_s)

    async def refresh_fleet_metrics(self) -> None:
        """Become (or stay) the metrics leader through a session advisory lock; the leader snapshots the fleet."""
        assert self.store is not None
        if self._leader_conn is None or self._leader_conn.is_closed():
            self._leader_conn = await asyncpg.connect(self.settings.database_url)
        leader = bool(await self._leader_conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", METRICS_LOCK))
        if not leader:
            self.fleet.update(self.settings.instance, metrics.FleetSnapshot(leader=False))
            return
        now = utc_now()
        freshness = self.settings.metrics_freshness_s
        gpu_text = b""
        if self.settings.export_gpu_metrics:
            gpu_text = await self.store.gpu_metrics_text(now, freshness, metrics.DCGM_FAMILIES,
                                                         *metrics.THROTTLE_FAMILY)
        self.fleet.update(self.settings.instance, metrics.FleetSnapshot(
            gpu_text=gpu_text,
            jobs=list(await self.store.latest_job_usage(now, freshness)),
            alerts=list(await self.store.open_alert_counts()), leader=True,
        ))

    async def stop(self) -> None:
        self.fleet.forget(self.settings.instance)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.broker.close()
        if self.handlers is not None:
            await self.handlers.batcher.drain()
        if self._leader_conn is not None:
            await self._leader_conn.close()
        await self.capacity.close()
        if self.store is not None:
            await self.store.close()


async def run(settings: Settings) -> None:
    service = TelemetryService(settings)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    settings, _ = load_or_exit(Settings, argv, prog="gpuorch-telemetry",
                               description="gpuorch telemetry: usage history, per-job accounting, detections.")
    configure("telemetry", log_level=settings.log_level, otlp_endpoint=settings.otlp_endpoint,
              instance=settings.instance)
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
