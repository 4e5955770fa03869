"""Telemetry's capacity duty against the real PostgreSQL: read models in, decisions recorded, events published at
least once, cool-downs kept across calls (and so across restarts: they come from the table)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from gpuorch_capacity import Mode
from gpuorch_capacity.observe import pools_from_json
from gpuorch_contracts import Message
from gpuorch_contracts.capacity import FleetScaleRequested
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_telemetry.capacity import CapacityDuty, CapacitySettings
from prometheus_client import REGISTRY

pytestmark = pytest.mark.integration

POOLS = json.dumps([
    {"name": "duty-h100", "node_type": "h100x8", "floor": 0, "ceiling": 4, "scale_out_cooldown_s": 300},
    {"name": "duty-l4", "node_type": "l4x4", "floor": 1, "ceiling": 6, "idle_before_drain_s": 600},
])


def inventory(node_id: str, model: str, gpus: int) -> str:
    return json.dumps({"node_id": node_id, "cpu_milli": 64000, "memory_mib": 262144,
                       "gpus": [{"uuid": f"GPU-{node_id}-{i}", "index": i, "model": model, "memory_total_mib": 81559}
                                for i in range(gpus)]})


async def seed(dsn: str, now: datetime) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for node_id, model, gpus in (("h-1", "H100-80GB", 8), ("l-1", "L4", 4), ("l-2", "L4", 4)):
            await conn.execute("INSERT INTO nodes (node_id, liveness, inventory, inventory_hash, updated_at) VALUES "
                               "($1, 'alive', $2::jsonb, 'h', $3)", node_id, inventory(node_id, model, gpus),
                               now - timedelta(days=1))  # registered yesterday

        async def job(state: str, spec: dict[str, object], submitted: datetime, node: str | None = None) -> None:
            assignments = [{"node_id": node, "gpus": [{"gpu_uuid": f"GPU-{node}-0", "gpu_index": 0}]}] if node else []
            await conn.execute(
                "INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, node_ids, assignments, "
                "submitted_at) VALUES ($1, 'j', 'nlp', $2, 'normal', $3, $4::jsonb, $5, $6::jsonb, $7)",
                uuid.uuid4(), spec.get("tier", "training"), state, json.dumps(spec), [node] if node else [],
                json.dumps(assignments), submitted)

        # one non-preemptible job on the H100 node and one on l-1; l-2 ran nothing for a day
        await job("running", {"tier": "training", "resources": {"gpus": 1}, "preemptible": False}, now, "h-1")
        await job("running", {"tier": "inference", "resources": {"gpu_milli": 250}, "preemptible": False}, now, "l-1")
        for _ in range(3):
            await job("queued", {"tier": "training", "resources": {"gpus": 8, "gpu_models": ["H100-80GB"]}},
                      now - timedelta(minutes=10))
        await job("queued", {"tier": "training", "resources": {"gpus": 8}}, now, None)  # quota-bound: not demand
        await conn.execute("UPDATE jobs SET pending_reason = 'tenant nlp is over its quota' WHERE submitted_at = $1 "
                           "AND state = 'queued'", now)
    finally:
        await conn.close()


class FlakyPublisher(RecordingPublisher):
    """Refuses the first publish (an unconfirmed message), then records."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def publish(self, message: Message, *, headers: object = None) -> None:
        if not self.refused:
            self.refused += 1
            raise ConnectionError("broker did not confirm")
        await super().publish(message)


async def test_capacity_duty_decides_from_the_read_models_and_publishes_at_least_once(migrated_dsn: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    await seed(migrated_dsn, now)
    publisher = FlakyPublisher()
    duty = CapacityDuty(migrated_dsn, publisher, CapacitySettings(Mode.ADVISE, pools_from_json(POOLS)),
                        producer="telemetry/test")
    try:
        with pytest.raises(ConnectionError):
            await duty.run_once(now)  # decided and recorded; the publish was not confirmed
        conn = await asyncpg.connect(migrated_dsn)
        try:
            rows = await conn.fetch("SELECT pool, mode, add_nodes, drain_node_ids, published_at FROM "
                                    "capacity_decisions ORDER BY pool")
        finally:
            await conn.close()
        assert [(r["pool"], r["mode"], r["add_nodes"], r["drain_node_ids"], r["published_at"]) for r in rows] == [
            ("duty-h100", "advise", 3, [], None), ("duty-l4", "advise", 0, ["l-2"], None)]

        plan = await duty.run_once(now + timedelta(seconds=60))  # publishes what is pending; decides nothing new
        events = publisher.of_type(FleetScaleRequested)
        assert [(e.pool, e.current_nodes, e.desired_nodes, e.add_nodes, e.drain_node_ids) for e in events] == [
            ("duty-h100", 1, 4, 3, []), ("duty-l4", 2, 1, 0, ["l-2"])]
        assert "3 pending job(s)" in events[0].reason
        assert plan is not None and not plan.changes
        h100 = next(p for p in plan.pools if p.pool == "duty-h100")
        assert any("cooling down" in line for line in h100.held_back)
        l4 = next(p for p in plan.pools if p.pool == "duty-l4")
        assert l4.current == 1  # l-2 is draining now; l-1 runs non-preemptible work and is never drained
        value = REGISTRY.get_sample_value
        assert value("gpuorch_capacity_desired_nodes", {"pool": "duty-h100"}) == 1  # advise moves no follower
        conn = await asyncpg.connect(migrated_dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM capacity_decisions WHERE published_at IS NULL") == 0
        finally:
            await conn.close()
    finally:
        await duty.close()


async def test_capacity_duty_waits_for_the_fleet_after_a_start(migrated_dsn: str) -> None:
    now = datetime.now(UTC)
    duty = CapacityDuty(migrated_dsn, RecordingPublisher(), CapacitySettings(Mode.AUTO, pools_from_json(POOLS)))
    try:  # no node registered yet: every pool would look below its floor, so nothing is decided for a minute
        assert await duty.run_once(now) is None
        later = await duty.run_once(now + timedelta(minutes=2))
        assert later is not None and [(o.pool, o.count) for o in later.scale_outs] == [("duty-l4", 1)]
    finally:
        await duty.close()


async def test_capacity_duty_off_reads_nothing(migrated_dsn: str) -> None:
    duty = CapacityDuty("postgresql://nobody@127.0.0.1:1/none", RecordingPublisher(), CapacitySettings())
    assert await duty.run_once(datetime.now(UTC)) is None


async def test_in_auto_the_desired_gauge_holds_while_asked_for_nodes_boot(migrated_dsn: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    await seed(migrated_dsn, now)
    duty = CapacityDuty(migrated_dsn, RecordingPublisher(), CapacitySettings(Mode.AUTO, pools_from_json(POOLS)))
    try:
        first = await duty.run_once(now)
        assert first is not None and first.desired()["duty-h100"] == 4
        later = await duty.run_once(now + timedelta(minutes=6))  # cool-down over, nothing registered yet
        assert later is not None and later.desired()["duty-h100"] == 4 and not later.scale_outs
        value = REGISTRY.get_sample_value
        assert value("gpuorch_capacity_desired_nodes", {"pool": "duty-h100"}) == 4
        assert value("gpuorch_capacity_current_nodes", {"pool": "duty-h100"}) == 4  # 1 registered + 3 booting
    finally:
        await duty.close()


async def test_two_telemetry_instances_one_decides_and_the_event_reaches_the_broker(amqp_url: str,
                                                                                    migrated_dsn: str) -> None:
    import asyncio

    import aio_pika
    from gpuorch_contracts import EVENTS_EXCHANGE, decode
    from gpuorch_telemetry.entrypoint import Settings, TelemetryService

    await seed(migrated_dsn, datetime.now(UTC).replace(microsecond=0))
    connection = await aio_pika.connect(amqp_url)
    received: list[FleetScaleRequested] = []
    services = []
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True,
                                                  passive=False, arguments={"alternate-exchange": "gpuorch.unrouted"})
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, "fleet.scale_requested")
        for i in range(2):
            service = TelemetryService(Settings(
                amqp_url=amqp_url, database_url=migrated_dsn, metrics_port=0, instance=f"telemetry/cap-{i}",
                prefetch=16, metrics_refresh_s=5, evaluation_tick_s=5, publish_tick_s=5,
                capacity_mode=Mode.AUTO, capacity_pools=POOLS, capacity_interval_s=0.2,
            ))
            await service.start(serve_metrics=False)
            services.append(service)
        deadline = asyncio.get_running_loop().time() + 60
        while {m.pool for m in received} != {"duty-h100", "duty-l4"}:
            assert asyncio.get_running_loop().time() < deadline, f"events seen: {received}"
            message = await queue.get(fail=False)
            if message is None:
                await asyncio.sleep(0.1)
                continue
            await message.ack()
            decoded = decode(message.body)
            assert isinstance(decoded, FleetScaleRequested)
            received.append(decoded)
    finally:
        for service in services:
            await service.stop()
        await connection.close()
    assert {(m.pool, m.mode, m.desired_nodes) for m in received} == {("duty-h100", "auto", 4), ("duty-l4", "auto", 1)}
    conn = await asyncpg.connect(migrated_dsn)
    try:  # one leader decided: the cool-downs kept every later tick (of either instance) from deciding again
        assert await conn.fetchval("SELECT count(*) FROM capacity_decisions") == 2
    finally:
        await conn.close()
