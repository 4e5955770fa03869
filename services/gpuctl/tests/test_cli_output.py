"""What gpuctl prints, without a server: GPU counts (not indices), ``-w`` rows lined up with the listing, ``top``
within a 24-line terminal, no box-drawing characters when stdout is not a terminal (as under pytest)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuorch_gpuctl.cli import JOB_COLUMNS
from gpuorch_gpuctl.output import AlignedRows
from gpuorch_gpuctl.top_cmd import _lines, frame, gpu_count
from gpuorch_gpuctl_ops.jobs_view import allocated_gpus, gpu_text
from rich.console import Console

NOW = datetime.now(UTC)
BOX_DRAWING = {chr(c) for c in range(0x2500, 0x2580)}


def job(name: str, held: float, ids: str, state: str = "running") -> dict[str, object]:
    return {"id": f"{name:0<8}-0000-0000-0000-000000000000", "name": name, "tenant": "acme", "tier": "training",
            "state": state, "nodes": ["node-1"] if held else [], "gpus": ids, "allocated_gpus": held,
            "exit_code": None, "array_counts": None, "array_index": None, "submitted_at": NOW.isoformat(),
            "started_at": (NOW - timedelta(minutes=5)).isoformat(), "estimated_start": None,
            "pending_reason": None, "reason": None, "priority_class": "normal"}


def test_the_gpus_column_counts_gpus_and_the_wide_one_names_them() -> None:
    assert [gpu_count(job("a", 1.0, "0")), gpu_count(job("b", 2.0, "0,1")), gpu_count(job("c", 0.25, "2:250m")),
            gpu_count(job("d", 0.0, "-", "queued"))] == ["1", "2", "0.25", "-"]
    cells = {c.header: c.cell(job("one-gpu", 1.0, "0")) for c in JOB_COLUMNS}
    assert (cells["gpus"], cells["gpu ids"]) == ("1", "0")  # "0" was the index, read as zero GPUs


def test_watched_rows_line_up_with_the_listing_even_when_a_later_cell_is_longer() -> None:
    aligned = AlignedRows(JOB_COLUMNS, [job("short", 1.0, "0")])
    lines = [aligned.header(), aligned.line(job("short", 1.0, "0")),
             aligned.line(job("a-much-longer-name", 2.0, "0,1", "succeeded"))]
    starts = [[line.index(word) for word in (words[0], words[4])] for line, words in
              ((line, line.split()) for line in lines)]
    assert starts[0] == starts[1]  # the header and the first row: state starts at the same column
    assert "[" not in "".join(lines)  # no rich markup left


def test_top_fits_a_24_line_terminal_and_counts_what_it_leaves_out() -> None:
    gpu = {"index": 0, "model": "A100", "utilization_pct": 50.0, "memory_used_mib": 1, "memory_total_mib": 80,
           "temperature_c": 40.0, "health": "healthy", "jobs": [], "mig_slices": []}
    nodes = [{"node_id": f"node-{n}", "liveness": "alive", "gpus": [{**gpu, "index": i} for i in range(8)]}
             for n in range(4)]
    queues = [{"tier": t, "depth": 0, "oldest_wait_s": None, "pending_reasons": []}
              for t in ("training", "inference", "batch")]
    running = [job(f"job{i}", 1.0, "0") for i in range(20)]
    shown = frame(nodes, queues, running, NOW, height=23)
    assert _lines(shown) <= 23 < _lines(frame(nodes, queues, running, NOW))
    text = Console(width=200, file=__import__("io").StringIO(), no_color=True)
    text.print(shown)
    printed = text.file.getvalue()  # type: ignore[attr-defined]
    assert "more" in printed and "top jobs by GPU-hours" in printed and "queues" in printed
    assert not BOX_DRAWING & set(printed)  # not a terminal: no box characters


def test_describe_counts_a_mig_slice_as_its_fraction_of_the_gpu() -> None:
    row = {"assignments": '[{"node_id": "n1", "gpus": [{"gpu_uuid": "MIG-a", "gpu_index": 0, "milli": 1000, '
                          '"mig_profile": "3g.40gb"}]}]'}
    assert (allocated_gpus(row), gpu_text(row)) == (0.429, "0:3g.40gb")  # 3 of 7 compute slices, not 1.0
