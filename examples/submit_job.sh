#!/usr/bin/env bash
# Submit a job without Python, with amqp-publish (Debian/Ubuntu package amqp-tools, a C client).
#   examples/submit_job.sh [amqp://guest:guest@127.0.0.1:5672/]
# Prints the job id. The body is the documented SubmitJob message (libs/contracts/schemas/job.submit.schema.json).
set -euo pipefail
url=${1:-amqp://guest:guest@127.0.0.1:5672/}
job_id=$(cat /proc/sys/kernel/random/uuid)
message_id=$(cat /proc/sys/kernel/random/uuid)
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
body=$(cat <<JSON
{"type": "job.submit", "schema_version": 1, "message_id": "$message_id", "occurred_at": "$now",
 "producer": "example/shell", "job_id": "$job_id",
 "spec": {"name": "hello-from-shell", "resources": {"gpus": 1},
          "run": {"runtime": "process", "argv": ["python3", "-c", "print('hello from a whole GPU')"]}}}
JSON
)
amqp-publish --url="$url" --exchange=gpuorch.submit --routing-key=job.submit \
  --content-type=application/json --persistent --body="$body"
echo "$job_id"
