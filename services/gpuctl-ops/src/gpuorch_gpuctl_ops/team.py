"""Who may do what on a ``gpuctl up`` host: the team's identity map, its API tokens, and the services' broker users.

    <root>/identity.json        the person who runs ``gpuctl up``: operator (every tenant, up to critical);
                                each ``--member NAME``: a submitter of its own tenant NAME (up to high), so members
                                neither see nor cancel each other's jobs; the services: scheduler, telemetry, api
                                (gateway), executor-<node>, node-agent-<node>. No ``"*"`` entry: an identity not
                                named here may do nothing.
    <root>/tokens/<name>.token  each person's API token (0600, in a 0700 directory); the map keeps only digests
    broker users                one per service, named as ``gpuorch_messaging.senders`` reads roles, with a fresh
                                random password at every ``up`` (held only in the services' environments)

Running ``up`` again keeps the map and its tokens, adds new members, and replaces a map from before this layout
(one with ``"*"``: everyone an operator). Nothing here imports a service: gpuctl is a client.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gpuorch_identity import IdentityMap, token_digest

SERVICE_NAMES = ("scheduler", "telemetry", "api")
RESERVED = re.compile(r"^(scheduler|telemetry|api|executor-.+|node-agent-.+|operator-.+|gpuctl-operator.*)$")
"""Names a person may not take: the services' broker users, and the prefixes the broker reads as roles."""


class TeamError(ValueError):
    """A member name that cannot be an identity (reserved, or not a valid tenant name)."""


@dataclass(frozen=True)
class Team:
    """The identity map as written, and where each person's token is."""

    identity_map: dict[str, Any]
    operator: str
    token_files: dict[str, Path]

    def token(self, name: str) -> str:
        return self.token_files[name].read_text().strip()


def service_identities(node_id: str) -> dict[str, dict[str, Any]]:
    identities: dict[str, dict[str, Any]] = {name: {"role": "service"} for name in ("scheduler", "telemetry")}
    identities["api"] = {"role": "gateway"}
    for role in ("executor", "node-agent"):
        identities[f"{role}-{node_id}"] = {"role": "service", "nodes": [node_id]}
    return identities


def _write_token(directory: Path, name: str) -> tuple[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    token = secrets.token_urlsafe(24)
    path = directory / f"{name}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return token, path


def team_identity_map(path: Path, *, operator: str, members: list[str], node_id: str) -> Team:
    """Load or create the team's map at ``path`` (module docstring); writes it and any new token files."""
    for name in [operator, *members]:
        if RESERVED.match(name):
            raise TeamError(f"{name!r} is the name of a gpuorch service identity; pick another")
    document: dict[str, Any] = {"identities": {}, "tokens": {}}
    if path.exists():
        found = json.loads(path.read_text())
        if "*" not in found.get("identities", {}):  # a map from before: everyone an operator, replaced
            document = found
    identities: dict[str, Any] = document["identities"]
    tokens: dict[str, str] = document["tokens"]
    identities.update(service_identities(node_id))
    wanted = {operator: {"role": "operator", "tenants": ["*"], "default_tenant": "default",
                         "max_priority": "critical"}}
    for member in members:
        wanted.setdefault(member, {"role": "submitter", "tenants": [member], "default_tenant": member,
                                   "max_priority": "high"})
    token_dir = path.parent / "tokens"
    token_files: dict[str, Path] = {}
    for name, identity in wanted.items():
        identities.setdefault(name, identity)
        token_file = token_dir / f"{name}.token"
        if not token_file.exists() or token_digest(token_file.read_text().strip()) not in tokens:
            for digest in [d for d, who in tokens.items() if who == name]:
                del tokens[digest]
            token, token_file = _write_token(token_dir, name)
            tokens[token_digest(token)] = name
        token_files[name] = token_file
    try:
        IdentityMap.model_validate(document)
    except ValueError as exc:
        raise TeamError(f"the team's identity map is not valid: {exc}") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    path.chmod(0o600)
    return Team(document, operator, token_files)


def create_broker_users(admin_api: str, vhost: str, node_id: str, *, admin: tuple[str, str] = ("guest", "guest"),
                        amqp_host: str = "127.0.0.1", amqp_port: int = 5672) -> dict[str, str]:
    """One broker user per service identity (module docstring), each with a new random password and rights on
    ``vhost`` only; returns each service's AMQP URL."""
    import httpx

    urls = {}
    for user in [*SERVICE_NAMES, f"executor-{node_id}", f"node-agent-{node_id}"]:
        password = secrets.token_hex(24)
        name = quote(user, safe="")
        httpx.put(f"{admin_api}/api/users/{name}", auth=admin, timeout=10,
                  json={"password": password, "tags": ""}).raise_for_status()
        httpx.put(f"{admin_api}/api/permissions/{quote(vhost, safe='')}/{name}", auth=admin, timeout=10,
                  json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()
        urls[user] = f"amqp://{name}:{password}@{amqp_host}:{amqp_port}/{quote(vhost, safe='')}"
    return urls
