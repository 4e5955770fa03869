"""Launch latency and short-job throughput of one NodeExecutor (real supervisors and processes, no broker).

    uv run python services/executor/bench/launch_latency.py [jobs]

Prints a table: time for ``handle(LaunchJob)`` to return (record durable, supervisor started, job running,
JobStarted confirmed by an in-memory publisher), and the wall time until every job's outcome was published.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from gpuorch_contracts import JobFinished, JobSpec, LaunchJob, ProcessRun
from gpuorch_messaging.testing import RecordingPublisher

from gpuorch_executor.backends.process import ProcessBackend
from gpuorch_executor.domain.allowlist import AllowList, TenantPolicy
from gpuorch_executor.handlers import NodeExecutor, NodeSettings

INLINE_PYTHON = AllowList({"default": TenantPolicy(commands=frozenset({"python"}), inline_code=True)})
"""The benchmark's jobs are ``python -c pass``: inline code allowed explicitly (the default refuses it)."""


async def run(jobs: int, concurrent: bool) -> str:
    with tempfile.TemporaryDirectory() as state:
        publisher = RecordingPublisher()
        executor = NodeExecutor(NodeSettings(node_id="bench", state_dir=Path(state),
                                             backends={"process": ProcessBackend(None)}, poll_interval_s=0.02,
                                             allow_list=INLINE_PYTHON, unsandboxed=True), publisher)  # as itself
        watcher = asyncio.create_task(executor.run())
        commands = [LaunchJob(node_id="bench", job_id=uuid.uuid4(), placement_id=uuid.uuid4(),
                              spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"])))
                    for _ in range(jobs)]
        latencies: list[float] = []

        async def launch(command: LaunchJob) -> None:
            start = time.perf_counter()
            await executor.handle(command)
            latencies.append(time.perf_counter() - start)

        begin = time.perf_counter()
        if concurrent:  # as the broker delivers them (prefetch): handlers overlap
            await asyncio.gather(*(launch(command) for command in commands))
        else:
            for command in commands:
                await launch(command)
        while len(publisher.of_type(JobFinished)) < jobs:
            await asyncio.sleep(0.01)
        total = time.perf_counter() - begin
        watcher.cancel()
    latencies.sort()
    return (f"| {'concurrent' if concurrent else 'sequential'} | {jobs} | {statistics.median(latencies) * 1000:.1f} | "
            f"{latencies[int(0.95 * (len(latencies) - 1))] * 1000:.1f} | {latencies[-1] * 1000:.1f} | "
            f"{total:.2f} | {jobs / total:.1f} |")


async def main(jobs: int) -> None:
    rows = [await run(jobs, concurrent=False), await run(jobs, concurrent=True)]
    print("| launches | jobs | launch p50 ms | launch p95 ms | launch max ms | all finished s | jobs/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50))
