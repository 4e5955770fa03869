"""Submit a job from any Python program with plain aio-pika (no gpuorch packages needed).

    python examples/submit_job.py amqp://guest:guest@127.0.0.1:5672/

Publishes one SubmitJob to exchange ``gpuorch.submit``, routing key ``job.submit``, with publisher confirms and
``mandatory`` (an unroutable message raises instead of vanishing). Prints the job id.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from datetime import UTC, datetime

import aio_pika


async def main(url: str) -> None:
    job_id = str(uuid.uuid4())
    message = {
        "type": "job.submit", "schema_version": 1, "message_id": str(uuid.uuid4()),
        "occurred_at": datetime.now(UTC).isoformat(), "producer": "example/python",
        "job_id": job_id,
        "spec": {
            "name": "hello-from-python", "tenant": "default", "tier": "inference",
            "resources": {"gpu_milli": 250},
            "run": {"runtime": "process", "argv": ["python", "-c", "print('hello from a GPU share')"]},
        },
    }
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(
            aio_pika.Message(json.dumps(message).encode(), content_type="application/json",
                             message_id=message["message_id"], delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key="job.submit", mandatory=True,
        )
    finally:
        await connection.close()
    print(job_id)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/"))
