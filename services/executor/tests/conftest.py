"""Fixtures for executor tests: a NodeExecutor on a temporary state directory, publishing to a recorder."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from gpuorch_contracts import (
    Checkpoint,
    ContainerRun,
    GpuAllocation,
    JobFailed,
    JobFinished,
    JobLost,
    JobSpec,
    LaunchJob,
    ProcessRun,
)
from gpuorch_messaging.testing import RecordingPublisher

from gpuorch_executor.backends.container import ContainerBackend
from gpuorch_executor.backends.process import ProcessBackend
from gpuorch_executor.domain.allowlist import AllowList, TenantPolicy
from gpuorch_executor.handlers import NodeExecutor, NodeSettings

NODE = "node-t"
TEST_ALLOW = AllowList({
    # the tests' jobs are `python -c ...`: inline code allowed by this test configuration, not by the default
    "default": TenantPolicy(commands=frozenset({"python", "python3"}), inline_code=True),
    "shells": TenantPolicy(commands=frozenset({"sh"})),
    "images": TenantPolicy(images=("registry.example/team/",)),
})


def launch_job(argv: list[str], *, gpus: list[str] | None = None, tenant: str = "default",
               env: dict[str, str] | None = None, workdir: str | None = None, max_runtime_s: float | None = None,
               checkpoint: Checkpoint | None = None, memory_mib: int = 256, run: Any = None) -> LaunchJob:
    spec = JobSpec(
        tenant=tenant, run=run or ProcessRun(argv=argv, env=env or {}, workdir=workdir),
        max_runtime_s=max_runtime_s, checkpoint=checkpoint or Checkpoint(), memory_mib=memory_mib,
    )
    return LaunchJob(
        node_id=NODE, job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=spec,
        gpus=[GpuAllocation(gpu_uuid=u, gpu_index=i) for i, u in enumerate(gpus or [])],
    )


def container_job(image: str, argv: list[str], **kwargs: Any) -> LaunchJob:
    kwargs.setdefault("tenant", "images")
    return launch_job([], run=ContainerRun(image=image, argv=argv), **kwargs)


def terminal(publisher: RecordingPublisher, placement_id: uuid.UUID) -> list[Any]:
    return [m for m in publisher.of_type(JobFinished) + publisher.of_type(JobFailed) + publisher.of_type(JobLost)
            if m.placement_id == placement_id]


class Harness:
    def __init__(self, state_dir: Path, docker: str | None = None, **settings: Any) -> None:
        """``settings`` override the ``NodeSettings`` of the tests (``backends``, ``job_users``...)."""
        self.state_dir = state_dir
        self.publisher = RecordingPublisher()
        backends: dict[str, Any] = {"process": ProcessBackend(None)}
        if docker is not None:
            backends["container"] = ContainerBackend(docker)
        self.executor = NodeExecutor(NodeSettings(**{
            "node_id": NODE, "state_dir": state_dir, "backends": backends, "allow_list": TEST_ALLOW,
            "executor_env": dict(os.environ), "poll_interval_s": 0.02,
            "unsandboxed": settings.get("job_users") is None, **settings,  # tests' jobs run as their own user
        }), self.publisher)

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
        """Run watch passes until ``predicate`` holds (the timeout only guards against a hang)."""
        async def loop() -> None:
            while not predicate():
                await self.executor.tick()
                await self.executor.flush_all()
                await asyncio.sleep(0.02)
        await asyncio.wait_for(loop(), timeout_s)

    async def until_ended(self, placement_id: uuid.UUID) -> Any:
        await self.until(lambda: bool(terminal(self.publisher, placement_id)))
        return terminal(self.publisher, placement_id)[0]


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path / "state")
    yield h
    for record in h.executor.active_placements():
        await h.executor.settings.backends["process"].kill(record)
