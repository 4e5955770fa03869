"""gpuctl prints fleet text safely: rich markup escaped, terminal escape sequences neutralised.

The table tests run the real commands (``gpuctl jobs``, ``gpuctl nodes``, ``gpuctl describe``, ``gpuctl logs``)
against a real PostgreSQL database holding hostile names, reasons and logs, written straight into the read models
(as rows already stored before the contracts refused such text would be).
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from gpuorch_contracts.text import strip_terminal_controls
from gpuorch_gpuctl import cli
from gpuorch_gpuctl.terminal_text import cell, log_output, markup, neutralised
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

OSC_HYPERLINK = "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\"
OSC_CLIPBOARD = "\x1b]52;c;cm0gLXJmIC8=\x07"
CLEAR_SCREEN = "\x1b[2J\x1b[H"
HOSTILE_NAME = "[/]"
HOSTILE_REASON = f"[bold red]boom[/] {OSC_HYPERLINK}{OSC_CLIPBOARD}{CLEAR_SCREEN}\x9b31m\u202eevil:smile:"
TERMINAL_ATTACKS = re.compile("\x1b\\]|\x1b\\[[0-9;]*[JHK]|\x9b|\x9d|\u202e|\x07")


def test_neutralised_shows_every_control_character_as_its_escape() -> None:
    assert neutralised("a\x1b[31mb\x00c\x9bd\u202ee\x7f") == "a\\x1b[31mb\\x00c\\x9bd\\u202ee\\x7f"
    assert neutralised("line 1\n\tline 2") == "line 1\n\tline 2"
    assert neutralised("line 1\n\tline 2", one_line=True) == "line 1  line 2"
    assert neutralised(None) == ""


def test_cell_and_markup_escape_rich_markup() -> None:
    for render in (cell, markup):
        out = io.StringIO()
        Console(file=out, width=200, emoji=False).print(render(HOSTILE_NAME + " [bold]x[/bold] \\[y]"))
        assert out.getvalue().rstrip("\n") == "[/] [bold]x[/bold] \\[y]"


def test_log_output_removes_escape_sequences() -> None:
    assert log_output(f"\x1b[32mok\x1b[0m {OSC_HYPERLINK} {OSC_CLIPBOARD}done\n") == "ok click done\n"


@pytest.fixture
def read_models(pg_dsn: str) -> Iterator[tuple[str, uuid.UUID]]:
    """A migrated database holding one job and one node whose every text field is hostile."""
    from gpuorch_store.migrations import migrate

    job_id = uuid.uuid4()

    async def fill() -> None:
        await migrate(pg_dsn)
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(
                """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, node_ids, reason,
                                     pending_reason, submitted_at, log_path)
                   VALUES ($1, $2, $3, 'batch', 'normal', $4, $5::jsonb, $6, $7, NULL, $8, $9)""",
                job_id, HOSTILE_NAME, f"[red]{CLEAR_SCREEN}", "failed",
                json.dumps({"name": HOSTILE_NAME, "labels": {"x": OSC_CLIPBOARD}}),
                [f"node-[/]{OSC_HYPERLINK}"], HOSTILE_REASON, datetime.now(UTC), None,
            )
            await conn.execute(
                "INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ($1, $2, $3::jsonb, 'h')",
                f"n[/]{OSC_CLIPBOARD}", "[/]", json.dumps({"gpus": [{"model": f"A100[/]{CLEAR_SCREEN}"}]}),
            )
        finally:
            await conn.close()

    asyncio.run(fill())
    yield pg_dsn, job_id


@pytest.fixture(params=[False, True], ids=["pipe", "terminal"])
def captured(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """gpuctl's consoles writing to a buffer, as to a pipe or (colours on) to a terminal."""
    out = io.StringIO()
    console = Console(file=out, width=400, emoji=False, force_terminal=request.param, color_system="standard")
    monkeypatch.setattr(cli, "console", console)
    monkeypatch.setattr(cli, "err", console)
    return out


def _assert_safe(text: str) -> None:
    found = TERMINAL_ATTACKS.findall(text)
    assert found == [], f"terminal controls reached the output: {found!r}"


@pytest.mark.integration
def test_gpuctl_jobs_shows_markup_and_escape_sequences_as_text(read_models: tuple[str, uuid.UUID],
                                                              captured: io.StringIO) -> None:
    dsn, _ = read_models
    result = CliRunner().invoke(cli.app, ["jobs", "--dsn", dsn])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    text = captured.getvalue()
    _assert_safe(text)
    plain = re.sub("\x1b\\[[0-9;]*m", "", text)  # rich's own colours, when on a terminal
    assert " [/] " in plain
    assert "[bold red]boom[/]" in plain
    assert "\\x1b]8;;https://evil.example" in plain


@pytest.mark.integration
def test_gpuctl_nodes_and_describe_neutralise_too(read_models: tuple[str, uuid.UUID], captured: io.StringIO) -> None:
    dsn, job_id = read_models
    nodes = CliRunner().invoke(cli.app, ["nodes", "--dsn", dsn])
    assert nodes.exit_code == 0, f"{nodes.output}\n{nodes.exception!r}"
    described = CliRunner().invoke(cli.app, ["describe", str(job_id), "--dsn", dsn])
    assert described.exit_code == 0, f"{described.output}\n{described.exception!r}"
    text = captured.getvalue()
    _assert_safe(text)
    plain = re.sub("\x1b\\[[0-9;]*m", "", text)
    assert "n[/]\\x1b]52;c;" in plain and "A100[/]\\x1b[2J" in plain
    assert "[bold red]boom[/]" in plain and "\\u202eevil:smile:" in plain


@pytest.mark.integration
def test_gpuctl_logs_strips_escape_sequences_from_job_output(read_models: tuple[str, uuid.UUID],
                                                             tmp_path: Path) -> None:
    dsn, job_id = read_models
    log = tmp_path / "job.log"
    log.write_text(f"\x1b[31mError\x1b[0m {OSC_HYPERLINK}\n{OSC_CLIPBOARD}{CLEAR_SCREEN}done [/]\n")

    async def point_at_log() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("UPDATE jobs SET log_path = $1 WHERE job_id = $2", str(log), job_id)
        finally:
            await conn.close()

    asyncio.run(point_at_log())
    result = CliRunner().invoke(cli.app, ["logs", str(job_id), "--dsn", dsn])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert result.stdout == "Error click\ndone [/]\n"
    raw = CliRunner().invoke(cli.app, ["logs", str(job_id), "--dsn", dsn, "--json"])
    assert json.loads(raw.stdout)["text"] == log.read_text()  # JSON escapes control characters itself


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(["\x1b[", "\x1b]", "\x1b\\", "\x07", "\x9b", "\x9d", "\x90", "\r", "\r\n",
                                          "\n", "\t", "\u202e", "\x00", "31m", ";", "P", "[", "\x9c"]),
                          st.text(max_size=4)), max_size=30))
def test_log_output_strips_exactly_what_the_contracts_strip(parts: list[str]) -> None:
    """The thin client holds its own copy of ``strip_terminal_controls`` (it does not depend on the contracts)."""
    text = "".join(parts)
    assert log_output(text) == strip_terminal_controls(text)
