"""A small sweep, then an evaluation step that starts only once every task of the sweep succeeded (issue 26).

    uv run python examples/sweep_then_evaluate.py amqp://submitter:submitter-dev@127.0.0.1:5672/gpuorch default

One SubmitJob carries the whole sweep (``spec.array``: tasks 0-7, at most 4 at once); each task reads its index from
``GPUORCH_ARRAY_TASK_ID``. The evaluation job names the sweep in ``depends_on`` (``afterok``): the scheduler holds it
("waiting for <sweep> (running)") until the last task ended, and cancels it with the reason should a task fail.
Exit status: 0 the evaluation finished, 1 it failed or was cancelled, 2 a submission was rejected. A tenant other
than ``default`` is named in both specs (a publisher allowed several tenants must say which one).

The same with gpuctl::

    SWEEP=$(gpuctl submit --array 0-7%4 -- python -c "import os; print(os.environ['GPUORCH_ARRAY_TASK_ID'])")
    gpuctl submit --dependency afterok:$SWEEP --wait -- python -c "print('evaluate')"
    gpuctl jobs --array $SWEEP
"""

from __future__ import annotations

import asyncio
import sys

from gpuorch_client import GpuorchClient
from gpuorch_contracts import JobQueued, JobRejected

TRAIN = "import os; lr = [1e-4, 3e-4, 1e-3, 3e-3][int(os.environ['GPUORCH_ARRAY_TASK_ID']) % 4]; print('lr', lr)"
SWEEP = {
    "name": "sweep", "tier": "batch", "array": {"indices": "0-7", "parallelism": 4}, "runtime_estimate_s": 30,
    "run": {"runtime": "process", "argv": ["python", "-c", TRAIN]},
}


def evaluation(sweep_id: str) -> dict[str, object]:
    return {"name": "evaluate", "tier": "batch", "depends_on": [{"condition": "afterok", "job_id": sweep_id}],
            "run": {"runtime": "process", "argv": ["python", "-c", "print('best of the sweep: evaluated')"]}}


def for_tenant(spec: dict[str, object], tenant: str) -> dict[str, object]:
    return spec if tenant == "default" else {**spec, "tenant": tenant}


async def main(url: str, tenant: str) -> int:
    async with GpuorchClient(url, tenant, producer="example/sweep") as client:
        sweep_id = await client.submit(for_tenant(SWEEP, tenant))
        if isinstance(answer := await client.wait(sweep_id), JobRejected):
            print(f"sweep rejected: {answer.reason}", file=sys.stderr)
            return 2
        print("sweep", sweep_id)
        evaluate_id = await client.submit(for_tenant(evaluation(str(sweep_id)), tenant))
        if isinstance(answer := await client.wait(evaluate_id), JobRejected):
            print(f"evaluation rejected: {answer.reason}", file=sys.stderr)
            return 2
        print("evaluate", evaluate_id)
        async for event in client.follow(evaluate_id, timeout_s=3600):
            print(event.TYPE, event.pending_reason if isinstance(event, JobQueued) else "")
            if event.TYPE in ("job.failed", "job.cancelled"):
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/",
                              sys.argv[2] if len(sys.argv) > 2 else "default")))
