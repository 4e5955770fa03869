"""gpuorch_client against the real RabbitMQ, with a stand-in scheduler that answers submissions.

The stand-in consumes ``job.submit`` and publishes, per tenant, what the real scheduler would: JobRejected for a
spec named ``bad``, otherwise JobAccepted followed by JobStarted and JobFinished. Permissions are not the point
here (tests/deploy proves a submitter user can read only its tenant's events); everyone connects as guest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gpuorch_client import GpuorchClient, SubmissionRefused
from gpuorch_contracts import (
    SUBMIT_SHARED_EXCHANGE,
    JobAccepted,
    JobFinished,
    JobRejected,
    JobStarted,
    Message,
    SubmissionRejected,
    SubmitJob,
)
from gpuorch_messaging import Broker, QueueSpec

pytestmark = pytest.mark.integration

SPEC = {"name": "hello", "run": {"runtime": "process", "argv": ["python", "-c", "1"]}}


@pytest.fixture
async def scheduler(amqp_url: str) -> AsyncIterator[list[SubmitJob]]:
    """A stand-in scheduler; yields the submissions it received."""
    broker = Broker(amqp_url, producer="scheduler/stand-in")
    await broker.connect()
    received: list[SubmitJob] = []

    async def answer(message: Message) -> None:
        assert isinstance(message, SubmitJob)
        received.append(message)
        tenant = message.spec.tenant if "tenant" in message.spec.model_fields_set else "acme"
        if message.spec.name == "unreadable":  # as the scheduler answers a body it could not read a job id from
            await broker.publish(SubmissionRejected(submission_message_id=str(message.message_id), size_bytes=1,
                                                    reason="message exceeds the limit", tenant=tenant))
            return
        if message.spec.name == "bad":
            await broker.publish(JobRejected(job_id=message.job_id, reason="bad is not allowed", tenant=tenant))
            return
        placement = uuid.uuid4()
        await broker.publish(JobAccepted(job_id=message.job_id, spec=message.spec.model_copy(
            update={"tenant": tenant})))
        await broker.publish(JobStarted(job_id=message.job_id, placement_id=placement, node_id="n1", tenant=tenant))
        await broker.publish(JobFinished(job_id=message.job_id, placement_id=placement, node_id="n1", exit_code=0,
                                         duration_s=1, tenant=tenant))

    await broker.consume(QueueSpec("t.scheduler", [(SUBMIT_SHARED_EXCHANGE, "")]), answer)  # every lane
    yield received
    await broker.close()


async def test_submit_wait_and_follow_one_job_to_its_end(amqp_url: str, scheduler: list[SubmitJob]) -> None:
    async with GpuorchClient(amqp_url, "acme") as client:
        job_id = await client.submit(SPEC)
        answer = await client.wait(job_id, timeout_s=10)
        assert isinstance(answer, JobAccepted) and answer.job_id == job_id and answer.spec.tenant == "acme"
        assert [e.TYPE async for e in client.follow(job_id, timeout_s=10)] == ["job.started", "job.finished"]
    assert "tenant" not in scheduler[0].spec.model_fields_set  # omitted stays omitted on the wire


async def test_a_rejection_is_an_answer_with_its_reason(amqp_url: str, scheduler: list[SubmitJob]) -> None:
    async with GpuorchClient(amqp_url, "acme") as client:
        job_id = await client.submit({**SPEC, "name": "bad"})
        answer = await client.wait(job_id, timeout_s=10)
        assert isinstance(answer, JobRejected) and answer.reason == "bad is not allowed"


async def test_a_submission_rejected_unread_is_the_answer_of_the_job_it_carried(
        amqp_url: str, scheduler: list[SubmitJob]) -> None:
    async with GpuorchClient(amqp_url, "acme") as client:
        job_id = await client.submit({**SPEC, "name": "unreadable"})
        answer = await client.wait(job_id, timeout_s=10)
        assert isinstance(answer, SubmissionRejected) and "exceeds" in answer.reason


async def test_only_its_own_tenants_events_reach_the_client(amqp_url: str, scheduler: list[SubmitJob]) -> None:
    async with GpuorchClient(amqp_url, "acme") as acme, GpuorchClient(amqp_url, "beta") as beta:
        betas = uuid.uuid4()
        beta.watch(betas)
        await acme.submit({**SPEC, "tenant": "beta"}, job_id=betas)  # answered on job.<event>.beta
        assert [e.TYPE async for e in beta.follow(betas, timeout_s=10)] == [
            "job.accepted", "job.started", "job.finished"]
        mine = await acme.submit(SPEC)  # routed after every beta event: one queue delivers in order
        assert [e.TYPE async for e in acme.follow(mine, timeout_s=10)][-1] == "job.finished"
        assert acme.buffered(betas) == 0


@pytest.fixture
async def topology(amqp_url: str) -> None:
    """gpuorch's exchanges exist, but no scheduler queue is bound to job.submit."""
    broker = Broker(amqp_url, producer="topology")
    await broker.connect()
    await broker.close()


async def test_no_route_raises_instead_of_printing_a_job_id(amqp_url: str, topology: None) -> None:
    async with GpuorchClient(amqp_url, "acme") as client:
        with pytest.raises(SubmissionRefused, match="NO_ROUTE"):
            await client.submit(SPEC)


def run_cli(amqp_url: str, spec: dict[str, object], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, "-m", "gpuorch_client", amqp_url, "acme", str(path), "--timeout", "20"],
                          capture_output=True, text=True, timeout=60)


async def test_cli_exits_3_on_no_route(amqp_url: str, topology: None, tmp_path: Path) -> None:
    refused = await asyncio.to_thread(run_cli, amqp_url, SPEC, tmp_path)
    assert refused.returncode == 3 and "NO_ROUTE" in refused.stderr and refused.stdout == ""


async def test_cli_exits_3_when_gpuorch_was_never_set_up(amqp_url: str, tmp_path: Path) -> None:
    refused = await asyncio.to_thread(run_cli, amqp_url, SPEC, tmp_path)
    assert refused.returncode == 3 and "exchanges do not exist" in refused.stderr


async def test_cli_accepted_and_rejected(amqp_url: str, scheduler: list[SubmitJob], tmp_path: Path) -> None:
    accepted = await asyncio.to_thread(run_cli, amqp_url, SPEC, tmp_path)
    assert accepted.returncode == 0 and accepted.stdout.split()[1] == "job.accepted", accepted.stderr
    rejected = await asyncio.to_thread(run_cli, amqp_url, {**SPEC, "name": "bad"}, tmp_path)
    assert rejected.returncode == 2 and "bad is not allowed" in rejected.stderr
