"""The API against the real PostgreSQL and RabbitMQ: who sees what, one-line errors, submissions and cancels
published on the caller's behalf, live events filtered to the caller's tenants."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta

import aio_pika
import asyncpg
import httpx
import pytest
from gpuorch_contracts import SUBMIT_EXCHANGE, ExecutorHeartbeat, JobPlaced, JobQueued, array_task_id, decode
from gpuorch_contracts.jobs import GpuAllocation, NodeAssignment
from gpuorch_identity import log_credential
from gpuorch_messaging import Broker
from gpuorch_scheduling.testing import registered_node
from prometheus_client import generate_latest

from .conftest import RunningApi, auth

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC)
SPEC = {"run": {"runtime": "process", "argv": ["python", "-c", "pass"]}, "resources": {"gpus": 1}}


async def seed(dsn: str) -> dict[str, uuid.UUID]:
    """Read-model rows as the scheduler writes them: a node with 2 GPUs (one held by acme's running job) and one
    MIG GPU, acme's running job, research's queued job, and a job rejected at admission (empty spec)."""
    ids = {"acme_running": uuid.uuid4(), "research_queued": uuid.uuid4(), "rejected": uuid.uuid4()}
    node = registered_node("n1", gpus=2).inventory.model_dump(mode="json")
    node["gpus"].append(registered_node("n1", gpus=1, mig=True).inventory.model_dump(mode="json")["gpus"][0]
                        | {"index": 2, "uuid": "GPU-n1-mig"})
    assignment = [NodeAssignment(node_id="n1", gpus=[GpuAllocation(gpu_uuid="GPU-n1-0", gpu_index=0)]),
                  NodeAssignment(node_id="n1", gpus=[GpuAllocation(gpu_uuid="MIG-n1-0-0", gpu_index=2,
                                                                   mig_profile="1g.10gb", milli=142)])]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) "
                           "VALUES ('n1', 'alive', $1::text::jsonb, 'h')", json.dumps(node))
        insert = """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, assignments, node_ids,
                        pending_reason, estimated_start, reason, submitted_at, started_at)
                    VALUES ($1, $2, $3, $4, 'normal', $5, $6::text::jsonb, $7::text::jsonb, $8, $9, $10, $11, $12, $13)"""
        await conn.execute(insert, ids["acme_running"], "train", "acme", "training", "running", json.dumps(SPEC),
                           json.dumps([a.model_dump(mode="json") for a in assignment]), ["n1"], None, None, None,
                           NOW - timedelta(minutes=5), NOW - timedelta(minutes=4))
        await conn.execute(insert, ids["research_queued"], "big", "research", "batch", "queued", json.dumps(SPEC),
                           "[]", [], "needs 8 GPUs on one node; largest free: 1", NOW + timedelta(minutes=10), None,
                           NOW - timedelta(minutes=2), None)
        await conn.execute(insert, ids["rejected"], "", "", "", "rejected", "{}", "[]", [], None, None,
                           "needs 20 GPUs; no node has more than 8", NOW, None)
        await conn.execute("INSERT INTO api_submissions (job_id, identity, spec) VALUES ($1, 'acme-ci', $2::text::jsonb)",
                           ids["rejected"], json.dumps({**SPEC, "name": "huge", "tenant": "acme", "tier": "training"}))
        # telemetry's sample of acme's MIG instance (MIG instances have no GPU sample of their own)
        await conn.execute("SELECT telemetry_ensure_day_partitions(current_date - 1, current_date + 1)")
        await conn.execute(
            """INSERT INTO telemetry_job_samples (sampled_at, job_id, tenant, node_id, device_uuid, gpu_uuid, gpu_index,
                   alloc_milli, memory_used_mib, util_pct, process_count)
               VALUES (now(), $1, 'acme', 'n1', 'MIG-n1-0-0', 'GPU-n1-mig', 2, 142, 3000, 55, 1)""",
            ids["acme_running"])
    finally:
        await conn.close()
    return ids


async def test_tokens_and_one_line_errors(api: RunningApi) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        assert (await http.get("/readyz")).json() == {"status": "ready"}
        for headers, challenge in (({}, 'Bearer realm="gpuorch"'), ({"Authorization": "Basic x"}, 'Bearer realm="gpuorch"'),
                                   ({"Authorization": "Bearer nope"}, 'Bearer realm="gpuorch", error="invalid_token"')):
            answer = await http.get("/api/v1/jobs", headers=headers)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == challenge
            assert answer.headers["content-type"] == "application/problem+json"
            assert set(answer.json()) == {"type", "title", "status", "detail", "error"}
            assert answer.json()["status"] == 401 and answer.json()["title"] == "Unauthorized"
        answer = await http.get("/api/v1/jobs", headers=auth("svc"))
        assert answer.status_code == 403 and "service" in answer.json()["error"]
        assert (await http.get("/api/v1/whoami", headers=auth("acme"))).json()["tenants"] == ["acme"]
        bad = await http.get("/api/v1/jobs", params={"state": "bogus"}, headers=auth("acme"))
        assert bad.status_code == 422 and bad.json()["error"].startswith("state:") and "\n" not in bad.text
        both = (await http.get("/api/v1/jobs", params={"state": "bogus", "limit": 0}, headers=auth("acme"))).json()
        assert [e["where"] for e in both["errors"]] == ["query.state", "query.limit"]  # every error, not the first
        assert both["detail"].startswith("state: ") and "; limit: " in both["detail"]
        document = (await http.get("/openapi.json")).json()
        assert "/api/v1/jobs" in document["paths"]
        invalid = document["paths"]["/api/v1/jobs"]["get"]["responses"]["422"]  # documented as answered
        assert invalid["content"] == {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
        assert "HTTPValidationError" not in document["components"]["schemas"]
        assert document["components"]["securitySchemes"]["bearer"] == {
            "type": "http", "scheme": "bearer", "description": "an API token of the identity map"}
        assert document["paths"]["/api/v1/jobs"]["get"]["security"] == [{"bearer": []}]
        assert "log_path" not in document["components"]["schemas"]["JobDetail"]["properties"]  # no host paths


async def test_a_submitter_sees_its_tenants_and_an_operator_sees_all(api: RunningApi, migrated_dsn: str) -> None:
    ids = await seed(migrated_dsn)
    async with httpx.AsyncClient(base_url=api.url) as http:
        mine = (await http.get("/api/v1/jobs", headers=auth("acme"))).json()
        assert sorted(j["id"] for j in mine) == sorted(str(ids[k]) for k in ("acme_running", "rejected"))
        everything = (await http.get("/api/v1/jobs", headers=auth("ops"))).json()
        assert len(everything) == 3
        assert [j["id"] for j in (await http.get("/api/v1/jobs", params={"state": "queued"},
                                                   headers=auth("ops"))).json()] == [str(ids["research_queued"])]
        assert (await http.get("/api/v1/jobs", params={"tenant": "research"}, headers=auth("acme"))).status_code == 403
        other = await http.get(f"/api/v1/jobs/{ids['research_queued']}", headers=auth("acme"))
        assert other.status_code == 404  # another tenant's job is not disclosed

        rejected = (await http.get(f"/api/v1/jobs/{str(ids['rejected'])[:8]}", headers=auth("acme"))).json()
        assert (rejected["name"], rejected["tenant"], rejected["state"]) == ("huge", "acme", "rejected")
        assert rejected["spec"]["resources"] == {"gpus": 1} and "20 GPUs" in rejected["reason"]
        running = (await http.get(f"/api/v1/jobs/{ids['acme_running']}", headers=auth("acme"))).json()
        assert running["gpus"] == "0,2:1g.10gb" and running["trace_url"].startswith("http://jaeger.example:16686/")
        assert [d["device_uuid"] for d in running["usage"]["devices"]] == ["MIG-n1-0-0"] and running["advice"] == []
        assert "log_path" not in running  # no host paths in answers

        [node] = (await http.get("/api/v1/nodes", headers=auth("research"))).json()
        assert (node["gpus_total"], node["gpus_allocated"], node["gpus_free"]) == (3, 2, 1)
        assert (node["mig_slices_total"], node["mig_slices_free"]) == (7, 6)
        held = next(s for s in node["gpus"][2]["mig_slices"] if s["allocated"])
        assert (held["utilization_pct"], held["memory_used_mib"]) == (55.0, 3000)
        assert node["gpus"][0]["jobs"] == [{"job_id": None, "tenant": "other tenant", "milli": 1000, "mig_profile": None,
                                            "memory_mib": None, "memory_used_mib": None, "utilization_pct": None}]
        assert node["last_seen"] is not None

        queues = {q["tier"]: q for q in (await http.get("/api/v1/queues", headers=auth("ops"))).json()}
        assert queues["batch"]["depth"] == 1 and queues["batch"]["pending_reasons"][0]["jobs"] == 1
        assert queues["batch"]["estimated_starts"][0]["job_id"] == str(ids["research_queued"])
        assert (await http.get("/api/v1/queues", headers=auth("acme"))).json()[2]["depth"] == 0

        [today] = (await http.get("/api/v1/usage", headers=auth("acme"))).json()  # the sample, not rolled up yet
        assert (today["tenant"], today["allocated_gpu_hours"] > 0) == ("acme", True)
        assert (await http.get("/api/v1/usage", headers=auth("research"))).json() == []
        tenants = (await http.get("/api/v1/tenants", headers=auth("acme"))).json()
        # a whole GPU plus a 1g.10gb slice (1 of 7 compute slices): 1.143, used at 55 %
        assert tenants == [{"tenant": "acme", "allocated_gpus": 1.143, "quota_gpus": 4, "used_gpus": 0.629,
                            "mean_util_pct": 55.0, "queued": 0, "running": 1}]


        assert (await http.get("/api/v1/share", headers=auth("acme"))).json()["tenants"] == []  # not written yet
        line = {"share": 1.0, "normalized_share": 0.5, "usage_gpu_hours": 2.0, "normalized_usage": 0.5,
                "factor": 0.5, "gpus_held": 1.0}
        conn = await asyncpg.connect(migrated_dsn)
        await conn.execute(  # the row the scheduler writes (its readmodels.write_fair_share)
            "INSERT INTO fair_share (id, half_life_s, model_weights, lines, computed_at) VALUES "
            "(1, 604800, '{\"h100\": 2}', $1::text::jsonb, now())",
            json.dumps([{"tenant": "acme", **line}, {"tenant": "research", **line}]))
        await conn.close()
        share = (await http.get("/api/v1/share", headers=auth("acme"))).json()
        assert [t["tenant"] for t in share["tenants"]] == ["acme"] and share["model_weights"] == {"h100": 2}
        assert len((await http.get("/api/v1/share", headers=auth("ops"))).json()["tenants"]) == 2


async def test_submit_and_cancel_are_published_on_the_callers_behalf(api: RunningApi, migrated_dsn: str) -> None:
    ids = await seed(migrated_dsn)
    async with httpx.AsyncClient(base_url=api.url) as http:
        answer = await http.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth("acme"))
        assert answer.status_code == 202, answer.text
        assert answer.headers["location"] == f"{api.url}/api/v1/jobs/{answer.json()['job_id']}"
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        submitted = decode(incoming.body)
        assert (incoming.routing_key, incoming.user_id) == ("job.submit.acme", "guest")
        assert (str(submitted.job_id), submitted.on_behalf_of) == (answer.json()["job_id"], "acme-ci")  # type: ignore[attr-defined]

        for body, status in (({"spec": {**SPEC, "tenant": "research"}}, 403),
                             ({"spec": {**SPEC, "priority_class": "critical"}}, 403),
                             ({"spec": {**SPEC, "bogus": 1}}, 422)):
            refused = await http.post("/api/v1/jobs", json=body, headers=auth("acme"))
            assert refused.status_code == status and refused.json()["status"] == status, refused.text

        not_yours = await http.post(f"/api/v1/jobs/{ids['research_queued']}/cancel", headers=auth("acme"))
        assert not_yours.status_code == 404  # as for a job that does not exist
        cancel = await http.post(f"/api/v1/jobs/{ids['acme_running']}/cancel", json={"reason": "enough"},
                                 headers=auth("acme"))
        assert cancel.status_code == 202
        assert cancel.headers["location"] == f"{api.url}/api/v1/jobs/{ids['acme_running']}"
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        cancelled = decode(incoming.body)
        assert (cancelled.TYPE, cancelled.on_behalf_of, incoming.routing_key) == (  # type: ignore[attr-defined]
            "job.cancel", "acme-ci", "job.cancel.acme")
        ended = await http.post(f"/api/v1/jobs/{ids['rejected']}/cancel", headers=auth("acme"))
        assert ended.status_code == 409 and "already ended (rejected)" in ended.json()["detail"], ended.text
        assert api.submissions.empty()  # nothing was published for the refused requests


async def test_live_events_reach_only_the_callers_tenants(api: RunningApi, amqp_url: str) -> None:
    publisher = Broker(amqp_url, producer="scheduler")
    await publisher.connect()
    acme_job, research_job = uuid.uuid4(), uuid.uuid4()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http, \
                http.stream("GET", "/api/v1/events", headers=auth("acme")) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith(": stream for acme-ci")  # bound: what follows is delivered
            await publisher.publish(JobQueued(job_id=research_job, pending_reason="x", tenant="research"))
            await publisher.publish(JobPlaced(job_id=acme_job, placement_id=uuid.uuid4(), tenant="acme",
                                              assignments=[NodeAssignment(node_id="n1")]))
            seen = []
            async with asyncio.timeout(20):
                async for line in lines:
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        break
            assert [(e["type"], e["job_id"]) for e in seen] == [("job.placed", str(acme_job))]
    finally:
        await publisher.close()


async def test_logs_come_from_the_executor_of_the_jobs_node(api: RunningApi, migrated_dsn: str,
                                                             amqp_url: str) -> None:
    """A stand-in for an executor's log endpoint (services/executor logs_http) announced by a heartbeat."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from .conftest import serve

    asked: list[tuple[str, str | None, str]] = []

    async def logs(request: Request) -> PlainTextResponse:
        asked.append((request.path_params["job_id"], request.headers.get("authorization"),
                      request.query_params["follow"]))
        return PlainTextResponse("hello from n1\n")

    ids = await seed(migrated_dsn)
    api.backends.logs.secret = "issuing-secret"
    publisher = Broker(amqp_url, producer="executor")
    await publisher.connect()
    try:
        async with serve(Starlette(routes=[Route("/jobs/{job_id}/logs", logs)])) as node_url, \
                httpx.AsyncClient(base_url=api.url) as http:
            api.backends.logs.announce_wait_s = 0.2  # a node never heard from: 503 once the wait is over
            early = await http.get(f"/api/v1/jobs/{ids['acme_running']}/logs", headers=auth("acme"))
            assert early.status_code == 503 and "has not announced" in early.json()["error"]
            # an API that just started waits for the node's first heartbeat instead of failing the request
            api.backends.logs.announce_wait_s = 60
            waiting = asyncio.create_task(http.get(f"/api/v1/jobs/{ids['acme_running']}/logs",
                                                   params={"follow": "1"}, headers=auth("acme"), timeout=90))
            async with asyncio.timeout(30):
                while "n1" not in api.backends.logs.awaited:
                    await asyncio.sleep(0.05)
            await publisher.publish(ExecutorHeartbeat(node_id="n1", sequence=1, fencing_deadline_s=30, interval_s=2,
                                                      logs_url=node_url))
            answer = await waiting
            assert (answer.status_code, answer.text) == (200, "hello from n1\n")
            # the credential of the identity that announced the endpoint (guest here), never a shared token
            assert asked == [(str(ids["acme_running"]), f"Bearer {log_credential('issuing-secret', 'guest')}", "1")]
            assert (await http.get(f"/api/v1/jobs/{ids['acme_running']}/logs",
                                   headers=auth("research"))).status_code == 404  # not disclosed
            never_ran = await http.get(f"/api/v1/jobs/{ids['research_queued']}/logs", headers=auth("research"))
            assert never_ran.status_code == 404 and "never ran" in never_ran.json()["error"]
            # a node whose heartbeats announce no endpoint is answered at once, not after the wait
            await publisher.publish(ExecutorHeartbeat(node_id="n1", sequence=2, fencing_deadline_s=30, interval_s=2))
            async with asyncio.timeout(30):
                while "n1" not in api.backends.logs.without_logs:
                    await asyncio.sleep(0.05)
                silent = await http.get(f"/api/v1/jobs/{ids['acme_running']}/logs", headers=auth("acme"))
            assert silent.status_code == 503 and "has not announced" in silent.json()["error"]
    finally:
        await publisher.close()


async def test_metrics_count_requests_by_route_template(api: RunningApi) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        asked = [uuid.uuid4() for _ in range(2)]
        for job_id in asked:
            await http.get(f"/api/v1/jobs/{job_id}", headers=auth("acme"))  # 404: not disclosed
        await http.get("/api/v1/jobs", headers={})  # 401
        assert (await http.get("/metrics")).status_code == 404  # on the internal metrics port only
    text = generate_latest().decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("gpuorch_api_requests_total{")}
    assert lines['gpuorch_api_requests_total{code="404",method="GET",route="/api/v1/jobs/{job_ref}"}'] >= 2
    assert lines['gpuorch_api_requests_total{code="401",method="GET",route="/api/v1/jobs"}'] >= 1
    assert not any(str(job_id) in text for job_id in asked)  # route templates, never raw paths, as labels
    assert "gpuorch_api_request_duration_seconds_bucket" in text


async def test_the_report_shows_a_submitter_its_tenants_and_an_operator_everything(
        api: RunningApi, migrated_dsn: str) -> None:
    ids = await seed(migrated_dsn)
    conn = await asyncpg.connect(migrated_dsn)
    await conn.execute(  # 4 GPUs of n1 reserved for acme over the last two hours (its job there used at most 1.14)
        "INSERT INTO reservations (reservation_id, tenant, gpus, nodes, start_at, end_at, outcome) VALUES "
        "($1, 'acme', 4, ARRAY['n1'], now() - interval '2 hours', now() + interval '5 hours', 'created')",
        uuid.uuid4())  # its future part is not counted
    await conn.close()
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        answer = await http.get("/api/v1/report", params={"since": "1d"}, headers=auth("acme"))
        assert answer.status_code == 200, answer.text
        mine = answer.json()
        assert [j["job_id"] for j in mine["jobs"]] == [str(ids["acme_running"])]  # its sample, not rolled up yet
        assert [t["tenant"] for t in mine["tenants"]] == ["acme"] and mine["tenants_shown"] == ["acme"]
        assert mine["tenants"][0]["allocated_gpu_hours"] >= 0 and mine["series_source"]
        assert "research" not in answer.text and str(ids["research_queued"]) not in answer.text
        assert all(w["tier"] != "batch" for w in mine["queue_waits"])
        [idle] = [c for c in mine["conclusions"] if c["kind"] == "idle_reservation"]
        assert idle["subject"] == "acme" and 5.5 < idle["gpu_hours"] <= 8.0, idle

        everything = (await http.get("/api/v1/report", params={"since": "1d"}, headers=auth("ops"))).json()
        assert everything["tenants_shown"] is None
        [batch] = [w for w in everything["queue_waits"] if w["tier"] == "batch"]
        assert (batch["queued_now"], batch["waited"]) == (1, 1)
        assert any(c["kind"] == "short_of" and "8 GPUs on one node" in c["text"] for c in everything["conclusions"])
        theirs = (await http.get("/api/v1/report", params={"tenant": "research"}, headers=auth("ops"))).json()
        assert (theirs["tenant"], theirs["jobs"]) == ("research", [])

        refused = await http.get("/api/v1/report", params={"tenant": "research"}, headers=auth("acme"))
        assert refused.status_code == 403 and refused.json()["detail"] == refused.json()["error"]
        for params in ({"since": "a week"}, {"from": "2026-11-30", "to": "2026-11-24"}):
            bad = await http.get("/api/v1/report", params=params, headers=auth("acme"))
            assert bad.status_code == 422 and bad.json()["detail"] == bad.json()["error"] != "", bad.text
        document = (await http.get("/openapi.json")).json()
        schema = document["paths"]["/api/v1/report"]["get"]["responses"]["200"]["content"]["application/json"]
        assert schema["schema"] == {"$ref": "#/components/schemas/WeeklyReport"}


async def test_dead_letters_are_listed_and_replayed_by_operators_only(api: RunningApi, amqp_url: str) -> None:
    from gpuorch_contracts import SUBMIT_EXCHANGE
    from gpuorch_messaging import (
        EXCHANGE_HEADER,
        ORIGINAL_PUBLISHER_HEADER,
        QUEUE_HEADER,
        REASON_HEADER,
        ROUTING_KEY_HEADER,
    )

    lane = f"test.lane.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(f"{lane}.dlq")
        headers = {REASON_HEADER: "invalid: spec.resources", QUEUE_HEADER: lane, EXCHANGE_HEADER: SUBMIT_EXCHANGE,
                   ROUTING_KEY_HEADER: "job.submit.acme"}
        await channel.default_exchange.publish(aio_pika.Message(  # as RabbitMQ dead-letters: the publisher's user_id
            b'{"refused": true}', message_id="dead-1", user_id="guest", headers=headers), routing_key=f"{lane}.dlq")
        await channel.default_exchange.publish(aio_pika.Message(  # published without a user_id: never replayed
            b'{"anonymous": true}', message_id="dead-2", headers=headers), routing_key=f"{lane}.dlq")
    finally:
        await connection.close()
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        for method, path in (("GET", "/api/v1/dlq"), ("POST", f"/api/v1/dlq/{lane}/replay")):
            refused = await http.request(method, path, headers=auth("acme"))
            assert refused.status_code == 403 and "operator" in refused.json()["error"]
        for _ in range(2):  # listing removes nothing
            listed = (await http.get("/api/v1/dlq", params={"queue": lane}, headers=auth("ops"))).json()
            assert [(d["message_id"], d["reason"], d["routing_key"], d["publisher"]) for d in listed] == [
                ("dead-1", "invalid: spec.resources", "job.submit.acme", "guest"),
                ("dead-2", "invalid: spec.resources", "job.submit.acme", "")]
        assert (await http.get("/api/v1/dlq", headers=auth("ops"))).json() == []  # the known queues have none
        assert (await http.get("/api/v1/dlq", params={"queue": "no such/queue"},
                               headers=auth("ops"))).status_code == 422

        replayed = await http.post(f"/api/v1/dlq/{lane}/replay", headers=auth("ops"))
        assert replayed.status_code == 200, replayed.text
        assert (replayed.json()["replayed"], replayed.json()["stopped"]) == (1, None)
        [skipped] = replayed.json()["skipped"]
        assert skipped["letter"]["message_id"] == "dead-2" and "without a user_id" in skipped["why"]
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        assert (incoming.body, incoming.routing_key, incoming.message_id) == (
            b'{"refused": true}', "job.submit.acme", "dead-1")
        assert (incoming.headers or {}).get("x-gpuorch-replayed") == 1
        assert (incoming.headers or {}).get(ORIGINAL_PUBLISHER_HEADER) == "guest"
        left = (await http.get("/api/v1/dlq", params={"queue": lane}, headers=auth("ops"))).json()
        assert [d["message_id"] for d in left] == ["dead-2"]  # kept for an operator to look at
        missing = await http.post("/api/v1/dlq/no-such-queue/replay", headers=auth("ops"))
        assert missing.status_code == 404 and "no-such-queue.dlq" in missing.json()["error"]
        api.backends.dlq_amqp_url = "amqp://guest:guest@127.0.0.1:9/"  # the broker out of reach: 503, one line
        unreachable = await http.get("/api/v1/dlq", headers=auth("ops"))
        assert unreachable.status_code == 503 and "broker unreachable" in unreachable.json()["error"]


async def test_an_array_is_one_row_its_tasks_are_listed_by_index_and_its_owner_steers_it(
        api: RunningApi, migrated_dsn: str) -> None:
    array_id = uuid.uuid4()
    spec = {**SPEC, "array": {"indices": "0-3", "parallelism": 2}}
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute(
            """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at, array_counts)
               VALUES ($1, 'sweep', 'acme', 'batch', 'normal', 'running', $2::text::jsonb, $3, $4::text::jsonb)""",
            array_id, json.dumps(spec), NOW, json.dumps({"queued": 2, "running": 2, "succeeded": 0, "failed": 0,
                                                          "cancelled": 0}))
        for index in (1, 0):
            await conn.execute(
                """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at, array_id,
                                     array_index) VALUES ($1, 'sweep', 'acme', 'batch', 'normal', 'running',
                                     $2::text::jsonb, $3, $4, $5)""",
                array_task_id(array_id, index), json.dumps(spec), NOW, array_id, index)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        listed = (await http.get("/api/v1/jobs", headers=auth("acme"))).json()
        rows = [j for j in listed if j["name"] == "sweep"]
        assert [(r["id"], r["array_counts"]["running"]) for r in rows] == [(str(array_id), 2)]
        tasks = (await http.get(f"/api/v1/jobs?array={str(array_id)[:13]}", headers=auth("acme"))).json()
        assert [(t["array_index"], t["array_id"]) for t in tasks] == [(0, str(array_id)), (1, str(array_id))]
        assert (await http.get(f"/api/v1/jobs?array={array_id}", headers=auth("research"))).status_code == 404

        changed = await http.post(f"/api/v1/jobs/{array_id}/parallelism", json={"parallelism": 3},
                                  headers=auth("acme"))
        assert changed.status_code == 202, changed.text
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        message = decode(incoming.body)
        assert (message.TYPE, message.parallelism, incoming.routing_key) == (  # type: ignore[attr-defined]
            "job.array_set", 3, "job.array_set.acme")
        cancel = await http.post(f"/api/v1/jobs/{array_id}/cancel", json={"array_tasks": "2-3"}, headers=auth("acme"))
        assert cancel.status_code == 202
        message = decode((await asyncio.wait_for(api.submissions.get(), 10)).body)
        assert (message.TYPE, message.array_tasks) == ("job.cancel", "2-3")  # type: ignore[attr-defined]
        not_array = await http.post(f"/api/v1/jobs/{array_task_id(array_id, 0)}/parallelism",
                                    json={"parallelism": 3}, headers=auth("acme"))
        assert not_array.status_code == 400 and not_array.json()["title"] == "Bad Request"
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute("UPDATE jobs SET state = 'succeeded' WHERE job_id = $1", array_id)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        ended = await http.post(f"/api/v1/jobs/{array_id}/parallelism", json={"parallelism": 4}, headers=auth("acme"))
        assert ended.status_code == 409 and "already ended (succeeded)" in ended.json()["detail"], ended.text
        assert api.submissions.empty()  # nothing published for the refused change


async def test_recent_events_are_listed_newest_first_to_whom_they_concern(api: RunningApi, migrated_dsn: str) -> None:
    ids = await seed(migrated_dsn)
    logged = [("job.accepted", {"job_id": str(ids["acme_running"]), "tenant": "acme"}),
              ("job.placed", {"job_id": str(ids["research_queued"]), "node_id": "n1"}),  # research's: not acme's
              ("node.heartbeat", {"node_id": "n1"}),  # not an event worth a line
              ("node.liveness_changed", {"node_id": "n1", "liveness": "suspect"}),
              ("job.started", {"job_id": str(ids["acme_running"]), "node_id": "n1"})]
    conn = await asyncpg.connect(migrated_dsn)
    try:
        for event_type, payload in logged:
            await conn.execute("INSERT INTO events (stream, message_id, type, occurred_at, payload) "
                               "VALUES ('test', $1, $2, now(), $3::text::jsonb)", uuid.uuid4(), event_type,
                               json.dumps(payload))
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        mine = (await http.get("/api/v1/events/recent", headers=auth("acme"))).json()
        assert [(e["type"], e.get("job_id")) for e in mine] == [
            ("job.started", str(ids["acme_running"])), ("node.liveness_changed", None),
            ("job.accepted", str(ids["acme_running"]))]
        everything = (await http.get("/api/v1/events/recent", params={"limit": 10}, headers=auth("ops"))).json()
        assert len(everything) == 4
        assert len((await http.get("/api/v1/events/recent", params={"limit": 1}, headers=auth("ops"))).json()) == 1
        conn = await asyncpg.connect(migrated_dsn)
        try:  # telemetry's detections are events too (the live stream carries them): one of acme's, one of research's
            for job_id, tenant in ((ids["acme_running"], "acme"), (ids["research_queued"], "research")):
                await conn.execute(
                    "INSERT INTO telemetry_alerts (alert_id, category, kind, severity, dedup_key, job_id, node_id, "
                    "tenant, explanation, raised_at) VALUES ($1, 'alert', 'contended', 'warning', $2, $3, 'n1', $4, "
                    "'slowed by a neighbour', now() + interval '1 second')",
                    uuid.uuid4(), f"contended:job:{job_id}", job_id, tenant)
        finally:
            await conn.close()
        mine = (await http.get("/api/v1/events/recent", headers=auth("acme"))).json()
        assert [(e["type"], e.get("job_id"), e.get("kind")) for e in mine[:2]] == [
            ("alert.raised", str(ids["acme_running"]), "contended"), ("job.started", str(ids["acme_running"]), None)]
        assert len(mine) == 4 and mine[0]["explanation"] == "slowed by a neighbour"
        bad = await http.get("/api/v1/events/recent", params={"since": "a while"}, headers=auth("acme"))
        assert bad.status_code == 422 and bad.json()["detail"].startswith("since:")


async def test_operators_reserve_and_delete_and_tenants_see_their_reservations(
        api: RunningApi, migrated_dsn: str, amqp_url: str) -> None:
    await seed(migrated_dsn)
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    queue = await channel.declare_queue("test.reservations", exclusive=True)
    await queue.bind(SUBMIT_EXCHANGE, "reservation.#")
    body = {"tenant": "acme", "gpus": 2, "gpu_model": "a100", "start_at": "2030-01-02T14:00:00Z", "duration_s": 3600}
    try:
        async with httpx.AsyncClient(base_url=api.url) as http:
            assert (await http.post("/api/v1/reservations", json=body, headers=auth("acme"))).status_code == 403
            answer = await http.post("/api/v1/reservations", json=body, headers=auth("ops"))
            assert answer.status_code == 202, answer.text
            incoming = await queue.get(timeout=10, fail=True)
            asked = decode(incoming.body)
            assert (asked.TYPE, str(asked.reservation_id), asked.on_behalf_of) == (  # type: ignore[attr-defined]
                "reservation.create", answer.json()["reservation_id"], "ops")
            conn = await asyncpg.connect(migrated_dsn)
            await conn.execute(  # the row the scheduler writes when it logs ReservationCreated
                "INSERT INTO reservations (reservation_id, tenant, gpus, gpu_model, nodes, start_at, end_at, outcome) "
                "VALUES ($1, 'acme', 2, 'a100', ARRAY['n1', 'gone-node'], now() - interval '1 minute', "
                "now() + interval '1 hour', 'created')", asked.reservation_id)  # type: ignore[attr-defined]
            await conn.close()
            [mine] = (await http.get("/api/v1/reservations", headers=auth("acme"))).json()
            assert (mine["state"], mine["nodes"]) == ("active", ["n1", "gone-node"])
            assert mine["problems"] == ["cannot be honoured: some of its nodes are not alive", "node gone-node is gone"]
            assert (await http.get("/api/v1/reservations", headers=auth("research"))).json() == []
            path = f"/api/v1/reservations/{mine['reservation_id']}"
            assert (await http.get(path, headers=auth("research"))).status_code == 404
            assert (await http.delete(path, headers=auth("acme"))).status_code == 403
            assert (await http.delete(path, headers=auth("ops"))).status_code == 202
            deleted = decode((await queue.get(timeout=10, fail=True)).body)
            assert deleted.TYPE == "reservation.delete"
    finally:
        await connection.close()
