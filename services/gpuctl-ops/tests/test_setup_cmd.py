"""``gpuctl setup broker`` and ``gpuctl setup logs-credential`` against the real broker (a fresh vhost)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aio_pika
import pytest
from gpuorch_gpuctl_ops.setup_cmd import setup_app
from gpuorch_identity import log_credential
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

IDENTITY_MAP = Path(__file__).resolve().parents[3] / "deploy" / "identity.json"


async def test_setup_broker_declares_every_queue_of_the_installation_and_is_idempotent(amqp_url: str) -> None:
    args = ["broker", "--amqp-url", amqp_url, "--identity-map", str(IDENTITY_MAP), "--tenant", "quota-only",
            "--node", "gpu-a", "--node-agent", "node-agent.fleet.sim=sim-00000,sim-00001", "--json"]
    first = await asyncio.to_thread(CliRunner().invoke, setup_app, args)  # its own event loop
    assert first.exit_code == 0, first.output
    queues = json.loads(first.stdout)["queues"]
    assert {"scheduler", "scheduler.heartbeats", "scheduler.submit", "scheduler.submit.acme",
            "scheduler.submit.quota-only", "executor.gpu-a", "node-agent.gpu-a", "node-agent.fleet.sim",
            "telemetry.samples"} <= set(queues)
    assert "declared executor.gpu-a" in first.stderr  # progress, one line per queue
    again = await asyncio.to_thread(CliRunner().invoke, setup_app, args)
    assert again.exit_code == 0 and json.loads(again.stdout)["queues"] == queues
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        for name in (*queues, *(f"{q}.dlq" for q in queues)):
            await channel.declare_queue(name, passive=True)  # raises if it does not exist
        submit = await channel.get_exchange("gpuorch.submit", ensure=True)
        lane = await channel.declare_queue("scheduler.submit.acme", passive=True)
        arrived: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await lane.consume(arrived.put, no_ack=True)  # single active consumer: consumed, not got
        await submit.publish(aio_pika.Message(b"{}", message_id="m"), "job.submit.acme")
        assert (await asyncio.wait_for(arrived.get(), 10)).message_id == "m"  # the lane's binding is there
    finally:
        await connection.close()


def test_setup_broker_fails_in_one_line_when_the_broker_is_out_of_reach() -> None:
    result = CliRunner().invoke(setup_app, ["broker", "--amqp-url", "amqp://guest:guest@127.0.0.1:9/", "--wait-s", "1"])
    assert result.exit_code == 1 and "cannot reach RabbitMQ" in result.stderr and "guest:guest" not in result.stderr


def test_logs_credential_is_the_one_the_api_derives() -> None:
    result = CliRunner().invoke(setup_app, ["logs-credential", "executor-gpu-a", "--secret", "s", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"identity": "executor-gpu-a",
                                         "GPUORCH_LOGS_TOKEN": log_credential("s", "executor-gpu-a")}
    assert log_credential("s", "executor-gpu-a") != log_credential("s", "executor-gpu-b")
    missing = CliRunner().invoke(setup_app, ["logs-credential", "executor-gpu-a"], env={"GPUORCH_LOGS_SECRET": ""})
    assert missing.exit_code != 0
    for command in (["broker", "--help"], ["logs-credential", "--help"]):
        assert CliRunner().invoke(setup_app, command).exit_code == 0
