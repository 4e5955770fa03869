"""Where gpuctl finds the API: contexts in a config file, the way kubectl keeps clusters and users.

    $GPUCTL_CONFIG (default ~/.config/gpuctl/config.yaml):
        current-context: demo
        contexts:
          demo: {server: http://127.0.0.1:8080, token: <token>}      # token may be left out: GPUCTL_TOKEN
          sso: {server: ..., token: <ID token>, refresh_token: ..., token_expires_at: <epoch s>, oidc: {...}}
                                                                     # written by gpuctl login (login_cmd.py), which
                                                                     # refreshes the token here once it expired

    which API a command talks to, first match wins:
        --server / --context (global options), GPUCTL_SERVER
        an explicit --dsn / GPUORCH_DATABASE_URL: the database directly (the pre-API path, kept for scripts)
        the config file's current context
    the token: --token, GPUCTL_TOKEN, the context's token

The file holds tokens: it is written with mode 0600. The options and variables come from the run
(settings.py: ``this_run()``); the functions here take them as arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from gpuorch_gpuctl.errors import USAGE, fail
from gpuorch_gpuctl.settings import Run, this_run


def load_config(path: Path) -> dict[str, Any]:
    """The config document (``{"current-context": ..., "contexts": {...}}``); empty when there is no file; a file
    that is not one fails (exit 2)."""
    if not path.exists():
        return {"contexts": {}}
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        fail(f"cannot read {path}: {exc}", USAGE)
    if not isinstance(document, dict) or not isinstance(document.get("contexts", {}), dict):
        fail(f"{path} is not a gpuctl config (expected 'contexts:' mapping)", USAGE)
    document.setdefault("contexts", {})
    return document


def save_config(document: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)
    temporary.replace(path)
    return path


def set_context(name: str, server: str, token: str | None, *, use: bool, path: Path) -> Path:
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
    """An API to talk to: its base URL and the token to present (None: none was given or configured)."""

    server: str
    token: str | None
    context: str | None = None


def explicit_endpoint(run: Run) -> Endpoint | None:
    """An API named on the command line or by GPUCTL_SERVER (wins over a database DSN)."""
    token = run.token or run.settings.token
    if run.server:
        return Endpoint(run.server.rstrip("/"), token)
    if run.context:
        return context_endpoint(run, run.context)
    if run.settings.server:
        return Endpoint(run.settings.server.rstrip("/"), token)
    return None


def context_endpoint(run: Run, name: str | None = None) -> Endpoint | None:
    """The named context (or the current one) from the run's config file; None when there is none; a name that
    is not there fails (exit 1)."""
    path = run.settings.config_path
    document = load_config(path)
    name = name or document.get("current-context")
    if not name:
        return None
    entry = document["contexts"].get(name)
    if not isinstance(entry, dict) or not entry.get("server"):
        fail(f"no context {name!r} in {path} (gpuctl config get-contexts)")
    if not (run.token or run.settings.token) and entry.get("refresh_token"):
        from gpuorch_gpuctl.login_cmd import refreshed  # a context signed in by gpuctl login

        entry = refreshed(entry, name, path)
    token = run.token or run.settings.token or entry.get("token")
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
    path = set_context(name, server, token, use=use, path=this_run().settings.config_path)
    _say({"context": name, "server": server, "config": str(path)}, f"context {name} -> {server} ({path})", as_json)


@config_app.command("use-context")
def use_context_cmd(name: Annotated[str, typer.Argument(help="context name")], as_json: JsonOpt = False) -> None:
    """Make a context the current one."""
    path = this_run().settings.config_path
    document = load_config(path)
    if name not in document["contexts"]:
        fail(f"no context {name!r} in {path} (gpuctl config get-contexts)")
    document["current-context"] = name
    save_config(document, path)
    _say({"current-context": name}, f"current context: {name}", as_json)


@config_app.command("get-contexts")
def get_contexts_cmd(as_json: JsonOpt = False) -> None:
    """List the contexts; the current one is marked with *."""
    document = load_config(this_run().settings.config_path)
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
    current = str(load_config(this_run().settings.config_path).get("current-context") or "")
    if not current:
        fail("no current context (gpuctl config set-context NAME --server URL)")
    _say({"current-context": current}, current, as_json)


def _say(data: dict[str, Any], text: str, as_json: bool) -> None:
    if as_json:
        import json

        print(json.dumps(data))
    else:
        print(text)
