"""Usage advice end to end: jobs with known usage run on the simulated fleet, and telemetry names each problem.

The simulated NVML derives each GPU's usage from the real processes the executor started there (their
``GPUORCH_SIM_USAGE``); the node-agent adds host CPU and I/O of those processes; telemetry joins samples to jobs
through the executor's pid and raises alerts and recommendations.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode

from tests.e2e.harness import publish_when_routable, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLEEP = "import time; time.sleep(40)"
BURN = "import time\nend = time.time() + 40\nwhile time.time() < end: pass"

PROFILES = {  # name: (GPUORCH_SIM_USAGE, program, expected kind or None); the starved job asks for a tenth of a
    # core and keeps one busy (its input pipeline), while its GPU idles: starved from 8.5 % of a core on, which its
    # loop reaches on a busy 2-core machine too (it got 12-18 % of a core beside parallel test runs)
    "idle": ("util=0,mem_mib=300", SLEEP, "idle"),
    "oversized": ("util=60,mem_mib=4000", SLEEP, "oversized"),
    "starved": ("util=8,mem_mib=30000", BURN, "starved"),
    "throttled": ("util=80,mem_mib=30000,throttle=thermal", SLEEP, "throttled"),
    "memory-bound": ("util=70,mem_pct=96", SLEEP, "memory_pressure"),
    "healthy": ("util=85,mem_mib=60000", SLEEP, None),
}
STARVED_CPU_MILLI = 100


@pytest.mark.parametrize("stack", [[SimNode("node-1", "h100", 8)]], indirect=True)
@pytest.mark.timeout(240)
async def test_each_usage_problem_is_detected_with_advice_and_a_healthy_job_raises_nothing(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    from gpuorch_messaging import Broker

    stack.extra_env.update({
        "GPUORCH_USAGE_S": "1", "GPUORCH_TELEMETRY_WINDOW_S": "5", "GPUORCH_TELEMETRY_MIN_COVERAGE": "0.5",
        "GPUORCH_TELEMETRY_OVERSIZED_MIN_OBSERVED_S": "5", "GPUORCH_TELEMETRY_EVALUATION_INTERVAL_S": "1",
        "GPUORCH_TELEMETRY_SAMPLE_INTERVAL_S": "1",
    })
    await asyncio.to_thread(stack.start_all)
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    jobs: dict[uuid.UUID, str] = {}
    try:
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 1, what="node registered")
        for name, (usage, program, _) in PROFILES.items():
            cpu_milli = STARVED_CPU_MILLI if name == "starved" else 500
            submit = SubmitJob(spec=JobSpec(name=name, resources=GpuRequest(gpus=1), cpu_milli=cpu_milli, run=ProcessRun(
                argv=["python", "-c", program], env={"GPUORCH_SIM_USAGE": usage})))
            await publish_when_routable(broker, submit)
            jobs[submit.job_id] = name
        expected = {(job_id, kind) for job_id, name in jobs.items() if (kind := PROFILES[name][2])}
        try:
            rows = await wait_rows(
                pg_dsn, "SELECT job_id, kind, category, explanation, advice FROM telemetry_alerts",
                until=lambda rs: expected <= {(r["job_id"], r["kind"]) for r in rs}, timeout_s=150,
                what="every usage problem detected")
        except AssertionError as exc:  # say what telemetry saw of each job's host CPU, read when it failed
            seen = await wait_rows(
                pg_dsn, "SELECT job_id, avg(host_cpu_pct) AS cpu FROM telemetry_process_samples GROUP BY job_id",
                until=lambda rs: True)
            raise AssertionError(f"{exc}; host CPU seen: {[(jobs.get(r['job_id']), r['cpu']) for r in seen]}") from exc
    finally:
        await broker.close()
    by_job: dict[str, set[str]] = {}
    for r in rows:
        by_job.setdefault(jobs.get(r["job_id"], "?"), set()).add(r["kind"])
    assert "healthy" not in by_job, [(r["kind"], r["explanation"]) for r in rows if jobs.get(r["job_id"]) == "healthy"]
    oversized = next(r for r in rows if r["kind"] == "oversized")
    assert oversized["category"] == "recommendation" and oversized["advice"], oversized
    assert all(r["explanation"] for r in rows)
