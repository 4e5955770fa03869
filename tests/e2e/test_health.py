"""Every service answers /healthz and /readyz next to /metrics on its metrics port; /readyz names its checks
(broker connected, database reachable, consuming) and passes once they all do."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from gpuorch_gpuctl_ops.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ready(client: httpx.AsyncClient, port: int, stack: LocalStack, timeout_s: float = 60.0) -> dict:
    """The /readyz answer once it is 200 (fails with the last answer, or the dead services, after ``timeout_s``)."""
    last: object = None
    for _ in range(int(timeout_s / 0.2)):
        assert not stack.dead(), f"services died: {stack.dead()}"
        try:
            answer = await client.get(f"http://127.0.0.1:{port}/readyz")
            last = (answer.status_code, answer.text)
            if answer.status_code == 200:
                return dict(answer.json())
            assert answer.status_code == 503 and answer.json()["ready"] is False
        except httpx.TransportError as exc:
            last = exc
        await asyncio.sleep(0.2)
    raise AssertionError(f"not ready on port {port}: {last}")


async def test_every_service_answers_health_and_readiness_on_its_metrics_port(stack: LocalStack) -> None:
    ports = {name: _free_port() for name in ("scheduler", "executor", "telemetry", "node-agent")}
    stack.start_scheduler(GPUORCH_METRICS_PORT=str(ports["scheduler"]))
    stack.start_executor(GPUORCH_METRICS_PORT=str(ports["executor"]))
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    stack.start_telemetry(GPUORCH_METRICS_PORT=str(ports["telemetry"]))
    await stack.queues_declared(["telemetry.samples"])
    stack.start_node_agents(GPUORCH_METRICS_PORT=str(ports["node-agent"]))
    expected = {"scheduler": {"broker", "database", "consuming"}, "executor": {"broker", "consuming"},
                "telemetry": {"broker", "database", "consuming"}, "node-agent": {"broker", "consuming"}}
    async with httpx.AsyncClient(timeout=10) as client:
        for name, port in ports.items():
            answer = await _ready(client, port, stack)
            assert answer["ready"] is True and set(answer["checks"]) == expected[name], (name, answer)
            assert all(value == "ok" for value in answer["checks"].values()), (name, answer)
            health = await client.get(f"http://127.0.0.1:{port}/healthz")
            assert health.status_code == 200, name
            metrics = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert metrics.status_code == 200 and "# HELP" in metrics.text, name
        assert (await client.get(f"http://127.0.0.1:{ports['scheduler']}/nothing")).status_code == 404
