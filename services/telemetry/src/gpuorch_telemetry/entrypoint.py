"""Telemetry process: environment -> broker consumer + periodic duties + ``/metrics``.

Environment:
    GPUORCH_AMQP_URL            RabbitMQ URL (required)
    GPUORCH_DATABASE_URL        PostgreSQL DSN (required; migrations must be applied)
    GPUORCH_METRICS_PORT        port of /metrics (default 9108; 0 disables)
    GPUORCH_TELEMETRY_INSTANCE  this instance's name (default telemetry/<hostname>-<pid>)
    GPUORCH_TELEMETRY_PREFETCH  unacked deliveries in flight (default 1024)
    GPUORCH_TELEMETRY_EVALUATION_INTERVAL_S   how often each running job is evaluated (default 60)
    GPUORCH_TELEMETRY_EXPORT_GPU_METRICS      0 to leave per-GPU DCGM gauges to dcgm-exporter (default 1)
    GPUORCH_TELEMETRY_RAW_RETENTION_DAYS / _ROLLUP_RETENTION_DAYS / _BUCKET_S / _SAMPLE_INTERVAL_S
    GPUORCH_TELEMETRY_<DETECTION FIELD>       any DetectionConfig threshold, e.g. GPUORCH_TELEMETRY_WINDOW_S=600
    GPUORCH_CAPACITY_MODE       the autoscaler (gpuorch_capacity): off (default), advise, auto
    GPUORCH_CAPACITY_POOLS      its node pools, JSON: [{"name": "h100", "node_type": "h100x8", "floor": 1, ...}]
    GPUORCH_CAPACITY_INTERVAL_S seconds between its decisions (default 60)
    GPUORCH_OTLP_ENDPOINT       OTLP/HTTP collector URL for traces (OTEL_EXPORTER_OTLP_ENDPOINT is also read)
    GPUORCH_LOG_LEVEL           log level (default INFO)

Several instances consume the one durable quorum queue ``telemetry.samples`` side by side (competing consumers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import asyncpg
from gpuorch_contracts import EVENTS_EXCHANGE, utc_now
from gpuorch_identity import load_identity_map
from gpuorch_messaging import Broker, QueueSpec, telemetry_accepts
from gpuorch_observability import READINESS, configure, connected, get_logger, keep_probing

from gpuorch_telemetry import metrics
from gpuorch_telemetry.capacity import CapacityDuty, CapacitySettings
from gpuorch_telemetry.domain.detection import DetectionConfig
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.store import RetentionPolicy, TelemetryStore

log = get_logger(__name__)

QUEUE_NAME = "telemetry.samples"
BINDINGS = ((EVENTS_EXCHANGE, "gpu.usage_sampled"), (EVENTS_EXCHANGE, "gpu.health_changed"),
            (EVENTS_EXCHANGE, "job.#"))
METRICS_LOCK = "gpuorch.telemetry.metrics"


def queue_spec(prefetch: int = 1024) -> QueueSpec:
    return QueueSpec(name=QUEUE_NAME, bindings=BINDINGS, prefetch=prefetch, delivery_limit=5,
                     accepts=telemetry_accepts())


@dataclass(frozen=True)
class Settings:
    amqp_url: str
    database_url: str
    metrics_port: int = 9108
    instance: str = "telemetry"
    prefetch: int = 1024
    evaluation_interval_s: float = 60.0
    evaluation_tick_s: float = 5.0
    publish_tick_s: float = 5.0
    maintenance_tick_s: float = 60.0
    metrics_refresh_s: float = 15.0
    metrics_freshness_s: float = 25.0
    """A GPU or job without a sample this recent is left out of the fleet gauges."""
    export_gpu_metrics: bool = True
    """Export the DCGM-named per-GPU gauges (one series per GPU and metric: ~240k series at 40,000 GPUs)."""
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    capacity: CapacitySettings = field(default_factory=CapacitySettings)
    """The autoscaler duty (``capacity.py``); off unless ``GPUORCH_CAPACITY_MODE`` says advise or auto."""
    identity_map: str | None = None
    """``GPUORCH_IDENTITY_MAP``: path of deploy/identity.json; its node scopes say which nodes a multi-node
    node-agent or executor user speaks for (``gpuorch_messaging.senders``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        def number(name: str, default: float) -> float:
            return float(env.get(name, default))

        detection = DetectionConfig(**{
            f.name: float(env[f"GPUORCH_TELEMETRY_{f.name.upper()}"])
            for f in dataclasses.fields(DetectionConfig) if f"GPUORCH_TELEMETRY_{f.name.upper()}" in env
        })
        retention = RetentionPolicy(
            raw_days=int(number("GPUORCH_TELEMETRY_RAW_RETENTION_DAYS", 3)),
            rollup_days=int(number("GPUORCH_TELEMETRY_ROLLUP_RETENTION_DAYS", 180)),
            bucket_s=int(number("GPUORCH_TELEMETRY_BUCKET_S", 300)),
            sample_interval_s=number("GPUORCH_TELEMETRY_SAMPLE_INTERVAL_S", 10.0),
            idle_util_pct=detection.idle_util_pct,
        )
        missing = [name for name in ("GPUORCH_AMQP_URL", "GPUORCH_DATABASE_URL") if not env.get(name)]
        if missing:
            raise SystemExit(f"gpuorch-telemetry: set {' and '.join(missing)}")
        return cls(
            amqp_url=env["GPUORCH_AMQP_URL"], database_url=env["GPUORCH_DATABASE_URL"],
            metrics_port=int(env.get("GPUORCH_METRICS_PORT", "9108")),
            instance=env.get("GPUORCH_TELEMETRY_INSTANCE", f"telemetry/{socket.gethostname()}-{os.getpid()}"),
            prefetch=int(number("GPUORCH_TELEMETRY_PREFETCH", 1024)),
            evaluation_interval_s=number("GPUORCH_TELEMETRY_EVALUATION_INTERVAL_S", 60.0),
            export_gpu_metrics=env.get("GPUORCH_TELEMETRY_EXPORT_GPU_METRICS", "1") not in ("0", "false", "no"),
            detection=detection, retention=retention, identity_map=env.get("GPUORCH_IDENTITY_MAP") or None,
            capacity=CapacitySettings.from_env(env),
        )


class TelemetryService:
    """One telemetry instance: consumes ``telemetry.samples``, runs the periodic duties, feeds ``/metrics``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        node_scopes = load_identity_map(settings.identity_map).node_scopes if settings.identity_map else {}
        self.broker = Broker(settings.amqp_url, producer=settings.instance, node_scopes=node_scopes)
        self.store: TelemetryStore | None = None
        self.handlers: TelemetryHandlers | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._leader_conn: asyncpg.Connection | None = None
        self.fleet = metrics.register_fleet_collector()
        self.capacity = CapacityDuty(settings.database_url, self.broker, settings.capacity, producer=settings.instance)

    async def start(self, *, serve_metrics: bool = True) -> None:
        s = self.settings
        READINESS.mark("consuming", "starting")
        self.store = await TelemetryStore.open(s.database_url, s.retention)
        await self.broker.connect()
        READINESS.add("broker", connected(self.broker))
        self.handlers = TelemetryHandlers(
            store=self.store, publisher=self.broker, detection=s.detection, producer=s.instance,
            evaluation_interval_s=s.evaluation_interval_s,
        )
        await self.handlers.maintain()
        if serve_metrics and s.metrics_port:
            metrics.serve_metrics(s.metrics_port)
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
    import argparse
    import sys

    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        prog="gpuorch-telemetry", description="gpuorch telemetry: usage history, per-job accounting, detections.",
        epilog=doc[doc.index("Environment:"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv if argv is not None else sys.argv[1:])
    missing = [name for name in ("GPUORCH_AMQP_URL", "GPUORCH_DATABASE_URL") if not os.environ.get(name)]
    if missing:
        parser.error(f"set {' and '.join(missing)} (see --help)")
    configure("telemetry", log_level=os.environ.get("GPUORCH_LOG_LEVEL", "INFO"),
              otlp_endpoint=os.environ.get("GPUORCH_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    asyncio.run(run(Settings.from_env()))


if __name__ == "__main__":
    main()
