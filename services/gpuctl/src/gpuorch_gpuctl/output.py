"""How gpuctl prints what it read: ``-o json|yaml|wide``, ``--json`` (= ``-o json``), ``--no-headers``.

    emit(rows, columns, fmt)      rows: the API's JSON objects; columns: (header, cell function, wide only?)
        json / yaml   the rows as the API gave them (every field, for scripts)
        table / wide  a rich table of the columns (wide adds the wide-only ones); piped, it is never cut to 80
                      columns (the console is as wide as the longest line) and drawn without box characters
    AlignedRows(columns, rows)    the same columns as plain fixed-width lines, for a listing that goes on (``-w``):
                                  rows printed later line up with the first ones
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import typer
import yaml
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


class Format(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"
    wide = "wide"


OutputOpt = Annotated[Format, typer.Option("--output", "-o", help="table, wide, json or yaml")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts (same as -o json)")]
NoHeadersOpt = Annotated[bool, typer.Option("--no-headers", help="tables without their header line")]


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict[str, Any]], str]
    wide_only: bool = False


def console() -> Console:
    """stdout; when it is not a terminal, wide enough that no table is cut or wrapped."""
    if sys.stdout.isatty():
        return Console(emoji=False)
    return Console(emoji=False, width=100_000, no_color=True, highlight=False)


def table_box() -> box.Box | None:
    """Tables on a terminal have their box; piped, none (no box-drawing characters in a script's input)."""
    return box.HEAVY_HEAD if sys.stdout.isatty() else None


def chosen(fmt: Format, as_json: bool) -> Format:
    return Format.json if as_json else fmt


def dump(data: Any, fmt: Format) -> None:
    """JSON (one line) or YAML of ``data`` on stdout."""
    if fmt == Format.yaml:
        print(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False), end="")
    else:
        print(json.dumps(data, default=str))


def emit(rows: Sequence[dict[str, Any]], columns: Sequence[Column], fmt: Format, *, no_headers: bool = False,
         title: str | None = None, out: Console | None = None) -> None:
    """Print ``rows`` as ``fmt`` asks; tables go to ``out`` (default: a new ``console()``)."""
    if fmt in (Format.json, Format.yaml):
        dump(list(rows), fmt)
        return
    (out or console()).print(table(rows, columns, wide=fmt == Format.wide, no_headers=no_headers, title=title))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], *, wide: bool = False,
          no_headers: bool = False, title: str | None = None) -> Table:
    shown = [c for c in columns if wide or not c.wide_only]
    out = Table(*(c.header for c in shown), show_header=not no_headers, title=title, box=None if no_headers else
                table_box(), pad_edge=False)
    for row in rows:
        out.add_row(*(c.cell(row) for c in shown))
    return out


class AlignedRows:
    """Rows as plain lines of fixed-width columns (markup removed), kubectl get -w's way: the widths are set by the
    header and the first rows; a later cell that is wider widens its column from then on."""

    def __init__(self, columns: Sequence[Column], rows: Sequence[dict[str, Any]], *, wide: bool = False) -> None:
        self.columns = [c for c in columns if wide or not c.wide_only]
        self.widths = [len(c.header) for c in self.columns]
        for row in rows:
            self._widen(self._cells(row))

    def _cells(self, row: dict[str, Any]) -> list[str]:
        return [Text.from_markup(c.cell(row)).plain for c in self.columns]

    def _widen(self, cells: list[str]) -> None:
        self.widths = [max(w, len(text)) for w, text in zip(self.widths, cells, strict=True)]

    def _line(self, cells: list[str]) -> str:
        return "  ".join(text.ljust(w) for text, w in zip(cells, self.widths, strict=True)).rstrip()

    def header(self) -> str:
        return self._line([c.header for c in self.columns])

    def line(self, row: dict[str, Any]) -> str:
        cells = self._cells(row)
        self._widen(cells)
        return self._line(cells)
