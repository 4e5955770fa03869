"""gpuctl's settings: every environment variable gpuctl reads, in one class, read once per run.

    GpuctlSettings.load()   defaults, then the environment (``gpuorch_settings``; gpuctl reads no settings file:
                            GPUORCH_CONFIG_FILE is the services'; gpuctl's own file is the contexts file, contexts.py)
    this_run()              the run: its settings and global options (``--server``, ``--token``, ``--context``),
                            started by the app's callback and ended when the invocation ends, so two runs in one
                            process (tests) share nothing; a command group run on its own loads the settings then

A command takes what it needs from ``this_run()`` and passes the values on. Nothing else in gpuctl reads the
environment, with two exceptions by design: an option's own fallback is typer's ``envvar=`` on that option (its
``--help`` shows it: ``--dsn``/GPUORCH_DATABASE_URL, ``--amqp-url``/GPUORCH_AMQP_URL, the bench options ...), and a
LocalStack's child process inherits gpuctl's whole environment (stack.py hands it on). ``gpuctl --help`` lists the
variables below (``GpuctlSettings.environment_help``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from gpuorch_settings import ProgramSettings, SettingsError, setting

from gpuorch_gpuctl.errors import USAGE, fail


class GpuctlSettings(ProgramSettings):
    """Each field is one environment variable (its name, its default, its meaning); frozen once loaded."""

    file_variable = None

    config: Path | None = setting("GPUCTL_CONFIG", None, "the contexts file (APIs, tokens, the current context); "
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

    @property
    def config_path(self) -> Path:
        """The contexts file this run reads and writes."""
        return self.config or Path.home() / ".config" / "gpuctl" / "config.yaml"


def load_settings() -> GpuctlSettings:
    """The settings from the environment; invalid ones are a usage error naming each variable."""
    try:
        settings = GpuctlSettings.load()
    except SettingsError as exc:
        fail("invalid settings: " + "; ".join(exc.problems), USAGE)
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
