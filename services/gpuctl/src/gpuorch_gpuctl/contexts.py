"""Where gpuctl finds the API: contexts in a config file, the way kubectl keeps clusters and users.

    $GPUCTL_CONFIG (default ~/.config/gpuctl/config.yaml):
        current-context: demo
        contexts:
          demo: {server: http://127.0.0.1:8080, token: <token>}      # token may be left out: GPUCTL_TOKEN

    which API a command talks to, first match wins:
        --server / --context (global options), GPUCTL_SERVER
        an explicit --dsn / GPUORCH_DATABASE_URL: the database directly (the pre-API path, kept for scripts)
        the config file's current context
    the token: --token, GPUCTL_TOKEN, the context's token

The file holds tokens: it is written with mode 0600.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml


def config_path() -> Path:
    return Path(os.environ.get("GPUCTL_CONFIG") or Path.home() / ".config" / "gpuctl" / "config.yaml")


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The config document (``{"current-context": ..., "contexts": {...}}``); empty when there is no file."""
    path = path or config_path()
    if not path.exists():
        return {"contexts": {}}
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("contexts", {}), dict):
        raise typer.BadParameter(f"{path} is not a gpuctl config (expected 'contexts:' mapping)")
    document.setdefault("contexts", {})
    return document


def save_config(document: dict[str, Any], path: Path | None = None) -> Path:
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)
    temporary.replace(path)
    return path


def set_context(name: str, server: str, token: str | None, *, use: bool, path: Path | None = None) -> Path:
    document = load_config(path)
    entry: dict[str, Any] = {"server": server.rstrip("/")}
    if token:
        entry["token"] = token
    document["contexts"][name] = entry
    if use or not document.get("current-context"):
        document["current-context"] = name
    return save_config(document, path)


@dataclass(frozen=True)
class Endpoint:
    """An API to talk to: its base URL and the token to present (None: GPUCTL_TOKEN was not set either)."""

    server: str
    token: str | None
    context: str | None = None


@dataclass
class Selection:
    """What the global options said (``gpuctl --server ... --token ... --context ...``)."""

    server: str | None = None
    token: str | None = None
    context: str | None = None


SELECTION = Selection()
"""Set once per run by the app's callback."""


def explicit_endpoint() -> Endpoint | None:
    """An API named on the command line or by GPUCTL_SERVER (wins over a database DSN)."""
    token = SELECTION.token or os.environ.get("GPUCTL_TOKEN") or None
    if SELECTION.server:
        return Endpoint(SELECTION.server.rstrip("/"), token)
    if SELECTION.context:
        return context_endpoint(SELECTION.context)
    if os.environ.get("GPUCTL_SERVER"):
        return Endpoint(os.environ["GPUCTL_SERVER"].rstrip("/"), token)
    return None


def context_endpoint(name: str | None = None) -> Endpoint | None:
    """The named context (or the current one) from the config file; None when there is none."""
    document = load_config()
    name = name or document.get("current-context")
    if not name:
        return None
    entry = document["contexts"].get(name)
    if not isinstance(entry, dict) or not entry.get("server"):
        raise typer.BadParameter(f"no context {name!r} in {config_path()} (gpuctl config get-contexts)")
    token = SELECTION.token or os.environ.get("GPUCTL_TOKEN") or entry.get("token")
    return Endpoint(str(entry["server"]), token, name)


config_app = typer.Typer(help="Contexts: which gpuorch API gpuctl talks to, with which token.",
                         no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


@config_app.command("set-context")
def set_context_cmd(
    name: Annotated[str, typer.Argument(help="context name")],
    server: Annotated[str, typer.Option(help="API base URL, e.g. http://127.0.0.1:8080")],
    token: Annotated[str | None, typer.Option(help="API token (or leave it out and set GPUCTL_TOKEN)")] = None,
    use: Annotated[bool, typer.Option("--use/--no-use", help="make it the current context")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Add or replace a context (and make it the current one)."""
    path = set_context(name, server, token, use=use)
    _say({"context": name, "server": server, "config": str(path)}, f"context {name} -> {server} ({path})", as_json)


@config_app.command("use-context")
def use_context_cmd(name: Annotated[str, typer.Argument(help="context name")], as_json: JsonOpt = False) -> None:
    """Make a context the current one."""
    document = load_config()
    if name not in document["contexts"]:
        raise typer.BadParameter(f"no context {name!r} in {config_path()}")
    document["current-context"] = name
    save_config(document)
    _say({"current-context": name}, f"current context: {name}", as_json)


@config_app.command("get-contexts")
def get_contexts_cmd(as_json: JsonOpt = False) -> None:
    """List the contexts; the current one is marked with *."""
    document = load_config()
    current = document.get("current-context")
    rows = [{"current": name == current, "name": name, "server": entry.get("server"),
             "token": "set" if entry.get("token") else "GPUCTL_TOKEN"}
            for name, entry in document["contexts"].items()]
    if as_json:
        import json

        print(json.dumps(rows))
        return
    print(f"{'CURRENT':<8} {'NAME':<20} {'SERVER':<40} TOKEN")
    for row in rows:
        print(f"{'*' if row['current'] else '':<8} {row['name']:<20} {row['server']:<40} {row['token']}")


@config_app.command("current-context")
def current_context_cmd(as_json: JsonOpt = False) -> None:
    """Print the current context's name."""
    current = load_config().get("current-context")
    if not current:
        raise typer.BadParameter("no current context (gpuctl config set-context NAME --server URL)")
    _say({"current-context": current}, current, as_json)


def _say(data: dict[str, Any], text: str, as_json: bool) -> None:
    if as_json:
        import json

        print(json.dumps(data))
    else:
        print(text)
