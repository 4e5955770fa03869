"""Escalation 1 (issue 29): a dead-letter replay must not launder a submission into the operator's identity.

Against the real broker and the real scheduler (strict identity, least-privilege broker users, the topology declared
by the setup step). Submissions from ``acme-ci`` are dead-lettered on the shared lane by the library's own consumer
(a handler that keeps failing, as a broken admission would, so the dead letters are written exactly as the
scheduler writes them), then the scheduler runs and an operator replays the lane with ``gpuctl dlq replay``
(direct path, the operator broker user). The operator may submit for tenant ``research`` at ``critical``; none of the
replayed jobs may get that:

    J1  acme-ci, user_id set, no tenant named          -> replayed, admitted as tenant acme (the operator: research)
    J2  acme-ci, user_id set, names research/critical  -> replayed, rejected: acme-ci may not use research
    J3  acme-ci's connection, no user_id, research      -> never replayed ("published without a user_id"), kept in
                                                           the dead-letter queue; never a job
    J4  acme-ci claims another identity in the original-publisher header (research-ci, which may use research)
                                                        -> refused at once, recorded as acme-ci; replayed as acme-ci,
                                                           rejected
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from gpuorch_contracts import SUBMIT_EXCHANGE, GpuRequest, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import ORIGINAL_PUBLISHER_HEADER, Broker, submission_lanes
from gpuorch_messaging.dead_letters import peek
from gpuorch_messaging.queues import Installation, install

from tests.deploy.broker_users import RoleUsers, gen
from tests.e2e.harness import wait_rows

pytestmark = [pytest.mark.security, pytest.mark.integration, pytest.mark.slow]

LANE = "scheduler.submit"
RUN = ProcessRun(argv=["python", "-c", "pass"])


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    with RoleUsers(amqp_vhost, {"scheduler": gen.scheduler, "operator": gen.operator,
                                "acme-ci": lambda name: gen.submitter(name, ["acme"])}).created() as created:
        yield created


def identity_map(users: RoleUsers) -> dict[str, Any]:
    names = users.names
    return {"identities": {
        names["scheduler"]: {"role": "service"},
        names["operator"]: {"role": "operator", "tenants": ["*"], "default_tenant": "research",
                            "max_priority": "critical"},
        names["acme-ci"]: {"role": "submitter", "tenants": ["acme"], "default_tenant": "acme",
                           "max_priority": "normal"},
        research_ci(users): {"role": "submitter", "tenants": ["research"], "default_tenant": "research",
                             "max_priority": "critical"},
    }}


def research_ci(users: RoleUsers) -> str:
    return "research-ci-" + users.names["acme-ci"].rsplit("-", 1)[-1]


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str, users: RoleUsers) -> Iterator[LocalStack]:
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[],
                       identity_map=identity_map(users),
                       extra_env={"GPUORCH_IDENTITY": "strict", "GPUORCH_BROKER_TOPOLOGY": "passive",
                                  "GPUORCH_TICK_S": "0.5"})
    try:
        yield local
    finally:
        local.stop_all()


async def publish_as(url: str, message: SubmitJob, *, user_id: str | None, **headers: str) -> None:
    """A submission as another system sends it: plain AMQP to the shared lane, ``user_id`` as given."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(SUBMIT_EXCHANGE)
        await exchange.publish(aio_pika.Message(
            message.model_dump_json().encode(), message_id=str(message.message_id), user_id=user_id,
            content_type="application/json", headers=headers or None), "job.submit", mandatory=True)
    finally:
        await connection.close()


async def dead_letters_of(url: str, expected: int) -> list[Any]:
    async with asyncio.timeout(60):
        while True:
            found = await peek(url, [LANE], 100)
            if len(found) >= expected:
                return found
            await asyncio.sleep(0.2)


async def test_a_replay_is_judged_as_the_first_publisher_never_as_the_operator(
        users: RoleUsers, stack: LocalStack, amqp_url: str, pg_dsn: str) -> None:
    await install(amqp_url, Installation(tenants=["acme", "research"]))  # the setup step (guest administers tests)
    acme = users.url("acme-ci")
    j1 = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    j2 = SubmitJob(spec=JobSpec(run=RUN, tenant="research", priority_class="critical", resources=GpuRequest(gpus=1)))
    j3 = SubmitJob(spec=JobSpec(run=RUN, tenant="research", priority_class="critical", resources=GpuRequest(gpus=1)))
    j4 = SubmitJob(spec=JobSpec(run=RUN, tenant="research", priority_class="critical", resources=GpuRequest(gpus=1)))

    # a broken admission: the scheduler's user consumes the lane with the library and every attempt fails
    failing = Broker(users.url("scheduler"), producer="scheduler/broken", declare_topology=False)

    async def fail(message: Message, publisher: str | None) -> None:
        raise RuntimeError("admission is broken today")

    await failing.connect(timeout_s=10)
    try:
        await failing.consume(submission_lanes([])[0], fail, with_sender=True)
        await publish_as(acme, j1, user_id=users.names["acme-ci"])
        await publish_as(acme, j2, user_id=users.names["acme-ci"])
        await publish_as(acme, j3, user_id=None)
        await publish_as(acme, j4, user_id=users.names["acme-ci"], **{ORIGINAL_PUBLISHER_HEADER: research_ci(users)})
        letters = {letter.message_id: letter for letter in await dead_letters_of(amqp_url, 4)}
    finally:
        await failing.close()
    publishers = {str(m.message_id): letters[str(m.message_id)].publisher for m in (j1, j2, j3, j4)}
    assert publishers == {str(j1.message_id): users.names["acme-ci"], str(j2.message_id): users.names["acme-ci"],
                          str(j3.message_id): "", str(j4.message_id): users.names["acme-ci"]}  # never the claim
    assert "has no user_id" in letters[str(j3.message_id)].reason
    assert "only an operator replaying" in letters[str(j4.message_id)].reason

    stack.start_scheduler(GPUORCH_AMQP_URL=users.url("scheduler"))
    await stack.queues_declared([LANE, "scheduler"], timeout_s=60, consumed=True)
    replay = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "gpuorch_gpuctl", "dlq", "replay", "--queue", LANE, "--amqp-url", users.url("operator"),
        "--json"], capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    done = json.loads(replay.stdout)
    assert sorted(m["message_id"] for m in done["messages"]) == sorted(str(m.message_id) for m in (j1, j2, j4))
    assert [(s["letter"]["message_id"], "without a user_id" in s["why"]) for s in done["skipped"]] == [
        (str(j3.message_id), True)]

    rows = await wait_rows(pg_dsn, "SELECT job_id, tenant, priority_class, state, reason FROM jobs",
                           until=lambda rs: len(rs) >= 3, what="the three replayed submissions decided")
    jobs = {row["job_id"]: row for row in rows}
    assert (jobs[j1.job_id]["tenant"], jobs[j1.job_id]["priority_class"]) == ("acme", "normal")
    assert jobs[j1.job_id]["state"] != "rejected", jobs[j1.job_id]
    for forged in (j2, j4):
        assert jobs[forged.job_id]["state"] == "rejected", jobs[forged.job_id]
        assert f"{users.names['acme-ci']} may not submit for tenant 'research'" in jobs[forged.job_id]["reason"]
    marker = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    await publish_as(acme, marker, user_id=users.names["acme-ci"])  # once decided, everything before it was
    await wait_rows(pg_dsn, "SELECT 1 FROM jobs WHERE job_id = $1", marker.job_id, until=bool, what="marker")
    assert await wait_rows(pg_dsn, "SELECT 1 FROM jobs WHERE job_id = $1", j3.job_id, until=lambda rs: True) == []
    assert [letter.message_id for letter in await peek(amqp_url, [LANE], 100)] == [str(j3.message_id)]
