"""``gpuctl bench``: the scheduler at fleet scale, measured against the real RabbitMQ and PostgreSQL (e2e, curve,
recovery) or in process on its Harness (core, capacity, mig).

Commands and where each lives::

    e2e       SubmitJob -> LaunchJob through gpuorch-scheduler on a simulated fleet, beside the raw broker
              baseline and the bare broker+database floor                        (bench_e2e, bench_baselines)
    curve     e2e at each fleet size ─> table + PNG                              (bench_e2e, bench_tables)
    recovery  gpuorch-scheduler restarted on a long synthetic log, with and without a snapshot  (bench_recovery)
    core      the scheduler's step in process on its Harness, no broker, no database   (bench_core)
    capacity  a simulated day through the Harness: autoscaled vs fixed fleets  (bench_capacity_cmd, gpuorch_capacity)
    mig       a simulated day through the Harness: static MIG layouts vs the planner (bench_mig_cmd, gpuorch_capacity)
    relay, floor-hop   (hidden) the middle processes of the raw baseline and the floor

(``capacity`` and ``mig`` join this group when it is loaded: ``commands._bench_extras``.)

Shared pieces: ``bench_scratch`` (scratch vhost and database, progress, CPU/RSS of a process tree),
``bench_traffic`` (paced publisher, receivers, percentiles), ``bench_tables`` (tables and the PNG).

Contract: every command that uses the broker and the database (e2e, curve, recovery) creates its own RabbitMQ vhost
and PostgreSQL database(s), drops them and stops every process it started when it ends (also on failure or Ctrl-C),
and stops by itself (``--timeout-s``); the in-process ones start nothing. ``--json`` prints exactly one JSON object
on stdout; progress goes to stderr. Figures of e2e, curve, recovery and core are measurements of this machine at this
moment: the load average is part of each result (``core`` reports CPU time beside the wall clock); ``capacity`` and
``mig`` report simulated figures, the same for the same seed. Nothing here asserts a speed.

gpuctl imports no service: the scheduler and the simulated fleet run as processes (their console scripts), and
are measured from /proc and read from their logs and read models. ``core``, ``capacity`` and ``mig`` import
``gpuorch_scheduling`` (a library) and ``gpuorch_capacity``, never the service.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from gpuorch_gpuctl.errors import fail

from gpuorch_gpuctl_ops.bench_scratch import (
    DEFAULT_AMQP,
    DEFAULT_AMQP_ADMIN,
    DEFAULT_PG_ADMIN,
    ScratchServers,
    machine,
    progress,
)
from gpuorch_gpuctl_ops.bench_tables import CORE_COLUMNS, CURVE_COLUMNS, E2E_COLUMNS, RECOVERY_COLUMNS, print_table

bench_app = typer.Typer(help="Benchmarks of the scheduler: against the real broker and database (e2e, curve, recovery) "
                        "or in process on its Harness (core, capacity, mig); see docs/PERFORMANCE.md.",
                        no_args_is_help=True)


@bench_app.callback()
def _quiet_logs() -> None:
    """Library logs (the broker adapter, the store) go to stderr at warning: stdout is for results."""
    from gpuorch_observability import configure_logging

    configure_logging("gpuctl-bench", "WARNING")


AmqpOpt = Annotated[str, typer.Option("--amqp", envvar="GPUORCH_BENCH_AMQP",
                                      help="RabbitMQ URL without a vhost (a scratch vhost is created)")]
AmqpAdminOpt = Annotated[str, typer.Option("--amqp-admin", envvar="GPUORCH_TEST_AMQP_ADMIN",
                                           help="RabbitMQ management API URL (creates and deletes the vhost)")]
PgAdminOpt = Annotated[str, typer.Option("--pg-admin", envvar="GPUORCH_TEST_PG_ADMIN",
                                         help="PostgreSQL admin DSN (creates and drops the scratch database)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object for scripts")]


@bench_app.command()
def e2e(
    nodes: Annotated[int, typer.Option(min=1, help="simulated h100x8 nodes")] = 1000,
    rate: Annotated[float, typer.Option(min=0.1, help="SubmitJob messages offered per second")] = 500.0,
    jobs: Annotated[int, typer.Option(min=1, help="one-GPU jobs to submit (at most 8 x nodes)")] = 5000,
    timeout_s: Annotated[float, typer.Option(help="stop waiting for launches this many seconds after the first "
                                                  "submit; the figures of what arrived are reported")] = 600.0,
    register_timeout_s: Annotated[float, typer.Option(help="fail if the scheduler does not know every node by "
                                                           "then")] = 600.0,
    idle_s: Annotated[float, typer.Option(help="seconds of heartbeats only, before submitting, to measure the "
                                               "scheduler's idle CPU")] = 5.0,
    raw: Annotated[bool, typer.Option(help="also measure the bare two-hop broker baseline")] = True,
    floor: Annotated[bool, typer.Option(help="also measure the bare broker+database floor (the scheduler's path "
                                             "with no scheduling)")] = True,
    heartbeat_s: Annotated[float, typer.Option(help="seconds between heartbeats of each simulated node")] = 10.0,
    fleet_nice: Annotated[int, typer.Option(
        min=0, max=19, help="niceness of the simulated fleet's process (it stands in for remote machines: above 0 it "
                            "takes the CPU the measured services leave; its own CPU is reported either way)")] = 0,
    scheduler_log_level: Annotated[str, typer.Option(help="the scheduler's GPUORCH_LOG_LEVEL")] = "WARNING",
    amqp: AmqpOpt = DEFAULT_AMQP,
    amqp_admin: AmqpAdminOpt = DEFAULT_AMQP_ADMIN,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """Submit -> LaunchJob through the real scheduler on a simulated fleet, beside the raw broker baseline and the
    bare broker+database floor.

    Keys: nodes, offered_per_s, jobs, placed, placements_per_s (placed / (last LaunchJob - first submit)),
    p50_ms/p90_ms/p99_ms (submit -> LaunchJob received); raw_p50_ms/raw_p99_ms and overhead_ratio_p50/p99 (the
    bare two broker hops); floor_placements_per_s, floor_p50_ms/floor_p99_ms, floor_cpu_ms_per_message and
    floor_ratio = placements_per_s / floor_placements_per_s (the floor: consume from a quorum queue in batches,
    commit one event row and one outbox row per message, publish with confirms, receive); the scheduler's CPU
    seconds over the submit window and cpu_ms_per_message (that CPU / jobs; includes the heartbeats and ticks of
    the window; cpu_ms_per_message_net subtracts the idle rate, scheduler_idle_cpu_pct, measured over --idle-s
    before submitting; idle_cpu_ms_per_node_s is that idle rate per node; relay_cpu_ms_per_message is the part of
    its outbox-relay child), its peak RSS (MiB), and the simulated fleet's own CPU (fleet_idle_cpu_pct over
    --idle-s, fleet_cpu_pct over the submit window; % of one core). What else shares the machine, over the submit
    window and (idle_ prefix) over --idle-s: machine_busy_pct (% of all cores), broker_cpu_pct and
    database_cpu_pct (a local RabbitMQ and PostgreSQL, % of one core; null when not local) and bench_cpu_pct (this
    command's publisher and receiver, submit window only).
    """
    from gpuorch_gpuctl_ops.bench_e2e import E2eParameters, run_e2e

    params = E2eParameters(nodes=nodes, rate=rate, jobs=jobs, timeout_s=timeout_s, idle_s=idle_s,
                           register_timeout_s=register_timeout_s, heartbeat_s=heartbeat_s, fleet_nice=fleet_nice,
                           scheduler_log_level=scheduler_log_level, raw=raw, floor=floor)
    try:
        result = run_e2e(params, ScratchServers(amqp, amqp_admin, pg_admin))
    except (ValueError, TimeoutError, RuntimeError) as exc:
        fail(f"bench e2e failed: {exc}")
    if as_json:
        print(json.dumps(result))
    else:
        print_table([result], E2E_COLUMNS, "gpuctl bench e2e")


@bench_app.command()
def curve(
    nodes: Annotated[str, typer.Option(help="fleet sizes, comma-separated")] = "100,1000,5000,10000",
    rate: Annotated[float, typer.Option(min=0.1, help="SubmitJob messages offered per second")] = 200.0,
    jobs: Annotated[int, typer.Option(min=1, help="jobs per point (capped at the fleet's GPUs)")] = 2000,
    timeout_s: Annotated[float, typer.Option(help="per point, as in `bench e2e`")] = 600.0,
    register_timeout_s: Annotated[float, typer.Option(help="per point, as in `bench e2e`")] = 600.0,
    png: Annotated[Path | None, typer.Option(help="write the curve as a PNG here")] = Path("docs/img/cost_curve.png"),
    label: Annotated[str, typer.Option(help="words added to the PNG's title (e.g. which scheduler)")] = "",
    scheduler_log_level: Annotated[str, typer.Option(help="the scheduler's GPUORCH_LOG_LEVEL")] = "WARNING",
    amqp: AmqpOpt = DEFAULT_AMQP,
    amqp_admin: AmqpAdminOpt = DEFAULT_AMQP_ADMIN,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """The cost curve: `bench e2e` at each fleet size, fixed rate; per-message scheduler CPU, latency and RSS (with
    the raw baseline, without the floor)."""
    from gpuorch_gpuctl_ops.bench_e2e import GPUS_PER_NODE, E2eParameters, run_e2e
    from gpuorch_gpuctl_ops.bench_tables import write_curve_png

    servers = ScratchServers(amqp, amqp_admin, pg_admin)
    sizes = [int(n) for n in nodes.split(",") if n.strip()]
    points = []
    for size in sizes:
        params = E2eParameters(nodes=size, rate=rate, jobs=min(jobs, size * GPUS_PER_NODE), timeout_s=timeout_s,
                               register_timeout_s=register_timeout_s, scheduler_log_level=scheduler_log_level,
                               floor=False)
        try:
            points.append(run_e2e(params, servers))
        except (ValueError, TimeoutError, RuntimeError) as exc:
            progress(f"curve: {size} nodes failed: {exc}")
            points.append({"nodes": size, "jobs": params.jobs, "offered_per_s": rate, "error": str(exc)})
    measured = [p for p in points if "error" not in p and p.get("p50_ms") is not None]
    if png is not None and measured:
        write_curve_png(measured, png, f"scheduler cost by fleet size ({rate:g} one-GPU SubmitJob/s, "
                                       f"{time.strftime('%Y-%m-%d')}){' ' + label if label else ''}")
        progress(f"curve: wrote {png}")
    if as_json:
        print(json.dumps({"rate": rate, "points": points, "png": str(png) if png else None}))
    else:
        print_table(points, CURVE_COLUMNS, "gpuctl bench curve")


@bench_app.command()
def recovery(
    events: Annotated[int, typer.Option(min=1, help="events in the synthetic log")] = 1_000_000,
    nodes: Annotated[int, typer.Option(min=1, help="nodes registered at the start of the history")] = 1000,
    running: Annotated[int, typer.Option(min=0, help="jobs running at any moment of the history")] = 4000,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each recovery; the median is reported")] = 3,
    timeout_s: Annotated[float, typer.Option(help="fail if one start of the scheduler takes longer to recover "
                                                  "(and store its snapshot)")] = 900.0,
    amqp: AmqpOpt = DEFAULT_AMQP,
    amqp_admin: AmqpAdminOpt = DEFAULT_AMQP_ADMIN,
    pg_admin: PgAdminOpt = DEFAULT_PG_ADMIN,
    as_json: JsonOpt = False,
) -> None:
    """Scheduler restart time from a log of --events events: without a snapshot, then from a snapshot.

    The history (``synthetic_history``): node registrations, then one-GPU jobs accepted -> placed -> started ->
    finished, written with COPY in the rows the store's append writes. The real gpuorch-scheduler is started on
    it (a process; a scratch vhost for its broker) and timed until it logs ``scheduler.recovered``:
    recover_*_s is the recovery itself, restart_*_s from process start (see ``bench_recovery``). The last run
    without a snapshot leaves the service to store its own snapshot, which the runs after it recover from.
    ``state_jobs``/``state_nodes`` are what the service recovered (a scheduler that forgets finished jobs holds
    fewer jobs than the log has).
    """
    from gpuorch_gpuctl_ops.bench_e2e import GPUS_PER_NODE
    from gpuorch_gpuctl_ops.bench_recovery import HistoryShape, run_recovery

    before = machine()
    shape = HistoryShape(events=events, nodes=nodes, running=min(running, nodes * GPUS_PER_NODE))
    try:
        result = run_recovery(shape, repeats, ScratchServers(amqp, amqp_admin, pg_admin), timeout_s)
    except (TimeoutError, RuntimeError) as exc:
        fail(f"bench recovery failed: {exc}")
    result.update({"nodes": nodes, "load_avg_1m_start": before["load_avg_1m"],
                   "load_avg_1m_end": machine()["load_avg_1m"], "cpus": before["cpus"]})
    if as_json:
        print(json.dumps(result))
    else:
        print_table([result], RECOVERY_COLUMNS, "gpuctl bench recovery")


@bench_app.command()
def core(
    nodes: Annotated[str, typer.Option(help="comma-separated fleet sizes (h100x8 nodes)")] = "1000,10000",
    jobs: Annotated[int, typer.Option(min=1, help="one-GPU jobs per fleet size (at most 8 x nodes)")] = 10_000,
    repeats: Annotated[int, typer.Option(min=1, help="runs per fleet size; medians are reported")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """The scheduler's step in process, on its Harness (no broker, no database): one-GPU jobs onto N x 8 GPUs, the
    shape of Armada's scheduler benchmark. Keys per fleet size: placements_per_s (one cycle and the plan applier
    deciding every job; placements_per_cpu_s the same per second of CPU time), step_placements_per_s (the whole step, admission included) and engine_placements_per_s
    (the placement engine alone)."""
    from gpuorch_gpuctl_ops.bench_core import run_core

    sizes = [int(n) for n in nodes.split(",") if n.strip()]
    rows = []
    for size in sizes:
        progress(f"core: {size} nodes, {min(jobs, size * 8)} jobs, {repeats} runs")
        rows += run_core([size], jobs, repeats)
    result = {"machine": machine(), "load_avg_1m": round(os.getloadavg()[0], 2), "fleets": rows}
    if as_json:
        print(json.dumps(result))
        return
    print_table(rows, CORE_COLUMNS, "The scheduler's step in process (medians)")


@bench_app.command("relay", hidden=True)
def relay(amqp_url: str, duration_s: float = 600.0) -> None:
    """The raw baseline's relay process (started by ``bench e2e``; stops after ``duration_s``)."""
    from gpuorch_gpuctl_ops.bench_baselines import relay_hop

    asyncio.run(relay_hop(amqp_url, duration_s))


@bench_app.command("floor-hop", hidden=True)
def floor_hop(amqp_url: str, dsn: str, duration_s: float = 600.0) -> None:
    """The floor's middle process (started by ``bench e2e``; stops after ``duration_s``)."""
    from gpuorch_gpuctl_ops.bench_baselines import floor_hop as hop

    asyncio.run(hop(amqp_url, dsn, duration_s))
