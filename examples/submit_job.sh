#!/usr/bin/env bash
# Submit a job without Python, and wait for gpuorch's answer: curl + jq through RabbitMQ's HTTP API.
#
#   examples/submit_job.sh [HTTP_API_URL] [VHOST] [TENANT] [SPEC_JSON_FILE]
#   examples/submit_job.sh http://submitter:submitter-dev@127.0.0.1:15672 gpuorch default
#
# Why the HTTP API and not amqp-publish: amqp-publish cannot set the AMQP user_id property, which gpuorch's
# consumers require (the broker checks it against the authenticated user), nor tell whether the message was routed.
# The HTTP API does both. The broker user needs the "management" tag (deploy/rabbitmq: the `submitter` user).
#
# Steps: declare an own queue client.<tenant>.<random> bound to job.*.<tenant> (the only binding a submitter may
# make), publish the SubmitJob with user_id = the user, then read the queue until job.accepted / job.rejected for
# this job id arrives. Prints the job id, then the answer's type (and the reason on stderr).
# Exit status: 0 accepted, 2 rejected, 3 refused by the broker (NO_ROUTE: nothing takes job.submit; or an HTTP
# error such as a permission refused), 4 no answer within GPUORCH_TIMEOUT_S (default 60).
set -euo pipefail

api=${1:-${GPUORCH_HTTP_URL:-http://submitter:submitter-dev@127.0.0.1:15672}}
vhost=${2:-${GPUORCH_VHOST:-gpuorch}}
tenant=${3:-${GPUORCH_TENANT:-default}}
spec_file=${4:-}
timeout_s=${GPUORCH_TIMEOUT_S:-60}

scheme=${api%%://*}
rest=${api#*://}
credentials=${rest%%@*}
user=${credentials%%:*}
base="$scheme://${rest#*@}"
base=${base%/}
v=$(jq -rn --arg v "$vhost" '$v|@uri')

call() {  # curl with the user's credentials; on an HTTP error prints the broker's reason and exits 3
  local out
  if ! out=$(curl -sS --fail-with-body -u "$credentials" -H 'content-type: application/json' "$@"); then
    echo "refused by the broker: ${out:-no answer from $base}" >&2
    exit 3
  fi
  printf '%s' "$out"
}

uuid() { cat /proc/sys/kernel/random/uuid; }

job_id=$(uuid)
message_id=$(uuid)
queue="client.$tenant.$(uuid)"
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
if [[ -n "$spec_file" ]]; then
  spec=$(jq -c . "$spec_file")
else  # "tenant" is omitted: the publisher's default tenant applies (deploy/identity.json)
  spec='{"name": "hello-from-shell", "resources": {"gpus": 1},
         "run": {"runtime": "process", "argv": ["python3", "-c", "print(\"hello from a whole GPU\")"]}}'
fi
body=$(jq -cn --arg job_id "$job_id" --arg message_id "$message_id" --arg now "$now" --argjson spec "$spec" \
  '{type: "job.submit", schema_version: 1, message_id: $message_id, occurred_at: $now,
    producer: "example/shell", job_id: $job_id, spec: $spec}')

# 1. the answer queue first, so no answer can be missed (expires if this script dies before deleting it)
call -X PUT -d '{"durable": false, "auto_delete": false, "arguments": {"x-expires": 600000}}' \
  "$base/api/queues/$v/$queue" >/dev/null
trap 'curl -sS -o /dev/null -u "$credentials" -X DELETE "$base/api/queues/$v/$queue" || true' EXIT
call -X POST -d "$(jq -cn --arg key "job.*.$tenant" '{routing_key: $key}')" \
  "$base/api/bindings/$v/e/gpuorch.events/q/$queue" >/dev/null

# 2. publish with user_id (the broker refuses any other than ours) and learn whether anything took it
request=$(jq -cn --arg body "$body" --arg user "$user" --arg message_id "$message_id" \
  '{routing_key: "job.submit", payload: $body, payload_encoding: "string",
    properties: {user_id: $user, message_id: $message_id, content_type: "application/json", delivery_mode: 2}}')
routed=$(call -X POST -d "$request" "$base/api/exchanges/$v/gpuorch.submit/publish" | jq -r .routed)
if [[ "$routed" != "true" ]]; then
  echo "refused by the broker: NO_ROUTE (no queue takes job.submit: is gpuorch's scheduler running?)" >&2
  exit 3
fi
echo "$job_id"

# 3. wait for the answer to this job
deadline=$(( $(date +%s) + timeout_s ))
while (( $(date +%s) < deadline )); do
  answer=$(call -X POST -d '{"count": 50, "ackmode": "ack_requeue_false", "encoding": "auto"}' \
      "$base/api/queues/$v/$queue/get" |
    jq -c --arg job_id "$job_id" '[.[] | .payload | fromjson? | select(.job_id == $job_id)
                                   | select(.type == "job.accepted" or .type == "job.rejected")] | first // empty')
  if [[ -n "$answer" ]]; then
    type=$(jq -r .type <<<"$answer")
    echo "$type"
    if [[ "$type" == "job.rejected" ]]; then
      echo "rejected: $(jq -r .reason <<<"$answer")" >&2
      exit 2
    fi
    exit 0
  fi
  sleep 0.5
done
echo "no answer within ${timeout_s}s" >&2
exit 4
