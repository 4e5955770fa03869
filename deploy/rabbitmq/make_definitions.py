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

- ``exchange.declare`` / ``queue.declare`` / ``*.delete`` (not passive): configure on the entity. Passive declares
  need nothing.
- ``exchange.declare`` with an alternate exchange: also write on the AE and read on the exchange being declared.
- ``queue.declare`` with ``x-dead-letter-exchange``: also write on the DLX and read on the queue.
- ``queue.bind`` / ``queue.unbind``: write on the queue, read on the exchange; on a topic exchange the binding key
  must also match the user's topic *read* regex for that exchange, if the user has topic permissions there.
- ``basic.publish``: write on the exchange; on a topic exchange the routing key must also match the topic *write*
  regex, if the user has topic permissions for that exchange (none defined = every key allowed).
- ``basic.consume`` / ``basic.get``: read on the queue.
- Regexes match names only: an exchange and a queue with the same name (``gpuorch.unrouted``) share the rights.

Rights by function (decision 39): the topology (exchanges, every gpuorch queue and its ``.dlq``, their bindings) is
declared once by the setup identity: RabbitMQ's own import of this document at boot (``exchanges``, ``queues``,
``bindings`` below, generated from ``gpuorch_messaging.queues.Installation``, the catalogue the services consume
from) or ``gpuctl setup broker`` as ``gpuorch-setup``. A runtime service user (scheduler, telemetry,
executor-<node>, node-agent-<node>) has **no configure right**, **no write on any queue** (so it cannot bind) and
**no read on any exchange**: it writes only to the exchanges it publishes to, each pinned by an anchored topic
regex to its own routing keys (its dead letters: ``gpuorch.dlx`` with its own queue names), and reads only its own
queues. Every topic exchange carries a topic permission for every runtime user (``^$`` where it may do nothing),
so a key can never fall through to "no topic permission = any key". Its services run with
``GPUORCH_BROKER_TOPOLOGY=passive`` (the default) and look their names up.

Submitters (other systems, ``gpuctl-submit``) use no ``Broker``: they publish ``job.submit``/``job.cancel`` to the
existing ``gpuorch.submit`` (a passive declare at most), and read answers from their own queues
``client.<tenant>.<anything>``, which they may declare and bind to ``gpuorch.events`` only with keys of their own
tenants' job events (``job.*.<tenant>``, ``job.accepted.<tenant>`` ...): routing keys of job lifecycle events are
``<type>.<tenant>`` (gpuorch_contracts.routing). The API likewise declares only its own exclusive stream queues
``api.live.*``/``api.nodes.*``. One submitter grant per identity of role ``submitter`` in ``deploy/identity.json``.
``gpuctl-operator`` lists and replays dead letters and may submit/cancel for any tenant; it may not publish events
or commands (a replay carries the first publisher's identity, ``gpuorch_messaging.provenance``). No user but the
scheduler may publish to ``gpuorch.commands``. Passwords: ``--passwords-from-env`` reads
``GPUORCH_RABBITMQ_PASSWORD_<USER>`` (upper case, ``-``/``.`` as ``_``) for every user; without it every password is
``<user>-dev`` (development only).
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
from typing import Any

from gpuorch_identity import load_identity_map
from gpuorch_messaging.queues import (
    HEARTBEAT_QUEUE,
    SCHEDULER_QUEUE,
    SUBMIT_QUEUE,
    TELEMETRY_QUEUE,
    Installation,
)
from gpuorch_messaging.topology import (
    BOUNDED_QUEUES_POLICY,
    EXCHANGE_ARGUMENTS,
    FANOUT_EXCHANGES,
    unrouted_arguments,
)

SUBMIT = "gpuorch.submit"
SUBMIT_SHARED = "gpuorch.submit.shared"
"""``gpuorch.submit``'s alternate exchange (fanout): the submissions' shared lane (queue ``scheduler.submit``)."""
EVENTS = "gpuorch.events"
COMMANDS = "gpuorch.commands"
DLX = "gpuorch.dlx"
UNROUTED = "gpuorch.unrouted"
TOPOLOGY_EXCHANGES = (SUBMIT, EVENTS, COMMANDS, DLX)

SCHEDULER_QUEUES = (SCHEDULER_QUEUE, HEARTBEAT_QUEUE, SUBMIT_QUEUE)
SCHEDULER_LANES = r"scheduler\.submit\.[a-z0-9][a-z0-9_-]*"
"""The scheduler's per-tenant submission lanes ``scheduler.submit.<tenant>`` (one per tenant of the identity map or
the quotas, so a pattern rather than a list) and their ``.dlq``."""
IDENTITY_MAP = Path(__file__).resolve().parents[1] / "identity.json"
TENANT_ROUTED_EVENTS = (
    "job.accepted", "job.rejected", "job.queued", "job.placed", "job.started", "job.finished", "job.failed",
    "job.checkpointed", "job.lost", "job.preempting", "job.requeued", "job.cancelled", "job.array_parallelism_changed",
    "job.priority_changed",
    "job.submission_rejected",
)
"""Events routed ``<type>.<tenant>`` (gpuorch_contracts.TENANT_ROUTED_TYPES)."""
TENANT_WORD = r"[a-z0-9][a-z0-9_-]*"
HTTP_API_SUBMITTERS = ("submitter",)
"""Submitters that get the ``management`` tag (HTTP API): the generic user of examples/submit_job.sh."""
SCHEDULER_EVENTS = (
    "job.accepted", "job.rejected", "job.submission_rejected", "job.queued", "job.placed", "job.preempting", "job.requeued", "job.cancelled",
    "job.array_parallelism_changed", "job.priority_changed", "job.failed", "node.liveness_changed", "alert.fleet", "gpu.mig_reconfiguration", "mig.plan_proposed",
    "reservation.created", "reservation.refused", "reservation.deleted",
)
SCHEDULER_COMMANDS = ("launch_job", "stop_job", "apply_mig_layout")
EXECUTOR_EVENTS = ("job.started", "job.finished", "job.failed", "job.lost", "job.checkpointed", "executor.heartbeat")
NODE_AGENT_EVENTS = ("node.registered", "node.heartbeat", "gpu.health_changed", "gpu.usage_sampled",
                     "node.mig_layout_applied")
TELEMETRY_EVENTS = ("alert.raised", "alert.resolved", "recommendation.made", "fleet.scale_requested")
SUBMIT_KEY_PATTERN = r"job\.(submit|cancel|array_set|session)"
OPERATOR_KEY_PATTERN = r"(job\.(submit|cancel|array_set|session|priority_set)|reservation\.(create|delete))"
"""What an operator (and the API on its behalf) may publish on ``gpuorch.submit``: a submitter's keys, priority
changes and the reservation commands (the scheduler takes those from operators only)."""
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


def broker_user(user: str, *, queues: Sequence[str], publishes: Mapping[str, Sequence[str]],
                key_patterns: Mapping[str, str] | None = None, queue_pattern: str | None = None,
                purpose: str) -> Grant:
    """A runtime service user (``gpuorch_messaging.Broker`` with ``declare_topology=False``): consumes ``queues``
    (and the queues ``queue_pattern`` names) and publishes ``publishes`` (exchange -> routing keys; ``key_patterns``
    replaces a list by a regex where keys cannot be listed, e.g. every node id).

    configure: nothing. write: the exchanges it publishes to and ``gpuorch.dlx`` (its dead letters), never a queue
    (no bind). read: its own queues only (no exchange: no bind). Topic permissions on every topic exchange: write
    its own keys (on ``gpuorch.dlx`` its own queue names), read (binding keys) nothing.
    """
    def with_pattern(names: Sequence[str]) -> str:
        listed = exactly(names)
        if queue_pattern is None:
            return listed
        return (listed[:-2] + "|" if listed != NOTHING else "^(") + queue_pattern + ")$"

    published = [exchange for exchange in TOPOLOGY_EXCHANGES
                 if publishes.get(exchange) or (key_patterns or {}).get(exchange)]
    topics: dict[str, tuple[str, str]] = {}
    for exchange in TOPOLOGY_EXCHANGES:
        written = (key_patterns or {}).get(exchange) or exactly(publishes.get(exchange, ()))
        if exchange == DLX:
            written = with_pattern(queues)
        topics[exchange] = (written, NOTHING)
    return Grant(user, configure=NOTHING, write=exactly([*published, DLX]), read=with_pattern(queues),
                 topics=topics, purpose=purpose)


def scheduler(user: str = "scheduler") -> Grant:
    """The scheduler addresses every node: launch/stop and MIG layout commands for ``node.<any node id>``."""
    any_node = r"^node\..+\.(" + "|".join(re.escape(c) for c in SCHEDULER_COMMANDS) + r")$"
    return broker_user(
        user, queues=SCHEDULER_QUEUES, publishes={EVENTS: SCHEDULER_EVENTS},
        key_patterns={COMMANDS: any_node, EVENTS: event_keys(SCHEDULER_EVENTS)}, queue_pattern=SCHEDULER_LANES,
        purpose="consumes scheduler, scheduler.heartbeats and the submission lanes scheduler.submit[.<tenant>]; "
                "publishes job decisions, launch/stop commands and MIG layouts",
    )


def executor(user: str, node_ids: Sequence[str]) -> Grant:
    """One executor process serving ``node_ids`` (queues ``executor.<node id>``)."""
    return broker_user(
        user, queues=[f"executor.{n}" for n in node_ids], publishes={EVENTS: EXECUTOR_EVENTS},
        key_patterns={EVENTS: event_keys(EXECUTOR_EVENTS)},
        purpose=f"consumes executor.<node> for {', '.join(node_ids)}; publishes job.started/finished/failed/lost/checkpointed",
    )


def node_agent(user: str, queue: str, node_ids: Sequence[str]) -> Grant:
    """One node-agent process: queue ``node-agent.<node id>`` (single node) or ``node-agent.fleet.<fleet>``."""
    return broker_user(
        user, queues=[queue], publishes={EVENTS: NODE_AGENT_EVENTS},
        purpose=f"consumes {queue} (MIG layouts for {', '.join(node_ids)}); publishes node.registered/heartbeat, gpu.*",
    )


def telemetry(user: str = "telemetry") -> Grant:
    return broker_user(
        user, queues=[TELEMETRY_QUEUE], publishes={EVENTS: TELEMETRY_EVENTS},
        purpose="consumes telemetry.samples (competing consumers); publishes alert.raised/resolved, recommendation.made, fleet.scale_requested",
    )


def setup(user: str = "gpuorch-setup") -> Grant:
    """The setup identity: declares, binds and deletes the topology at install (``gpuctl setup broker``). No
    service runs as it; keep its password with the installer."""
    return Grant(user, ".*", ".*", ".*", purpose="install: declares exchanges, queues and bindings (gpuctl setup "
                                                  "broker); no service runs as it")


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
    ``*.dlq``) and replay dead submissions, each judged as its first publisher. It declares nothing and may not
    publish events or commands."""
    return Grant(
        user, configure=NOTHING, write=exactly([SUBMIT]), read=r"^.+\.dlq$",
        topics={SUBMIT: (rf"^{OPERATOR_KEY_PATTERN}(\.{TENANT_WORD})?$", NOTHING), EVENTS: (NOTHING, NOTHING),
                COMMANDS: (NOTHING, NOTHING), DLX: (NOTHING, NOTHING)},
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
        topics={SUBMIT: (rf"^{OPERATOR_KEY_PATTERN}(\.{TENANT_WORD})?$", NOTHING),
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
        administrator(), setup(), scheduler(), telemetry(), operator(), api(), *submitters_of(),
        *(executor(user, nodes) for user, nodes in fleet.executors),
        *(node_agent(user, queue, nodes) for user, queue, nodes in fleet.node_agents),
    ]


def installation(fleet: Fleet = COMPOSE_FLEET, identity_map: Path = IDENTITY_MAP,
                 tenants: Sequence[str] = ()) -> Installation:
    """Every queue of this deployment: a lane per tenant the identity map names (and ``tenants``: those with a
    quota only), a queue per executor node and per node-agent."""
    named = load_identity_map(identity_map).named_tenants
    return Installation(tenants=sorted({*named, *tenants}),
                        executor_nodes=[node for _, nodes in fleet.executors for node in nodes],
                        node_agents=[(queue, list(nodes)) for _, queue, nodes in fleet.node_agents])


def topology(install: Installation, vhost: str) -> dict[str, list[dict[str, Any]]]:
    """The ``exchanges``, ``queues`` and ``bindings`` of a definitions document: what ``gpuctl setup broker``
    declares (``gpuorch_messaging.queues.install``), so RabbitMQ creates the topology itself when it imports the
    document and no runtime user needs a configure right."""
    def exchange(name: str, kind: str) -> dict[str, Any]:
        return {"name": name, "vhost": vhost, "type": kind, "durable": True, "auto_delete": False,
                "internal": False, "arguments": EXCHANGE_ARGUMENTS.get(name, {})}

    def queue(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        return {"name": name, "vhost": vhost, "durable": True, "auto_delete": False, "arguments": dict(arguments)}

    def binding(source: str, destination: str, key: str) -> dict[str, Any]:
        return {"source": source, "vhost": vhost, "destination": destination, "destination_type": "queue",
                "routing_key": key, "arguments": {}}

    exchanges = [exchange(name, "fanout") for name in FANOUT_EXCHANGES]
    exchanges += [exchange(name, "topic") for name in TOPOLOGY_EXCHANGES]
    queues = [queue(UNROUTED, unrouted_arguments())]
    bindings = [binding(UNROUTED, UNROUTED, "")]
    for spec in install.queues():
        if spec.dead_letter:
            queues.append(queue(spec.dead_letter_queue, spec.dead_letter_arguments()))
            bindings.append(binding(DLX, spec.dead_letter_queue, spec.name))
        queues.append(queue(spec.name, spec.arguments()))
        bindings += [binding(source, spec.name, key) for source, key in spec.bindings]
    return {"exchanges": exchanges, "queues": queues, "bindings": bindings}


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
                passwords: Mapping[str, str] | None = None,
                install: Installation | None = None) -> dict[str, object]:
    """The definitions document (``load_definitions`` / ``POST /api/definitions``) for ``all_grants`` and, with
    ``install``, its topology."""
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
        "topic_permissions": topic_permissions, "parameters": [], "global_parameters": [],
        "policies": [{"vhost": vhost, **BOUNDED_QUEUES_POLICY}],
        **(topology(install, vhost) if install is not None else {"queues": [], "exchanges": [], "bindings": []}),
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
    parser.add_argument("--tenant", action="append", default=[], metavar="TENANT",
                        help="a tenant with a quota but not in deploy/identity.json: its submission lane too "
                             "(repeatable)")
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
    document = json.dumps(definitions(all_grants, args.vhost, passwords, installation(fleet, tenants=args.tenant)),
                          indent=2) + "\n"
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
