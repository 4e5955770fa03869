"""Submit a job from Python with the typed client, wait for the answer and follow the job to its end.

    uv run python examples/submit_job.py amqp://guest:guest@127.0.0.1:5672/gpuorch-demo default

with the URL `gpuctl demo` prints ("other systems publish to: ..."; a `--keep` stack keeps it in var/demo/stack.json);
against an installation, a submitter broker user of its own: amqp://USER:PASSWORD@HOST:5672/VHOST TENANT.

``gpuorch_client`` binds its own queue to the tenant's job events (``job.*.<tenant>``) before publishing, publishes
the SubmitJob with confirms, ``mandatory`` and ``user_id``, then waits. Exit status: 0 the job finished,
1 it failed or was cancelled, 2 rejected, 3 refused by the broker (NO_ROUTE). ``tenant`` is omitted from the spec:
the publisher's default tenant (deploy/identity.json) applies.
"""

from __future__ import annotations

import asyncio
import sys

from gpuorch_client import GpuorchClient, SubmissionRefused
from gpuorch_contracts import JobRejected

SPEC = {
    "name": "hello-from-python", "tier": "inference", "resources": {"gpu_milli": 250},
    "run": {"runtime": "process", "argv": ["python", "-c", "print('hello from a GPU share')"]},
}


async def main(url: str, tenant: str) -> int:
    try:
        async with GpuorchClient(url, tenant, producer="example/python") as client:
            job_id = await client.submit(SPEC)
            print(job_id)
            answer = await client.wait(job_id)
            print(answer.TYPE)
            if isinstance(answer, JobRejected):
                print(f"rejected: {answer.reason}", file=sys.stderr)
                return 2
            async for event in client.follow(job_id, timeout_s=3600):
                print(event.TYPE)
                if event.TYPE in ("job.failed", "job.cancelled"):
                    return 1
    except SubmissionRefused as exc:
        print(f"refused by the broker: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/",
                              sys.argv[2] if len(sys.argv) > 2 else "default")))
