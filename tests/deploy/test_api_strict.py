"""The API in a strict deployment: every service logs in as its own least-privilege broker user with
GPUORCH_IDENTITY=strict and one identity map, the API as the gateway user ``api-*``. A team member holding only a
token submits, follows and reads the logs of its job, and cancels its own job; another team can neither see nor
cancel it; a submitter that names ``on_behalf_of`` on the broker itself is rejected by the scheduler. The weekly
report of a team covers its own tenant; dead letters are listed for an operator token only, through the least-privilege
operator broker user (``GPUORCH_DLQ_AMQP_URL``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from gpuorch_contracts import JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode
from gpuorch_messaging.queues import Installation, install

from tests.deploy.broker_users import BrokerUsers, gen
from tests.e2e.harness import wait_jobs_terminal, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "strict-node-1"
TOKENS = {"acme-team": "acme-token", "research-team": "research-token", "ops": "ops-token"}
ROLES = ("scheduler", "telemetry", "executor", "node-agent", "api", "research-team", "operator")


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[dict[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"{role}-{suffix}" for role in ROLES}
    created = BrokerUsers(amqp_vhost, [
        gen.scheduler(names["scheduler"]), gen.telemetry(names["telemetry"]), gen.api(names["api"]),
        gen.executor(names["executor"], [NODE]), gen.node_agent(names["node-agent"], "node-agent.fleet.local", [NODE]),
        gen.submitter(names["research-team"], ["research"]), gen.operator(names["operator"]),
    ]).create()
    try:
        yield names | {f"{role}-url": created.url(name) for role, name in names.items()} | {"admin": created.admin_url}
    finally:
        created.delete()


def identity_map(names: dict[str, str]) -> dict[str, Any]:
    teams = {"acme-team": ["acme"], "research-team": ["research"]}
    return {
        "identities": {
            names["scheduler"]: {"role": "service"}, names["telemetry"]: {"role": "service"},
            names["executor"]: {"role": "service", "nodes": [NODE]},
            names["node-agent"]: {"role": "service", "nodes": [NODE]},
            names["api"]: {"role": "gateway"},
            **{team: {"role": "submitter", "tenants": tenants, "default_tenant": tenants[0]}
               for team, tenants in teams.items()},
            names["research-team"]: {"role": "submitter", "tenants": ["research"], "default_tenant": "research"},
            "ops": {"role": "operator", "tenants": ["*"], "default_tenant": "acme"},
            names["operator"]: {"role": "operator", "tenants": ["*"], "default_tenant": "acme"},
        },
        "tokens": {hashlib.sha256(token.encode()).hexdigest(): team for team, token in TOKENS.items()},
    }


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str, users: dict[str, str]) -> Iterator[LocalStack]:
    allow = {"tenants": {t: {"commands": ["python"], "inline_code": True} for t in ("acme", "research")}}
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[SimNode(NODE, "a100-80", 2)],
                       identity_map=identity_map(users),
                       extra_env={"GPUORCH_IDENTITY": "strict", "GPUORCH_BROKER_TOPOLOGY": "passive",
                                  "GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5",
                                  "GPUORCH_EXECUTOR_ALLOW": json.dumps(allow)})
    try:
        yield local
    finally:
        local.stop_all()
        local.kill_jobs()


async def test_a_token_holder_submits_reads_logs_and_cancels_only_its_own_jobs(
        stack: LocalStack, users: dict[str, str], pg_dsn: str) -> None:
    await install(users["admin"], Installation(tenants=["acme", "research"], executor_nodes=[NODE],
                                               node_agents=[("node-agent.fleet.local", [NODE])]))
    stack.start_scheduler(GPUORCH_AMQP_URL=users["scheduler-url"])
    stack.start_executor(GPUORCH_AMQP_URL=users["executor-url"])
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", f"executor.{NODE}"], timeout_s=60,
                                consumed=True)
    stack.start_telemetry(GPUORCH_AMQP_URL=users["telemetry-url"])
    await stack.queues_declared(["telemetry.samples"], timeout_s=60, consumed=True)
    stack.start_node_agents(GPUORCH_AMQP_URL=users["node-agent-url"])
    await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rows: len(rows) == 1, what="node registered")
    url = await asyncio.to_thread(stack.start_api, GPUORCH_AMQP_URL=users["api-url"],
                                  GPUORCH_DLQ_AMQP_URL=users["operator-url"])
    acme = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKENS['acme-team']}"}, timeout=30)
    research = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKENS['research-team']}"},
                                 timeout=30)
    try:
        spec = {"resources": {"gpus": 1}, "run": {"runtime": "process", "argv": ["python", "-c", "print('hi')"]}}
        job_id = uuid.UUID((await acme.post("/api/v1/jobs", json={"spec": spec})).json()["job_id"])
        rows = await wait_jobs_terminal(pg_dsn, [job_id], timeout_s=60)
        assert (rows[job_id]["state"], rows[job_id]["tenant"]) == ("succeeded", "acme"), stack.tail("scheduler-1")
        for _ in range(100):  # the API learns the node's log endpoint from the executor's next heartbeat
            logs = await acme.get(f"/api/v1/jobs/{job_id}/logs")
            if logs.status_code != 503:
                break
            await asyncio.sleep(0.2)
        assert (logs.status_code, logs.text) == (200, "hi\n")
        assert (await research.get(f"/api/v1/jobs/{job_id}")).status_code == 404

        sleeper = {**spec, "run": {"runtime": "process", "argv": ["python", "-c", "import time; time.sleep(600)"]}}
        long_id = (await acme.post("/api/v1/jobs", json={"spec": sleeper})).json()["job_id"]
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", uuid.UUID(long_id),
                        until=lambda rs: rs and rs[0]["state"] == "running", what="the long job running")
        assert (await research.post(f"/api/v1/jobs/{long_id}/cancel")).status_code == 404  # as for no job (issue 29)
        assert (await acme.post(f"/api/v1/jobs/{long_id}/cancel")).status_code == 202
        cancelled = await wait_jobs_terminal(pg_dsn, [uuid.UUID(long_id)], timeout_s=60)
        assert cancelled[uuid.UUID(long_id)]["state"] == "cancelled"

        report = await acme.get("/api/v1/report", params={"since": "1h"})
        assert report.status_code == 200 and report.json()["tenants_shown"] == ["acme"], report.text
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKENS['ops']}"},
                                     timeout=30) as ops:
            dead = await ops.get("/api/v1/dlq")
            assert dead.status_code == 200 and dead.json() == [], dead.text  # basic.get on *.dlq as the operator
        assert (await acme.get("/api/v1/dlq")).status_code == 403
    finally:
        await acme.aclose()
        await research.aclose()

    # the research team's own broker user names on_behalf_of: only the gateway may, so the scheduler rejects it
    forged = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"])), on_behalf_of="acme-team")
    connection = await aio_pika.connect(users["research-team-url"])
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(aio_pika.Message(forged.model_dump_json().encode(), content_type="application/json",
                                                message_id=str(forged.message_id),
                                                user_id=users["research-team"]), "job.submit.research",
                               mandatory=True)
    finally:
        await connection.close()
    refused = await wait_jobs_terminal(pg_dsn, [forged.job_id], timeout_s=60)
    assert refused[forged.job_id]["state"] == "rejected"
    assert "only a gateway" in refused[forged.job_id]["reason"]
    for name in stack.processes:
        assert "ACCESS_REFUSED" not in stack.tail(name, 400), f"{name} was refused something"
