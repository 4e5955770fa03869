"""gpuctl schema: write the JSON Schema of every message and the AsyncAPI document of the public contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

schema_app = typer.Typer(help="Export message schemas (JSON Schema, AsyncAPI).", no_args_is_help=True)


@schema_app.command("export")
def export(
    out: Annotated[Path, typer.Option(help="directory to write into")] = Path("libs/contracts/schemas"),
    as_json: Annotated[bool, typer.Option("--json", help="print the written file list as JSON")] = False,
) -> None:
    """Write <type>.schema.json for every message and asyncapi.json; the checked-in copies must match."""
    from gpuorch_contracts.schemas import write_schemas

    written = write_schemas(out)
    print(json.dumps([str(p) for p in written]) if as_json else "\n".join(str(p) for p in written))
