"""``python -m gpuorch_client URL TENANT SPEC.json [--timeout S]``: submit, wait for the answer, exit by it.

Exit status: 0 accepted, 2 rejected (the reason on stderr), 3 refused by the broker (NO_ROUTE, nack, permissions),
4 no answer within the timeout. Prints the job id first, then the answer's type.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import aiormq.exceptions
from gpuorch_contracts import JobRejected, SubmissionRejected

from gpuorch_client import GpuorchClient, SubmissionRefused


async def run(url: str, tenant: str, spec: dict[str, object], timeout_s: float) -> int:
    try:
        async with GpuorchClient(url, tenant) as client:
            job_id = await client.submit(spec)
            print(job_id, flush=True)
            answer = await client.wait(job_id, timeout_s=timeout_s)
    except SubmissionRefused as exc:
        print(f"refused by the broker: {exc}", file=sys.stderr)
        return 3
    except aiormq.exceptions.ChannelAccessRefused as exc:
        print(f"refused by the broker (permissions): {exc}", file=sys.stderr)
        return 3
    except TimeoutError:
        print(f"no answer within {timeout_s}s", file=sys.stderr)
        return 4
    print(answer.TYPE)
    if isinstance(answer, JobRejected | SubmissionRejected):
        print(f"rejected: {answer.reason}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuorch_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="amqp://user:password@host:5672/vhost (a submitter user)")
    parser.add_argument("tenant", help="the tenant whose events this user may read")
    parser.add_argument("spec", type=Path, help="the job spec (JSON); 'tenant' may be omitted")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text(encoding="utf-8"))
    return asyncio.run(run(args.url, args.tenant, spec, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
