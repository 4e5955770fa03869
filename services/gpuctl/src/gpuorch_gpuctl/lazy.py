"""Commands whose modules load only when they run: ``gpuctl --help``, ``--version`` and the client commands import
no more than typer, rich, httpx and yaml (decision 63).

    LAZY_COMMANDS: this package's lazy commands, name -> where the command is (module, attribute: a function or a
        typer group) and its one-line help, shown by ``gpuctl --help`` without importing the module
        (tests/test_lazy_commands.py holds the line to the command's own docstring). A new command module of this
        package registers here: ``"login": LazyCommand("login_cmd", "login", "Sign in ...")``.
    plugin_commands(): the commands other installed packages add, through entry points of the group
        ``gpuctl.commands`` (name = the command, value = a ``LazyCommand`` in a module that imports nothing heavy;
        gpuorch-gpuctl-ops adds demo, up, down, bench, replay, report ...). Read only when a name is not found
        here, or for ``--help``.
    OPS_COMMANDS: the names gpuorch-gpuctl-ops provides, so that without it ``gpuctl demo`` says what to install
        instead of "no such command"; ``ops_module`` does the same for a direct path (``--dsn``, ``--amqp-url``).
    LazyGroup (the app's click group): lists them with the eager commands; a lazy one is a proxy whose
        ``make_context`` loads the module and hands over to the real command (its options, help and callback)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from gpuorch_gpuctl.errors import fail

OPS_DISTRIBUTION = "gpuorch-gpuctl-ops"
OPS_HINT = (f"install {OPS_DISTRIBUTION} for this command (pip install {OPS_DISTRIBUTION}; in the gpuorch "
            "workspace: make env)")


@dataclass(frozen=True)
class LazyCommand:
    module: str
    """A module of gpuorch_gpuctl (``report_cmd``), or a full module path (``gpuorch_gpuctl_ops.demo_cmd``)."""
    attribute: str
    short_help: str
    mount: Callable[[Any], None] | None = None
    """Called with the loaded module before the command is built (a group that takes commands from elsewhere)."""


LAZY_COMMANDS: dict[str, LazyCommand] = {
    "login": LazyCommand("login_cmd", "login", "Sign in with the team's OpenID provider (device flow: open the URL "
                         "shown, enter the code)."),
    "logout": LazyCommand("login_cmd", "logout", "Sign out: forget this context's token (and revoke its refresh "
                          "token at the provider)."),
}
"""This package's lazy commands (its other client commands are light and built at once)."""
OPS_COMMANDS = ("demo", "down", "up", "replay", "report", "setup", "schema", "db", "bench", "mig", "reserve")


@cache
def plugin_commands() -> dict[str, LazyCommand]:
    """The commands of the ``gpuctl.commands`` entry points of the installed packages (a broken one is skipped:
    it must not take the whole client down)."""
    from importlib.metadata import entry_points

    found: dict[str, LazyCommand] = {}
    for point in entry_points(group="gpuctl.commands"):
        try:
            command = point.load()
        except Exception:  # noqa: BLE001 - a plugin that does not load is left out, the others stay
            continue
        if isinstance(command, LazyCommand) and point.name not in found:
            found[point.name] = command
    return found


def lazy_command(name: str) -> LazyCommand | None:
    """Where command ``name`` lives: this package's table first, then the installed plugins."""
    return LAZY_COMMANDS.get(name) or plugin_commands().get(name)


def ops_module(name: str) -> ModuleType:
    """``gpuorch_gpuctl_ops.<name>`` (a direct path's code), or the usage error saying what to install."""
    try:
        module = importlib.import_module(f"gpuorch_gpuctl_ops.{name}")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("gpuorch_gpuctl_ops"):
            raise
        fail(f"the direct path (--dsn, --amqp-url) needs {OPS_DISTRIBUTION}: {OPS_HINT}")
    return module


def load(name: str) -> Any:
    """The real click command of a lazy one (its module imported now)."""
    where = lazy_command(name)
    if where is None:
        raise KeyError(name)
    module = importlib.import_module(where.module if "." in where.module else f"gpuorch_gpuctl.{where.module}")
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


def _flags_without_type(display: Callable[[Any, Any], str | None]) -> Callable[[Any, Any], str | None]:
    """typer's panels print a flag's type (``--json <bool>``, ``--wait / --no-wait <bool>``): a flag takes no
    value, so its type column stays empty (tests/test_lazy_commands.py)."""
    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if self.is_flag else display(self, ctx)

    return display_type_rich


if not getattr(TyperOption.display_type_rich, "gpuctl_flags", False):
    TyperOption.display_type_rich = _flags_without_type(TyperOption.display_type_rich)  # type: ignore[method-assign,assignment]
    TyperOption.display_type_rich.gpuctl_flags = True  # type: ignore[attr-defined]


def without_panels(command: Any) -> None:
    """Click's plain help and usage errors for ``command`` and every command under it: no typer panels (their
    box-drawing characters) where the output is not a terminal."""
    command.rich_markup_mode = None
    for sub in getattr(command, "commands", {}).values():
        without_panels(sub)


class _Proxy(TyperCommand):
    """A lazy command in the listing; parsing its arguments loads it and the real command takes over (plain, as
    its group, when its group is)."""

    def __init__(self, name: str, where: LazyCommand, *, plain: bool) -> None:
        super().__init__(name, short_help=where.short_help, help=where.short_help)
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
        lazy = [*LAZY_COMMANDS, *plugin_commands()]
        return [*super().list_commands(ctx), *dict.fromkeys(n for n in lazy if n not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in self.commands:
            return super().get_command(ctx, cmd_name)
        where = lazy_command(cmd_name)
        if where is not None:
            return _Proxy(cmd_name, where, plain=self.rich_markup_mode is None)
        if cmd_name in OPS_COMMANDS:
            fail(f"gpuctl {cmd_name}: {OPS_HINT}")
        return super().get_command(ctx, cmd_name)
