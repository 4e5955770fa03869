"""gpuctl's settings: every environment variable gpuctl reads, in one class, read once per run.

    GpuctlSettings.load()   defaults, then the environment (an empty variable counts as unset); gpuctl reads no
                            settings file: GPUORCH_CONFIG_FILE is the services'; gpuctl's own file is the contexts
                            file, contexts.py
    this_run()              the run: its settings and global options (``--server``, ``--token``, ``--context``),
                            started by the app's callback and ended when the invocation ends, so two runs in one
                            process (tests) share nothing; a command group run on its own loads the settings then

A command takes what it needs from ``this_run()`` and passes the values on. Nothing else in gpuctl reads the
environment, with two exceptions by design: an option's own fallback is typer's ``envvar=`` on that option (its
``--help`` shows it: ``--dsn``/GPUORCH_DATABASE_URL, ``--amqp-url``/GPUORCH_AMQP_URL, the bench options ...), and a
LocalStack's child process inherits gpuctl's whole environment (gpuorch_gpuctl_ops.stack hands it on). ``gpuctl
--help`` lists the variables below (``GpuctlSettings.environment_help``).

The services' idiom (libs/settings, pydantic-settings) is not used here: the thin client depends on typer, rich,
httpx and yaml only (decision 63), and its settings are strings and one path, so the same contract (every variable
one field, named, described, listed in ``--help``) is kept with a dataclass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import typer

from gpuorch_gpuctl.errors import USAGE, fail


def setting(variable: str, default: Any, description: str) -> Any:
    """A field read from environment variable ``variable``."""
    return field(default=default, metadata={"variable": variable, "description": description})


@dataclass(frozen=True)
class GpuctlSettings:
    """Each field is one environment variable (its name, its default, its meaning); frozen once loaded."""

    config: Path | None = setting("GPUCTL_CONFIG", None, "the contexts file (APIs, tokens, the current context); "  # noqa: RUF009
                                  "~/.config/gpuctl/config.yaml when unset")
    server: str | None = setting("GPUCTL_SERVER", None, "API base URL; wins over the contexts file, loses to "
                                 "--server and --context")
    token: str | None = setting("GPUCTL_TOKEN", None, "API token; wins over a context's token, loses to --token")
    otlp_endpoint: str | None = setting("GPUORCH_OTLP_ENDPOINT", None, "OTLP/HTTP collector of the span a direct "
                                        "submit or cancel (--amqp-url) starts the job's trace with")
    amqp_admin: str = setting("GPUORCH_AMQP_ADMIN", "http://127.0.0.1:15672", "RabbitMQ management API (as guest) "
                              "where gpuctl demo and up create their vhost and up its broker users")
    demo_vhost: str = setting("GPUORCH_DEMO_VHOST", "gpuorch-demo", "gpuctl demo's vhost (emptied at every demo)")
    demo_database_url: str = setting("GPUORCH_DEMO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/gpuorch_demo",
                                     "gpuctl demo's database (dropped and created at every demo)")
    sudo_user: str | None = setting("SUDO_USER", None, "set by sudo: the user gpuctl up names its operator "
                                    "(unless --operator)")
    xdg_runtime_dir: str | None = setting("XDG_RUNTIME_DIR", None, "the user session's runtime directory: gpuctl "
                                          "up finds the systemd user manager by it and writes its units under it")

    @classmethod
    def variables(cls) -> dict[str, tuple[str, str]]:
        """Environment variable -> (field, meaning), for every field."""
        return {f.metadata["variable"]: (f.name, f.metadata["description"]) for f in fields(cls)}

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> GpuctlSettings:
        """The settings from ``env`` (default: the process environment) over the defaults."""
        variables = os.environ if env is None else env
        given: dict[str, Any] = {}
        for variable, (name, _) in cls.variables().items():
            value = variables.get(variable)
            if value:
                given[name] = Path(value) if name == "config" else value
        return cls(**given)

    @classmethod
    def environment_help(cls) -> str:
        """``--help``'s list of variables: name, default, meaning."""
        lines = ["environment variables:"]
        for f in fields(cls):
            default = "default: unset" if f.default is None else f"default: {f.default}"
            lines.append(f"  {f.metadata['variable']:<36} {f.metadata['description']} ({default})")
        return "\n".join(lines)

    @property
    def config_path(self) -> Path:
        """The contexts file this run reads and writes."""
        return self.config or Path.home() / ".config" / "gpuctl" / "config.yaml"


def load_settings() -> GpuctlSettings:
    """The settings from the environment; invalid ones are a usage error naming each variable."""
    try:
        settings = GpuctlSettings.load()
    except (TypeError, ValueError) as exc:
        fail(f"invalid settings: {exc}", USAGE)
    return settings


@dataclass(frozen=True)
class Run:
    """One gpuctl run: its settings and its global options (None: not given)."""

    settings: GpuctlSettings
    server: str | None = None
    token: str | None = None
    context: str | None = None


_RUNS: list[Run] = []
"""The run under way (the app's callback starts it, its root context's closing ends it)."""


def start_run(root: typer.Context, run: Run) -> None:
    """Make ``run`` the current one until ``root`` closes (once per invocation, by the app's callback)."""
    _RUNS.append(run)
    root.call_on_close(_RUNS.pop)


def this_run() -> Run:
    """The current run (see the module doc); a command group run on its own (tests) gets settings loaded now."""
    return _RUNS[-1] if _RUNS else Run(load_settings())
