"""Commands whose modules load only when they run: ``gpuctl --help``, ``--version`` and the client commands do not
import the stack (broker, OpenTelemetry), the policy and scheduling libraries (numpy), the report or asyncpg.

    LAZY_COMMANDS: name -> where the command is (module, attribute: a function or a typer group) and its one-line
        help, shown by ``gpuctl --help`` without importing the module (tests/test_lazy_commands.py holds the line to
        the command's own docstring)
    LazyGroup (the app's click group): lists them with the eager commands; a lazy one is a proxy whose
        ``make_context`` loads the module and hands over to the real command (its options, help and callback)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


@dataclass(frozen=True)
class LazyCommand:
    module: str
    attribute: str
    short_help: str
    mount: Callable[[Any], None] | None = None
    """Called with the loaded module before the command is built (a group that takes commands from elsewhere)."""


def _bench_extras(_: Any) -> None:
    """``bench capacity`` and ``bench mig`` live in their own modules and join the bench group."""
    from gpuorch_gpuctl.bench_capacity_cmd import capacity
    from gpuorch_gpuctl.bench_cmd import bench_app
    from gpuorch_gpuctl.bench_mig_cmd import mig

    bench_app.command("capacity")(capacity)
    bench_app.command("mig")(mig)


LAZY_COMMANDS = {
    "demo": LazyCommand("demo_cmd", "demo", "Run a simulated 3-node fleet with a mixed workload of real processes, "
                        "then stop everything (or --keep)."),
    "down": LazyCommand("demo_cmd", "down", "Stop the stack `gpuctl demo --keep` or `gpuctl up` left running (and "
                        "its jobs)."),
    "up": LazyCommand("up_cmd", "up", "Start every service on this host against its GPUs and leave them running "
                      "(gpuctl down --root ROOT stops)."),
    "replay": LazyCommand("replay_cmd", "replay", "Replay a trace through the scheduler on its Harness (FGD paper "
                          "protocol, or a job-level replay)."),
    "report": LazyCommand("report_cmd", "report", "The weekly review, from the gpuorch API of the current context: "
                          "per tenant and job, allocated vs used, idle GPU-hours, advice, queue wait by request "
                          "shape, and conclusions (idle GPUs, jobs to right-size, shortages, throttling, what the "
                          "autoscaler would do)."),
    "setup": LazyCommand("setup_cmd", "setup_app", "Install-time setup: the broker topology, node log credentials."),
    "schema": LazyCommand("schema_cmd", "schema_app", "Export message schemas (JSON Schema, AsyncAPI)."),
    "db": LazyCommand("db_cmd", "db_app", "Database schema: apply migrations and show their status."),
    "bench": LazyCommand("bench_cmd", "bench_app", "Benchmarks of the scheduler against the real broker and database "
                         "(see docs/PERFORMANCE.md).", _bench_extras),
    "mig": LazyCommand("mig_cmd", "mig_app", "MIG layouts: what the planner would change (mode advise) and why."),
    "login": LazyCommand("login_cmd", "login", "Sign in with the team's OpenID provider (device flow: open the URL "
                         "shown, enter the code)."),
    "logout": LazyCommand("login_cmd", "logout", "Sign out: forget this context's token (and revoke its refresh "
                          "token at the provider)."),
    "reserve": LazyCommand("reserve_cmd", "reserve_app", "Advance reservations: GPUs promised to a tenant for a "
                           "window (operators create)."),
}


def load(name: str) -> Any:
    """The real click command of a lazy one (its module imported now)."""
    where = LAZY_COMMANDS[name]
    module = importlib.import_module(f"gpuorch_gpuctl.{where.module}")
    if where.mount is not None:
        where.mount(module)
    target = getattr(module, where.attribute)
    command: Any
    if isinstance(target, typer.Typer):
        command = typer.main.get_group(target)  # a group even with one command (schema export)
    else:
        holder = typer.Typer()
        holder.command(name)(target)
        command = typer.main.get_command(holder)
    command.name = name
    return command


def without_panels(command: Any) -> None:
    """Click's plain help and usage errors for ``command`` and every command under it: no typer panels (their
    box-drawing characters) where the output is not a terminal."""
    command.rich_markup_mode = None
    for sub in getattr(command, "commands", {}).values():
        without_panels(sub)


class _Proxy(TyperCommand):
    """A lazy command in the listing; parsing its arguments loads it and the real command takes over (plain, as
    its group, when its group is)."""

    def __init__(self, name: str, *, plain: bool) -> None:
        super().__init__(name, short_help=LAZY_COMMANDS[name].short_help, help=LAZY_COMMANDS[name].short_help)
        self._real: Any = None
        self._plain = plain

    def real(self) -> Any:
        if self._real is None:
            self._real = load(self.name or "")
            if self._plain:
                without_panels(self._real)
        return self._real

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        return self.real().make_context(info_name, args, parent=parent, **extra)

    def get_params(self, ctx: Any) -> Any:  # shell completion
        return self.real().get_params(ctx)


class LazyGroup(TyperGroup):
    """gpuctl's top-level group: the eager commands typer built, and ``LAZY_COMMANDS`` as proxies."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in LAZY_COMMANDS if n not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            return _Proxy(cmd_name, plain=self.rich_markup_mode is None)
        return super().get_command(ctx, cmd_name)
