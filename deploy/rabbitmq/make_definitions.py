"""Least-privilege RabbitMQ definitions for gpuorch: every user, its permissions and topic permissions.

    uv run python deploy/rabbitmq/make_definitions.py > deploy/rabbitmq/definitions.json      # compose: sim + gpu
    uv run python deploy/rabbitmq/make_definitions.py --gpu-node gpu-a --gpu-node gpu-b \
        --generate-passwords --output definitions.json --k8s-secrets secrets.yaml              # Kubernetes
    uv run python deploy/rabbitmq/make_definitions.py --executor executor-rack1=n1,n2 \
        --node-agent node-agent-rack1=node-agent.fleet.rack1:n1,n2 --passwords-from-env       # any layout

Pipeline::

    service topology (queue names, binding keys, routing keys: the same strings the entrypoints use)
        -> Grant per user (configure / write / read regexes + topic permissions per exchange)
        -> definitions JSON (users with salted SHA-256 hashes, vhost, permissions, topic_permissions)

RabbitMQ's rules (access-control guide, AMQP 0-9-1 table), which the regexes below follow exactly:

- ``exchange.declare`` / ``queue.declare`` (not passive): configure on the entity. Passive declares need nothing.
- ``exchange.declare`` with an alternate exchange: also write on the AE and read on the exchange being declared.
- ``queue.declare`` with ``x-dead-letter-exchange``: also write on the DLX and read on the queue.
- ``queue.bind``: write on the queue, read on the exchange; on a topic exchange the binding key must also match
  the user's topic *read* regex for that exchange, if the user has topic permissions there.
- ``basic.publish``: write on the exchange; on a topic exchange the routing key must also match the topic *write*
  regex, if the user has topic permissions for that exchange (none defined = every key allowed).
- ``basic.consume`` / ``basic.get``: read on the queue.
- Regexes match names only: an exchange and a queue with the same name (``gpuorch.unrouted``) share the rights.

What every ``gpuorch_messaging.Broker`` does on connect (and again per consumer channel), hence every service user
needs it: declare ``gpuorch.unrouted`` (fanout exchange and bounded queue) and bind them; declare the four topic
exchanges, ``gpuorch.events`` with ``gpuorch.unrouted`` as alternate exchange. For each consumer queue ``Q``:
declare ``Q.dlq`` and bind it to ``gpuorch.dlx`` with key ``Q``; declare ``Q`` with ``gpuorch.dlx`` as DLX; bind
``Q``; consume ``Q``; dead-letter invalid messages by publishing to ``gpuorch.dlx`` with key ``Q``.

Submitters (other systems, ``gpuctl-submit``) use no ``Broker``: they publish ``job.submit``/``job.cancel`` to the
existing ``gpuorch.submit`` (a passive declare at most), and read answers from their own queues
``client.<tenant>.<anything>``, which they may declare and bind to ``gpuorch.events`` only with keys of their own
tenants' job events (``job.*.<tenant>``, ``job.accepted.<tenant>`` ...): routing keys of job lifecycle events are
``<type>.<tenant>`` (gpuorch_contracts.routing). One submitter grant per identity of role ``submitter`` in
``deploy/identity.json``. ``gpuctl-operator`` lists and replays dead letters and may submit/cancel for any tenant;
it may not publish events or commands. No user but the scheduler may publish to ``gpuorch.commands``. Passwords: ``--passwords-from-env`` reads ``GPUORCH_RABBITMQ_PASSWORD_<USER>``
(upper case, ``-``/``.`` as ``_``) for every user; without it every password is ``<user>-dev`` (development only).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBMIT = "gpuorch.submit"
SUBMIT_SHARED = "gpuorch.submit.shared"
"""``gpuorch.submit``'s alternate exchange (fanout): the submissions' shared lane (queue ``scheduler.submit``)."""
EVENTS = "gpuorch.events"
COMMANDS = "gpuorch.commands"
DLX = "gpuorch.dlx"
UNROUTED = "gpuorch.unrouted"
TOPOLOGY_EXCHANGES = (SUBMIT, EVENTS, COMMANDS, DLX)

SCHEDULER_QUEUES = ("scheduler", "scheduler.heartbeats", "scheduler.submit")
SCHEDULER_LANES = r"scheduler\.submit\.[a-z0-9][a-z0-9_-]*"
"""The scheduler's per-tenant submission lanes ``scheduler.submit.<tenant>`` (one per tenant of the identity map or
the quotas, so a pattern rather than a list) and their ``.dlq``."""
IDENTITY_MAP = Path(__file__).resolve().parents[1] / "identity.json"
TENANT_ROUTED_EVENTS = (
    "job.accepted", "job.rejected", "job.queued", "job.placed", "job.started", "job.finished", "job.failed",
    "job.checkpointed", "job.lost", "job.preempting", "job.requeued", "job.cancelled",
)
"""Events routed ``<type>.<tenant>`` (gpuorch_contracts.TENANT_ROUTED_TYPES)."""
TENANT_WORD = r"[a-z0-9][a-z0-9_-]*"
HTTP_API_SUBMITTERS = ("submitter",)
"""Submitters that get the ``management`` tag (HTTP API): the generic user of examples/submit_job.sh."""
SCHEDULER_JOB_EVENTS = ("job.started", "job.finished", "job.failed", "job.lost", "job.checkpointed")
SCHEDULER_EVENT_BINDINGS = (
    *SCHEDULER_JOB_EVENTS, *(f"{e}.#" for e in SCHEDULER_JOB_EVENTS),  # bare keys: until the scheduler binds .#
    "node.registered", "gpu.health_changed", "node.heartbeat", "executor.heartbeat", "node.mig_layout_applied",
)
SCHEDULER_EVENTS = (
    "job.accepted", "job.rejected", "job.queued", "job.placed", "job.preempting", "job.requeued", "job.cancelled",
    "job.failed", "node.liveness_changed", "alert.fleet", "gpu.mig_reconfiguration", "mig.plan_proposed",
)
SCHEDULER_COMMANDS = ("launch_job", "stop_job", "apply_mig_layout")
EXECUTOR_COMMANDS = ("launch_job", "stop_job")
EXECUTOR_EVENTS = ("job.started", "job.finished", "job.failed", "job.lost", "job.checkpointed", "executor.heartbeat")
NODE_AGENT_COMMANDS = ("apply_mig_layout",)
NODE_AGENT_EVENTS = ("node.registered", "node.heartbeat", "gpu.health_changed", "gpu.usage_sampled",
                     "node.mig_layout_applied")
TELEMETRY_QUEUE = "telemetry.samples"
TELEMETRY_EVENT_BINDINGS = ("gpu.usage_sampled", "gpu.health_changed", "job.#", "mig.plan_proposed")
TELEMETRY_EVENTS = ("alert.raised", "alert.resolved", "recommendation.made", "fleet.scale_requested")
SUBMIT_KEYS = ("job.submit", "job.cancel")
SUBMIT_KEY_PATTERN = r"job\.(submit|cancel)"
NOTHING = "^$"


def exactly(names: Iterable[str]) -> str:
    """A regex matching exactly these names (escaped, anchored); ``^$`` (nothing) for none."""
    unique = sorted(set(names))
    if not unique:
        return NOTHING
    return "^(" + "|".join(re.escape(name) for name in unique) + ")$"


def event_keys(events: Iterable[str]) -> str:
    """A regex of these event routing keys, a job lifecycle event with or without its ``.<tenant>`` word."""
    parts = sorted(re.escape(e) + (rf"(\.{TENANT_WORD})?" if e in TENANT_ROUTED_EVENTS else "")
                   for e in set(events))
    return "^(" + "|".join(parts) + ")$" if parts else NOTHING


def command_keys(node_ids: Iterable[str], commands: Iterable[str]) -> list[str]:
    return [f"node.{node}.{command}" for node in node_ids for command in commands]


@dataclass(frozen=True)
class Grant:
    """One user's rights in the vhost: resource regexes plus topic regexes per topic exchange (write, read)."""

    user: str
    configure: str
    write: str
    read: str
    topics: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    purpose: str = ""


def broker_user(user: str, *, queues: Sequence[str], bindings: Mapping[str, Sequence[str]],
                publishes: Mapping[str, Sequence[str]], key_patterns: Mapping[str, str] | None = None,
                binding_patterns: Mapping[str, str] | None = None, queue_pattern: str | None = None,
                purpose: str) -> Grant:
    """A service that connects with ``gpuorch_messaging.Broker``, owns ``queues`` and publishes ``publishes``.

    ``bindings``: exchange -> binding keys of its queues; ``publishes``: exchange -> routing keys it publishes
    (``key_patterns`` / ``binding_patterns`` replace a list by a regex where the keys cannot be listed, e.g.
    every node id or tenant; ``queue_pattern`` adds queues named by a regex, each with its ``.dlq``). Topic
    permissions pin every topic exchange it touches to exactly those keys (dead letters: its queue names);
    exchanges it may neither write nor read get none (the resource permissions refuse them already). Declaring
    ``gpuorch.events`` and ``gpuorch.submit`` with their alternate exchanges needs write on the alternates and
    read on the exchanges themselves.
    """
    dead_letter_queues = [f"{q}.dlq" for q in queues]
    own = [*queues, *dead_letter_queues]

    def with_pattern(names: list[str], *, dlq: bool = True) -> str:
        listed = exactly(names)
        if queue_pattern is None:
            return listed
        extra = rf"{queue_pattern}(\.dlq)?" if dlq else queue_pattern
        return listed[:-2] + "|" + extra + ")$"

    configure = with_pattern([*TOPOLOGY_EXCHANGES, UNROUTED, SUBMIT_SHARED, *own])
    write = with_pattern([UNROUTED, SUBMIT_SHARED, DLX, *own, *publishes])
    read = with_pattern([UNROUTED, EVENTS, SUBMIT, DLX, *queues, *bindings], dlq=False)
    topics: dict[str, tuple[str, str]] = {}
    for exchange in TOPOLOGY_EXCHANGES:
        written = list(publishes.get(exchange, ()))
        bound = list(bindings.get(exchange, ()))
        if exchange == DLX:
            written, bound = list(queues), list(queues)
        pattern = (key_patterns or {}).get(exchange)
        bound_pattern = (binding_patterns or {}).get(exchange)
        if exchange == DLX and queue_pattern is not None:
            pattern = bound_pattern = with_pattern(list(queues), dlq=False)
        if written or bound or pattern or bound_pattern:
            topics[exchange] = (pattern or exactly(written), bound_pattern or exactly(bound))
    return Grant(user, configure, write, read, topics, purpose=purpose)


def scheduler(user: str = "scheduler") -> Grant:
    """The scheduler addresses every node: launch/stop and MIG layout commands for ``node.<any node id>``."""
    any_node = r"^node\..+\.(" + "|".join(re.escape(c) for c in SCHEDULER_COMMANDS) + r")$"
    return broker_user(
        user, queues=SCHEDULER_QUEUES,
        bindings={SUBMIT: SUBMIT_KEYS, EVENTS: SCHEDULER_EVENT_BINDINGS, SUBMIT_SHARED: ("",)},
        publishes={EVENTS: SCHEDULER_EVENTS, COMMANDS: ()},
        key_patterns={COMMANDS: any_node, EVENTS: event_keys(SCHEDULER_EVENTS)},
        binding_patterns={SUBMIT: rf"^{SUBMIT_KEY_PATTERN}(\.{TENANT_WORD})?$"},  # lanes; unbinding the bare keys
        queue_pattern=SCHEDULER_LANES,
        purpose="consumes scheduler, scheduler.heartbeats and the submission lanes scheduler.submit[.<tenant>]; "
                "publishes job decisions, launch/stop commands and MIG layouts",
    )


def executor(user: str, node_ids: Sequence[str]) -> Grant:
    """One executor process serving ``node_ids`` (queues ``executor.<node id>``)."""
    return broker_user(
        user, queues=[f"executor.{n}" for n in node_ids],
        bindings={COMMANDS: command_keys(node_ids, EXECUTOR_COMMANDS)},
        publishes={EVENTS: EXECUTOR_EVENTS}, key_patterns={EVENTS: event_keys(EXECUTOR_EVENTS)},
        purpose=f"consumes executor.<node> for {', '.join(node_ids)}; publishes job.started/finished/failed/lost/checkpointed",
    )


def node_agent(user: str, queue: str, node_ids: Sequence[str]) -> Grant:
    """One node-agent process: queue ``node-agent.<node id>`` (single node) or ``node-agent.fleet.<fleet>``."""
    return broker_user(
        user, queues=[queue], bindings={COMMANDS: command_keys(node_ids, NODE_AGENT_COMMANDS)},
        publishes={EVENTS: NODE_AGENT_EVENTS},
        purpose=f"consumes {queue} (MIG layouts for {', '.join(node_ids)}); publishes node.registered/heartbeat, gpu.*",
    )


def telemetry(user: str = "telemetry") -> Grant:
    return broker_user(
        user, queues=[TELEMETRY_QUEUE], bindings={EVENTS: TELEMETRY_EVENT_BINDINGS},
        publishes={EVENTS: TELEMETRY_EVENTS},
        purpose="consumes telemetry.samples (competing consumers); publishes alert.raised/resolved, recommendation.made, fleet.scale_requested",
    )


def submitter(user: str = "submitter", tenants: Sequence[str] = ("default",), *, http_api: bool = False) -> Grant:
    """Other systems (and ``gpuctl-submit``): publish ``job.submit`` / ``job.cancel`` to ``gpuorch.submit``, with
    or without one of their own tenants as last word (``job.submit.<tenant>``: that tenant's lane; no other
    tenant's lane);
    declare, bind and read queues ``client.<tenant>.*`` bound to their tenants' job events only.

    ``http_api`` adds the ``management`` tag: the user may then do the same through RabbitMQ's HTTP API (what
    examples/submit_job.sh uses: AMQP command-line clients cannot set ``user_id``). It also lets the user list the
    vhost's queue and exchange names, so it is given only to users that need it (``HTTP_API_SUBMITTERS``)."""
    for tenant in tenants:
        if not re.fullmatch(TENANT_WORD, tenant):
            raise ValueError(f"not a tenant name: {tenant!r}")
    alternatives = "|".join(sorted(set(tenants)))
    own_queues = rf"client\.({alternatives})\..+"
    return Grant(user, configure=f"^{own_queues}$", write=rf"^(gpuorch\.submit|{own_queues})$",
                 read=rf"^(gpuorch\.events|{own_queues})$",
                 topics={SUBMIT: (rf"^{SUBMIT_KEY_PATTERN}(\.({alternatives}))?$", NOTHING),
                         EVENTS: (NOTHING, rf"^job\.(\*|[a-z_]+)\.({alternatives})$")},
                 tags=("management",) if http_api else (),
                 purpose=f"publishes job.submit/job.cancel; reads its own queues client.<tenant>.* bound to "
                         f"job.*.<tenant> for {', '.join(sorted(set(tenants)))}")


def operator(user: str = "gpuctl-operator") -> Grant:
    """``gpuctl-operator``: submit/cancel (any tenant: the identity map says so), list dead letters (basic.get on
    ``*.dlq``) and replay dead submissions. It may not publish events or commands: a replayed event or command
    would carry the operator's user_id and be refused by its consumer anyway."""
    return Grant(
        user, configure=exactly([*TOPOLOGY_EXCHANGES, UNROUTED, SUBMIT_SHARED]),
        write=exactly([SUBMIT, UNROUTED, SUBMIT_SHARED]),
        read=r"^(gpuorch\.events|gpuorch\.submit|gpuorch\.unrouted|.+\.dlq)$",
        topics={SUBMIT: (rf"^{SUBMIT_KEY_PATTERN}(\.{TENANT_WORD})?$", NOTHING)},
        purpose="gpuctl operator: submit/cancel for any tenant, dlq list and replay of submissions",
    )


API_STREAM_QUEUES = r"api\.(live|nodes)\.[0-9a-f]+"
"""The API's own queues (exclusive, auto-delete): one per open event stream, one per instance for the executors'
heartbeats (where each node serves its jobs' logs)."""
API_EVENT_BINDINGS = (r"job\.#", rf"job\.\*\.{TENANT_WORD}", r"alert\.#", r"recommendation\.#",
                      r"node\.liveness_changed", r"gpu\.health_changed", r"executor\.heartbeat")


def api(user: str = "api") -> Grant:
    """The API service (a ``gateway`` in the identity map): publishes ``job.submit``/``job.cancel`` for any tenant
    on behalf of the callers it authenticated (the scheduler honours ``on_behalf_of`` from a gateway only), and
    declares one exclusive queue ``api.live.<hex>`` per live event stream, bound to job events (all tenants, or
    ``job.*.<tenant>``), alerts, recommendations, node liveness and GPU health; it filters by tenant itself. It
    declares no exchange (``Broker(declare_topology=False)``) and may not publish events or commands."""
    return Grant(
        user, configure=f"^{API_STREAM_QUEUES}$", write=rf"^(gpuorch\.submit|{API_STREAM_QUEUES})$",
        read=rf"^(gpuorch\.events|{API_STREAM_QUEUES})$",
        topics={SUBMIT: (rf"^{SUBMIT_KEY_PATTERN}(\.{TENANT_WORD})?$", NOTHING),
                EVENTS: (NOTHING, "^(" + "|".join(API_EVENT_BINDINGS) + ")$")},
        purpose="the HTTP API: submit/cancel on behalf of token holders; live event streams api.live.*",
    )


def submitters_of(identity_map: Path = IDENTITY_MAP) -> list[Grant]:
    """One submitter grant per identity of role ``submitter`` in the identity map (its tenants)."""
    document = json.loads(identity_map.read_text(encoding="utf-8"))
    return [submitter(user, identity.get("tenants", []), http_api=user in HTTP_API_SUBMITTERS)
            for user, identity in sorted(document.get("identities", {}).items())
            if identity.get("role") == "submitter" and user != "*"]


def administrator(user: str = "admin") -> Grant:
    return Grant(user, ".*", ".*", ".*", tags=("administrator",),
                 purpose="people: management UI and rabbitmqctl; no service uses it")


@dataclass(frozen=True)
class Fleet:
    """Which executor and node-agent users exist: (user, node ids) and (user, queue, node ids)."""

    executors: Sequence[tuple[str, Sequence[str]]]
    node_agents: Sequence[tuple[str, str, Sequence[str]]]


COMPOSE_NODES = ("sim-00000", "sim-00001", "sim-00002")
COMPOSE_GPU_NODE = "gpu-node-1"
"""The machine itself, as one real GPU node (compose profile ``gpu``)."""
COMPOSE_FLEET = Fleet(
    executors=[("executor-sim", COMPOSE_NODES), (f"executor-{COMPOSE_GPU_NODE}", (COMPOSE_GPU_NODE,))],
    node_agents=[("node-agent-sim", "node-agent.fleet.sim", COMPOSE_NODES),
                 (f"node-agent-{COMPOSE_GPU_NODE}", f"node-agent.{COMPOSE_GPU_NODE}", (COMPOSE_GPU_NODE,))],
)


def grants(fleet: Fleet = COMPOSE_FLEET) -> list[Grant]:
    return [
        administrator(), scheduler(), telemetry(), operator(), api(), *submitters_of(),
        *(executor(user, nodes) for user, nodes in fleet.executors),
        *(node_agent(user, queue, nodes) for user, queue, nodes in fleet.node_agents),
    ]


def password_hash(user: str, password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password)), 4-byte salt.

    The salt is derived from user and password so the same inputs give the same file (reviewable diffs).
    """
    salt = hashlib.sha256(f"gpuorch:{user}:{password}".encode()).digest()[:4]
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def password_variable(user: str) -> str:
    return "GPUORCH_RABBITMQ_PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()


def dev_password(user: str) -> str:
    return f"{user}-dev"


def definitions(all_grants: Sequence[Grant], vhost: str = "gpuorch",
                passwords: Mapping[str, str] | None = None) -> dict[str, object]:
    """The definitions document (``load_definitions`` / ``POST /api/definitions``) for ``all_grants``."""
    passwords = passwords or {}
    users, permissions, topic_permissions = [], [], []
    for grant in all_grants:
        password = passwords.get(grant.user, dev_password(grant.user))
        users.append({"name": grant.user, "password_hash": password_hash(grant.user, password),
                      "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": list(grant.tags)})
        permissions.append({"user": grant.user, "vhost": vhost, "configure": grant.configure,
                            "write": grant.write, "read": grant.read})
        for exchange, (write, read) in sorted(grant.topics.items()):
            topic_permissions.append({"user": grant.user, "vhost": vhost, "exchange": exchange,
                                      "write": write, "read": read})
    return {
        "users": users, "vhosts": [{"name": vhost}], "permissions": permissions,
        "topic_permissions": topic_permissions, "parameters": [], "global_parameters": [], "policies": [],
        "queues": [], "exchanges": [], "bindings": [],
    }


def _parse_executor(text: str) -> tuple[str, list[str]]:
    user, _, nodes = text.partition("=")
    if not user or not nodes:
        raise argparse.ArgumentTypeError("expected USER=NODE[,NODE...]")
    return user, [n for n in nodes.split(",") if n]


def _parse_node_agent(text: str) -> tuple[str, str, list[str]]:
    user, _, rest = text.partition("=")
    queue, _, nodes = rest.partition(":")
    if not user or not queue or not nodes:
        raise argparse.ArgumentTypeError("expected USER=QUEUE:NODE[,NODE...]")
    return user, queue, [n for n in nodes.split(",") if n]


def kubernetes_secrets(all_grants: Sequence[Grant], passwords: Mapping[str, str], *, vhost: str,
                       amqp_host: str, amqp_port: int, node_users: Iterable[str]) -> str:
    """Secrets ``gpuorch-amqp`` (URL per cluster-wide user) and ``gpuorch-node-credentials`` (password per
    per-node user), as deploy/k8s reads them, as a YAML stream (keys and values JSON-quoted)."""
    per_node = set(node_users)
    urls = {g.user: f"amqp://{g.user}:{passwords[g.user]}@{amqp_host}:{amqp_port}/{vhost}"
            for g in all_grants if g.user not in per_node}
    node_passwords = {g.user: passwords[g.user] for g in all_grants if g.user in per_node}
    documents = []
    for name, data in (("gpuorch-amqp", urls), ("gpuorch-node-credentials", node_passwords)):
        lines = ["apiVersion: v1", "kind: Secret", "metadata:", f"  name: {name}", "type: Opaque", "stringData:"]
        lines += [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()] or ["  {}"]
        documents.append("\n".join(lines) + "\n")
    return "---\n".join(documents)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--vhost", default="gpuorch")
    parser.add_argument("--executor", action="append", type=_parse_executor, default=[],
                        metavar="USER=NODE[,NODE...]", help="an executor user and the node ids it serves (repeatable)")
    parser.add_argument("--node-agent", action="append", type=_parse_node_agent, default=[],
                        metavar="USER=QUEUE:NODE[,NODE...]", help="a node-agent user, its queue and nodes (repeatable)")
    parser.add_argument("--gpu-node", action="append", default=[], metavar="NODE",
                        help="one GPU node run by the DaemonSets: users executor-NODE (queue executor.NODE) and "
                             "node-agent-NODE (queue node-agent.NODE) (repeatable)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--passwords-from-env", action="store_true",
                        help="read every password from GPUORCH_RABBITMQ_PASSWORD_<USER> (all must be set)")
    source.add_argument("--generate-passwords", action="store_true",
                        help="a random URL-safe password per user (use with --k8s-secrets to keep them)")
    parser.add_argument("--k8s-secrets", metavar="PATH",
                        help="also write Secrets gpuorch-amqp and gpuorch-node-credentials with these passwords")
    parser.add_argument("--amqp-host", default="gpuorch-rabbitmq", help="broker host in the Secrets' URLs")
    parser.add_argument("--amqp-port", type=int, default=5672)
    parser.add_argument("--output", metavar="PATH", help="write the definitions here instead of stdout")
    args = parser.parse_args(argv)
    executors = [*args.executor, *((f"executor-{n}", [n]) for n in args.gpu_node)]
    agents = [*args.node_agent, *((f"node-agent-{n}", f"node-agent.{n}", [n]) for n in args.gpu_node)]
    fleet = Fleet(executors, agents) if (executors or agents) else COMPOSE_FLEET
    all_grants = grants(fleet)
    passwords = {g.user: dev_password(g.user) for g in all_grants}
    if args.passwords_from_env:
        missing = [password_variable(g.user) for g in all_grants if password_variable(g.user) not in os.environ]
        if missing:
            parser.error("missing " + ", ".join(missing))
        passwords = {g.user: os.environ[password_variable(g.user)] for g in all_grants}
    elif args.generate_passwords:
        passwords = {g.user: secrets.token_hex(24) for g in all_grants}
    document = json.dumps(definitions(all_grants, args.vhost, passwords), indent=2) + "\n"
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(document)
    else:
        sys.stdout.write(document)
    if args.k8s_secrets:
        node_users = [user for user, _ in executors] + [user for user, _, _ in agents]
        with open(args.k8s_secrets, "w", encoding="utf-8") as fh:
            fh.write(kubernetes_secrets(all_grants, passwords, vhost=args.vhost, amqp_host=args.amqp_host,
                                        amqp_port=args.amqp_port, node_users=node_users))


if __name__ == "__main__":
    main()
