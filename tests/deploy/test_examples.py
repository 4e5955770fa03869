"""The non-Python example (examples/submit_job.sh: curl + jq through RabbitMQ's HTTP API) against the real broker,
as the generator's ``submitter`` user: it waits for the answer and its exit status says what it was."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import httpx
import pytest
from gpuorch_contracts import JobAccepted, JobRejected, Message, SubmitJob
from gpuorch_messaging import Broker, submission_lanes
from gpuorch_messaging.topology import declare_exchanges

from conftest import AMQP_MGMT
from tests.deploy.broker_users import RoleUsers, gen

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "submit_job.sh"


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    with RoleUsers(amqp_vhost, {"scheduler": gen.scheduler,
                                "submitter": lambda name: gen.submitter(name, ["default"], http_api=True),
                                "plain": lambda name: gen.submitter(name, ["default"])}).created() as created:
        yield created


@pytest.fixture
async def topology(users: RoleUsers) -> None:
    await users.install()  # the setup step: exchanges and the scheduler's queues, nobody consuming yet


@pytest.fixture
async def exchanges_only(users: RoleUsers) -> None:
    """The exchanges without any queue: a submission has no route."""
    connection = await aio_pika.connect(users.admin_url)
    try:
        await declare_exchanges(await connection.channel())
    finally:
        await connection.close()


@pytest.fixture
async def scheduler(users: RoleUsers, topology: None) -> AsyncIterator[list[SubmitJob]]:
    """Stand-in scheduler on the shared submission lane: rejects a job named ``bad``, accepts the rest, answering
    on the submitter's tenant."""
    broker = Broker(users.url("scheduler"), producer="scheduler/stand-in", declare_topology=False,
                    identity="trust_all")
    await broker.connect()
    received: list[SubmitJob] = []

    async def answer(message: Message) -> None:
        assert isinstance(message, SubmitJob)
        received.append(message)
        if message.spec.name == "bad":
            await broker.publish(JobRejected(job_id=message.job_id, reason="not today", tenant="default"))
        else:
            await broker.publish(JobAccepted(job_id=message.job_id, spec=message.spec))

    await broker.consume(submission_lanes([])[0], answer)
    yield received
    await broker.close()


def run_script(users: RoleUsers, role: str, spec: Path | None = None) -> subprocess.CompletedProcess[str]:
    mgmt = httpx.URL(AMQP_MGMT)
    user = users.names[role]
    api = f"http://{user}:{gen.dev_password(user)}@{mgmt.host}:{mgmt.port}"
    argv = [str(SCRIPT), api, users.vhost, "default", *([str(spec)] if spec else [])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={
        "PATH": "/usr/bin:/bin", "GPUORCH_TIMEOUT_S": "20"})


async def test_the_shell_example_waits_for_acceptance(users: RoleUsers, scheduler: list[SubmitJob]) -> None:
    done = await asyncio.to_thread(run_script, users, "submitter")
    assert done.returncode == 0, done.stderr
    job_id, answer = done.stdout.split()
    assert answer == "job.accepted" and scheduler[0].job_id == uuid.UUID(job_id)
    assert scheduler[0].producer == "example/shell" and "tenant" not in scheduler[0].spec.model_fields_set


async def test_the_shell_example_exits_2_on_rejection(
    users: RoleUsers, scheduler: list[SubmitJob], tmp_path: Path
) -> None:
    spec = tmp_path / "bad.json"
    spec.write_text('{"name": "bad", "run": {"runtime": "process", "argv": ["python3"]}}')
    done = await asyncio.to_thread(run_script, users, "submitter", spec)
    assert done.returncode == 2 and "rejected: not today" in done.stderr
    assert done.stdout.split()[1] == "job.rejected"


async def test_the_shell_example_exits_3_on_no_route(users: RoleUsers, exchanges_only: None) -> None:
    done = await asyncio.to_thread(run_script, users, "submitter")
    assert done.returncode == 3 and "NO_ROUTE" in done.stderr and done.stdout == ""


async def test_without_the_http_api_tag_the_broker_refuses(users: RoleUsers, scheduler: list[SubmitJob]) -> None:
    done = await asyncio.to_thread(run_script, users, "plain")
    assert done.returncode == 3 and "refused by the broker" in done.stderr and not scheduler
