"""``gpuctl setup broker``: declare gpuorch's broker topology once, as the setup identity, at install.

    gpuctl setup broker --amqp-url amqp://gpuorch-setup:...@rabbitmq/gpuorch --identity-map deploy/identity.json \
        --node gpu-a --node gpu-b [--tenant T ...] [--executor-node N ...] [--node-agent QUEUE=N1,N2 ...]
        ──> exchanges, the scheduler's queues and a submission lane per tenant, executor.<node> and
            node-agent.<node> per node, telemetry.samples, each with Q.dlq and its bindings
            (``gpuorch_messaging.queues.install``: the same catalogue the services consume from)

Runtime services only look these names up (``GPUORCH_BROKER_TOPOLOGY=passive``, the default): their broker users
have no configure right (deploy/rabbitmq/make_definitions.py), so nothing shared can be declared, bound or deleted
by them. Run it again after adding a node or a tenant (idempotent). Compose needs no run: RabbitMQ imports the same
topology from deploy/rabbitmq/definitions.json at boot. Progress (one line per queue) goes to stderr; ``--json``
prints one document on stdout. Exit 1 when the broker refuses or cannot be reached (errors.py).

``gpuctl setup logs-credential IDENTITY`` prints the log credential of one executor (``GPUORCH_LOGS_TOKEN`` on that
node), derived from the API's issuing secret ``GPUORCH_LOGS_SECRET`` (``gpuorch_identity.log_credential``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated

import aiormq.exceptions
import typer
from gpuorch_gpuctl.errors import fail

setup_app = typer.Typer(help="Install-time setup: the broker topology, node log credentials.",
                        no_args_is_help=True)


def _node_agent(text: str) -> tuple[str, list[str]]:
    queue, _, nodes = text.partition("=")
    if not queue or not nodes:
        raise typer.BadParameter("expected QUEUE=NODE[,NODE...] (e.g. node-agent.fleet.sim=sim-00000,sim-00001)")
    return queue, [n for n in nodes.split(",") if n]


@setup_app.command("broker")
def setup_broker(
    amqp_url: Annotated[str, typer.Option(
        "--amqp-url", envvar="GPUORCH_SETUP_AMQP_URL",
        help="RabbitMQ URL of the setup identity (gpuorch-setup in deploy/rabbitmq; any user with configure, write "
             "and read on gpuorch's names)")] = "amqp://guest:guest@127.0.0.1:5672/",
    identity_map: Annotated[Path | None, typer.Option(
        "--identity-map", envvar="GPUORCH_IDENTITY_MAP",
        help="identity map: every tenant it names gets a submission lane")] = None,
    tenant: Annotated[list[str] | None, typer.Option(help="another tenant with a lane (a tenant with a quota only; "
                                                          "repeatable)")] = None,
    node: Annotated[list[str] | None, typer.Option(help="a GPU node: queues executor.NODE and node-agent.NODE "
                                                        "(repeatable)")] = None,
    executor_node: Annotated[list[str] | None, typer.Option(help="a node served by an executor: executor.NODE "
                                                                 "(repeatable)")] = None,
    node_agent: Annotated[list[str] | None, typer.Option(
        help="a node-agent queue and its nodes, QUEUE=NODE[,NODE...] (a simulated fleet; repeatable)")] = None,
    wait_s: Annotated[float, typer.Option(help="seconds to keep trying to reach the broker (it may be starting)")
                      ] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Declare the exchanges, every queue with its dead-letter queue, and their bindings (idempotent)."""
    from gpuorch_identity import load_identity_map
    from gpuorch_messaging.queues import Installation, install

    tenants = set(tenant or [])
    if identity_map is not None:
        try:
            tenants |= set(load_identity_map(identity_map).named_tenants)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--identity-map") from exc
    nodes = list(node or [])
    agents = [_node_agent(text) for text in node_agent or []] + [(f"node-agent.{n}", [n]) for n in nodes]
    installation = Installation(tenants=sorted(tenants), executor_nodes=[*nodes, *(executor_node or [])],
                                node_agents=agents)

    def progress(name: str) -> None:
        print(f"declared {name} (and {name}.dlq)", file=sys.stderr, flush=True)

    try:
        declared = asyncio.run(install(amqp_url, installation, on_declared=progress, connect_timeout_s=wait_s))
    except (ConnectionError, OSError, aiormq.exceptions.AMQPError, RuntimeError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps({"queues": declared, "tenants": sorted(tenants)}))
    else:
        print(f"declared the exchanges and {len(declared)} queues")


@setup_app.command("logs-credential")
def logs_credential(
    identity: Annotated[str, typer.Argument(help="the executor's broker user (executor-<node>, or a rack's user)")],
    secret: Annotated[str, typer.Option(
        "--secret", envvar="GPUORCH_LOGS_SECRET", help="the API's issuing secret (GPUORCH_LOGS_SECRET)")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Print the log credential of one executor: its GPUORCH_LOGS_TOKEN. The API derives the same from the identity
    that announced the node's endpoint; it reads that node's logs and no other's."""
    from gpuorch_identity import log_credential

    if not secret:
        raise typer.BadParameter("the issuing secret is required (--secret or GPUORCH_LOGS_SECRET)",
                                 param_hint="--secret")
    credential = log_credential(secret, identity)
    print(json.dumps({"identity": identity, "GPUORCH_LOGS_TOKEN": credential}) if as_json else credential)
