"""One configuration style for every gpuorch service (pydantic-settings).

A service declares its settings as a ``ServiceSettings`` subclass, one field per setting, each named by its
environment variable (``setting("GPUORCH_TICK_S", 1.0, "seconds between ticks", gt=0)``). Values come from, first
to last wins:

1. the field's default;
2. an optional file: ``--config FILE`` or ``GPUORCH_CONFIG_FILE`` (TOML or JSON by its suffix; keys are the
   environment variable names, e.g. ``GPUORCH_TICK_S = 0.5``, or the field names);
3. the environment (or, in tests, a mapping given to ``load``).

A program that is not a service (``gpuctl``) subclasses ``ProgramSettings``: the same sources, validation and
help, without the services' log level and collector, and with ``file_variable = None`` when it reads no settings
file (``GPUORCH_CONFIG_FILE`` set for a service in the same shell is then not its business).

Values are validated (types, bounds, the class's own validators); ``load_or_exit`` prints every problem on one
line each, naming the variable and the value it got (``GPUORCH_METRICS_PORT: Input should be a valid integer ...
(got 'abc')``), and exits 2, as argparse does for a bad flag. ``--help`` lists every variable with its default
and meaning (``environment_help``). Unknown ``GPUORCH_*`` variables are ignored (several services share an
environment); an unknown key in a file is an error (a typo there would otherwise go unnoticed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import AliasChoices, Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

CONFIG_FILE_VARIABLE = "GPUORCH_CONFIG_FILE"
_SOURCES: ContextVar[tuple[Mapping[str, str] | None, Path | None]] = ContextVar("gpuorch_settings_sources",
                                                                               default=(None, None))
S = TypeVar("S", bound="ProgramSettings")


class SettingsError(ValueError):
    """Settings that do not validate; ``str()`` is one line per problem, each naming its variable."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def setting(variable: str, default: Any = ..., description: str = "", **constraints: Any) -> Any:
    """A field read from environment variable ``variable`` (also accepted by field name: tests, files);
    ``default_factory`` in ``constraints`` replaces ``default``."""
    if "default_factory" in constraints:
        return Field(validation_alias=AliasChoices(variable), description=description, **constraints)
    return Field(default, validation_alias=AliasChoices(variable), description=description, **constraints)


def variable_of(info: FieldInfo, name: str) -> str:
    """The environment variable of a field (its alias), else its name."""
    alias = info.validation_alias
    if isinstance(alias, AliasChoices) and alias.choices and isinstance(alias.choices[0], str):
        return alias.choices[0]
    return alias if isinstance(alias, str) else name


class _MappingSource(PydanticBaseSettingsSource):
    """The variables of a given mapping (``load(env=...)``), instead of the process environment."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        variable = variable_of(field, field_name)
        return self.env.get(variable), variable, False

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, info in self.settings_cls.model_fields.items():
            variable = variable_of(info, name)
            if variable in self.env:
                found[variable] = self.env[variable]
        return found


class _FileSource(PydanticBaseSettingsSource):
    """A TOML or JSON file of settings; keys are variable names or field names; unknown keys are errors."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
            data = tomllib.loads(text) if self.path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as exc:
            raise SettingsError([f"{CONFIG_FILE_VARIABLE}: cannot read {self.path}: {exc}"]) from exc
        if not isinstance(data, dict):
            raise SettingsError([f"{CONFIG_FILE_VARIABLE}: {self.path} must hold a table/object of settings"])
        known = {n: variable_of(i, n) for n, i in self.settings_cls.model_fields.items()}
        by_name = {**{v: v for v in known.values()}, **known}
        unknown = sorted(k for k in data if k not in by_name)
        if unknown:
            raise SettingsError([f"{CONFIG_FILE_VARIABLE}: {self.path}: unknown settings {unknown} "
                                 f"(known: {sorted(known.values())})"])
        return {by_name[k]: v for k, v in data.items()}


class ProgramSettings(BaseSettings):
    """Base of a program's settings (see the module doc): sources, validation and ``--help`` text, no fields.
    Frozen once loaded. ``file_variable``: the variable that names a settings file, None for none."""

    model_config = SettingsConfigDict(frozen=True, populate_by_name=True, extra="ignore", case_sensitive=True,
                                      validate_default=True)
    file_variable: ClassVar[str | None] = CONFIG_FILE_VARIABLE

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        """A variable set to the empty string means unset where the setting may be unset (default None)."""
        if value == "" and info.field_name is not None and cls.model_fields[info.field_name].default is None:
            return None
        return value

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env, file = _SOURCES.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings]
        sources.append(env_settings if env is None else _MappingSource(settings_cls, env))
        if file is not None:
            sources.append(_FileSource(settings_cls, file))
        return tuple(sources)

    @classmethod
    def load(cls: type[S], env: Mapping[str, str] | None = None, file: str | Path | None = None) -> S:
        """Settings from ``env`` (default: the process environment) over ``file`` (default: the file named by
        ``GPUORCH_CONFIG_FILE`` there, if any) over the defaults. Raises ``SettingsError``."""
        variables = os.environ if env is None else env
        named = file or (variables.get(cls.file_variable) if cls.file_variable else None) or None
        token = _SOURCES.set((env, Path(named) if named else None))
        try:
            return cls()
        except ValidationError as exc:
            raise SettingsError([_describe(cls, error) for error in exc.errors()]) from None
        finally:
            _SOURCES.reset(token)

    @classmethod
    def environment_help(cls) -> str:
        """``--help``'s list of variables: name, default, meaning."""
        lines = [f"environment variables (or keys of the --config / {cls.file_variable} file, TOML or JSON):"
                 if cls.file_variable else "environment variables:"]
        for name, info in cls.model_fields.items():
            default = "required" if info.is_required() else "default: computed" if info.default_factory \
                else f"default: {_shown(info.default)}"
            lines.append(f"  {variable_of(info, name):<36} {info.description or name} ({default})")
        return "\n".join(lines)


class ServiceSettings(ProgramSettings):
    """Base of every service's settings, with what every service reads: its log level and its OTLP collector."""

    log_level: str = setting("GPUORCH_LOG_LEVEL", "INFO", "log level: DEBUG, INFO, WARNING, ERROR")
    otlp_endpoint: str | None = setting("GPUORCH_OTLP_ENDPOINT", None, "OTLP/HTTP collector URL, e.g. "
                                        "http://jaeger:4318 (an alias of OTEL_EXPORTER_OTLP_ENDPOINT; the OTEL_* "
                                        "variables are read too)")


def load_or_exit(cls: type[S], argv: Sequence[str] | None, *, prog: str, description: str,
                 env: Mapping[str, str] | None = None, parser: argparse.ArgumentParser | None = None,
                 ) -> tuple[S, argparse.Namespace]:
    """Parse ``argv`` (``--help``, ``--config FILE`` and whatever ``parser`` adds), then load ``cls``; on invalid
    settings print each problem and exit 2. Returns the settings and the parsed arguments."""
    parser = parser or argparse.ArgumentParser()
    parser.prog, parser.description = prog, description
    parser.epilog = cls.environment_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"settings file (TOML or JSON); the environment wins over it [${CONFIG_FILE_VARIABLE}]")
    args = parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    try:
        return cls.load(env, args.config), args
    except SettingsError as exc:
        parser.error("invalid settings:\n  " + "\n  ".join(exc.problems))


def _describe(cls: type[ProgramSettings], error: Any) -> str:
    loc = error.get("loc") or ()
    if not loc:  # a model validator's: its message names the variables
        return str(error.get("msg", "invalid settings")).removeprefix("Value error, ")
    fields = cls.model_fields
    where = str(loc[0])
    for name, info in fields.items():
        if where in (name, variable_of(info, name)):
            where = variable_of(info, name)
            break
    message = str(error.get("msg", "invalid"))
    if "input" in error and error.get("type") != "missing" and not isinstance(error["input"], dict):
        message += f" (got {error['input']!r})"
    return f"{where}: {message}"


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "unset"
    return str(value)


__all__ = ["CONFIG_FILE_VARIABLE", "ProgramSettings", "ServiceSettings", "SettingsError", "load_or_exit", "setting",
           "variable_of"]
