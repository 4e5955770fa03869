"""How ``gpuctl bench`` shows its results without ``--json``: the columns of each command's table, and the cost
curve's PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

E2E_COLUMNS = ("nodes", "offered_per_s", "jobs", "placed", "placements_per_s", "p50_ms", "p99_ms", "raw_p50_ms",
               "raw_p99_ms", "overhead_ratio_p50", "floor_placements_per_s", "floor_p50_ms", "floor_p99_ms",
               "floor_ratio", "cpu_ms_per_message", "relay_cpu_ms_per_message", "scheduler_idle_cpu_pct", "fleet_cpu_pct",
               "scheduler_rss_mib", "load_avg_1m_start")
CURVE_COLUMNS = ("nodes", "jobs", "offered_per_s", "placements_per_s", "cpu_ms_per_message", "cpu_ms_per_message_net",
                 "scheduler_idle_cpu_pct", "p50_ms", "p99_ms", "raw_p50_ms", "scheduler_rss_mib", "load_avg_1m_start")
RECOVERY_COLUMNS = ("events", "nodes", "jobs_in_log", "recover_no_snapshot_s", "recover_snapshot_s",
                    "restart_no_snapshot_s", "restart_snapshot_s", "state_jobs_without_snapshot", "state_jobs",
                    "state_nodes", "snapshot_mib_stored", "snapshot_error", "fill_s", "load_avg_1m_start")
CORE_COLUMNS = ("nodes", "gpus", "jobs", "placed", "placements_per_s", "placements_per_cpu_s", "step_placements_per_s",
                "engine_placements_per_s", "repeats")


def print_table(rows: list[dict[str, Any]], columns: Sequence[str], title: str) -> None:
    """A rich table on stdout, ``-`` for a missing value."""
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console().print(table)


def write_curve_png(points: list[dict[str, Any]], path: Path, title: str) -> None:
    """Three panels against fleet size (log scale): CPU ms per message, p50/p99 latency, scheduler RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [p["nodes"] for p in points]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    axes[0].plot(nodes, [p["cpu_ms_per_message"] for p in points], "o-", label="all CPU in the window")
    axes[0].plot(nodes, [p.get("cpu_ms_per_message_net") for p in points], "s--", label="less idle (heartbeats)")
    axes[0].set_ylabel("scheduler CPU ms per SubmitJob")
    axes[0].legend()
    axes[1].plot(nodes, [p["p50_ms"] for p in points], "o-", label="p50")
    axes[1].plot(nodes, [p["p99_ms"] for p in points], "s--", label="p99")
    axes[1].plot(nodes, [p.get("raw_p50_ms") for p in points], "^:", label="raw broker p50")
    axes[1].set_ylabel("submit -> LaunchJob ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    axes[2].plot(nodes, [p["scheduler_rss_mib"] for p in points], "o-")
    axes[2].set_ylabel("scheduler RSS MiB (peak in run)")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xlabel("nodes (8 GPUs each)")
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
