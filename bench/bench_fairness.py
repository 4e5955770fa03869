"""Fair over time and space, on the Harness (the scheduler's own cycle, simulated clock and fleet):

    uv run python bench/bench_fairness.py                    # both parts, markdown tables on stdout
    uv run python bench/bench_fairness.py --part topology --racks 8 --nodes-per-rack 8 --gangs 300 --seeds 1 2 3
    uv run python bench/bench_fairness.py --part reservation

topology     a fleet of racks (8-GPU nodes labelled ``topology.gpuorch.io/rack``), gangs of 2-8 nodes x 8 GPUs among
             single-node jobs; the same workload three ways: topology-blind, ``gang.topology: {preferred: rack}`` and
             ``{required: rack}``. Reported: gangs placed inside one rack (%), racks per gang (mean), gang wait (mean,
             p95) and every job's wait (mean), makespan.
reservation  six busy 8-GPU nodes, a 16-GPU reservation for 2 h starting 3 h in: GPU-hours other tenants' jobs used on
             the reserved GPUs before the start (backfill), GPUs of other tenants still there at the start, how late
             the tenant's job started.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from gpuorch_contracts import (  # noqa: E402
    TOPOLOGY_LABEL_PREFIX,
    CreateReservation,
    GpuRequest,
    JobSpec,
    NodeInventory,
    ProcessRun,
)
from gpuorch_scheduling.harness import Harness, SimJob  # noqa: E402
from gpuorch_scheduling.reservations import borrowed_gpus  # noqa: E402
from gpuorch_scheduling.testing import registered_node  # noqa: E402

RUN = ProcessRun(argv=["python", "train.py"])
HOUR = 3600.0


def rack_fleet(h: Harness, racks: int, per_rack: int) -> dict[str, str]:
    """Nodes ``r<k>-n<j>`` with 8 GPUs each, labelled with their rack; node -> rack."""
    rack_of = {}
    for r in range(racks):
        for n in range(per_rack):
            node_id = f"r{r}-n{n}"
            inventory = registered_node(node_id, gpus=8, model="H100").inventory
            labelled = NodeInventory.model_validate({**inventory.model_dump(),
                                                     "labels": {TOPOLOGY_LABEL_PREFIX + "rack": f"rack-{r}"}})
            h.add_node(labelled)
            rack_of[node_id] = f"rack-{r}"
    return rack_of


def topology_run(mode: str, racks: int, per_rack: int, gangs: int, seed: int) -> dict[str, float]:
    h = Harness(keep_steps=True, tick_s=30.0, heartbeat_s=30.0, seed=seed)
    rack_of = rack_fleet(h, racks, per_rack)
    rnd = random.Random(seed)
    span = gangs * 240.0
    gang_jobs: list[SimJob] = []
    all_jobs: list[SimJob] = []
    for _ in range(gangs):
        nodes = rnd.choice([2, 2, 4, 4, 8])
        gang: dict[str, object] = {"nodes": nodes}
        if mode != "blind":
            gang["topology"] = {mode: "rack"}
        runtime = rnd.uniform(0.5, 2.0) * HOUR
        job = h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=8), gang=gang, runtime_estimate_s=runtime),  # type: ignore[arg-type]
                       at=rnd.uniform(0, span), runtime_s=runtime)
        gang_jobs.append(job)
        all_jobs.append(job)
    for _ in range(gangs * 3):
        runtime = rnd.uniform(0.2, 1.5) * HOUR
        all_jobs.append(h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=rnd.choice([1, 2, 4, 8])),
                                         runtime_estimate_s=runtime), at=rnd.uniform(0, span), runtime_s=runtime))
    h.run()
    placed = {}
    for event in h.logged():
        if event.TYPE == "job.placed" and event.job_id not in placed:  # type: ignore[attr-defined]
            placed[event.job_id] = {rack_of[a.node_id] for a in event.assignments}  # type: ignore[attr-defined]
    racks_used = [len(placed[j.job_id]) for j in gang_jobs if j.job_id in placed]
    gang_waits = sorted(j.wait_s or 0.0 for j in gang_jobs if j.wait_s is not None)
    waits = [j.wait_s for j in all_jobs if j.wait_s is not None]
    return {
        "one_rack_pct": 100.0 * sum(1 for n in racks_used if n == 1) / max(1, len(racks_used)),
        "racks_per_gang": statistics.mean(racks_used) if racks_used else 0.0,
        "gang_wait_mean_s": statistics.mean(gang_waits) if gang_waits else 0.0,
        "gang_wait_p95_s": gang_waits[int(0.95 * (len(gang_waits) - 1))] if gang_waits else 0.0,
        "job_wait_mean_s": statistics.mean(waits) if waits else 0.0,
        "makespan_h": max((j.ended_at or 0.0) for j in all_jobs) / HOUR,
        "unfinished": sum(1 for j in all_jobs if j.state != "succeeded"),
    }


def topology_part(racks: int, per_rack: int, gangs: int, seeds: list[int]) -> None:
    print(f"### Topology: {racks} racks x {per_rack} nodes x 8 GPUs, {gangs} gangs (2-8 nodes) + {3 * gangs} "
          f"single-node jobs, seeds {', '.join(map(str, seeds))}\n")
    print("| placement | gangs in one rack | racks per gang | gang wait mean | gang wait p95 | job wait mean | "
          "makespan | unfinished |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("blind", "preferred", "required"):
        runs = [topology_run(mode, racks, per_rack, gangs, seed) for seed in seeds]

        def mean(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.mean(r[key] for r in runs)

        label = "topology-blind" if mode == "blind" else f"gang.topology {{{mode}: rack}}"
        print(f"| {label} | {mean('one_rack_pct'):.0f} % | {mean('racks_per_gang'):.2f} | "
              f"{mean('gang_wait_mean_s') / 60:.1f} min | {mean('gang_wait_p95_s') / 60:.1f} min | "
              f"{mean('job_wait_mean_s') / 60:.1f} min | {mean('makespan_h'):.1f} h | {mean('unfinished'):.0f} |")
    print()


def reservation_part(seed: int) -> None:
    h = Harness(tick_s=30.0, heartbeat_s=30.0, seed=seed)
    for k in range(6):
        h.add_node(registered_node(f"n{k}", gpus=8, model="H100").inventory)
    rnd = random.Random(seed)
    for _ in range(150):
        kind, arrival = rnd.random(), rnd.uniform(0, 4 * HOUR)
        if kind < 0.6:
            runtime = rnd.uniform(600, 2400)
            h.submit(JobSpec(run=RUN, tenant="lab", resources=GpuRequest(gpus=rnd.choice([1, 2, 4])),
                             runtime_estimate_s=runtime * 1.2), at=arrival, runtime_s=runtime)
        elif kind < 0.85:
            h.submit(JobSpec(run=RUN, tenant="lab", resources=GpuRequest(gpus=rnd.choice([1, 2])), preemptible=True,
                             priority_class="low", checkpoint={"grace_s": 30}),  # type: ignore[arg-type]
                     at=arrival, runtime_s=rnd.uniform(2, 5) * HOUR)
        else:
            h.submit(JobSpec(run=RUN, tenant="lab", resources=GpuRequest(gpus=1)), at=arrival,
                     runtime_s=rnd.uniform(1, 3) * HOUR)
    start = 3 * HOUR
    request = CreateReservation(tenant="vip", gpus=16, gpu_model="h100", start_at=datetime.fromtimestamp(start, UTC),
                                duration_s=2 * HOUR)
    h.send(request, at=10.0)
    vip = h.submit(JobSpec(run=RUN, tenant="vip", resources=GpuRequest(gpus=8), gang={"nodes": 2}),  # type: ignore[arg-type]
                   at=start, runtime_s=HOUR)
    seen = {"gpu_s": 0.0, "last": 0.0, "at_start": -1.0, "busy_gpu_s": 0.0}

    def measure(step: object, harness: Harness) -> None:
        found = harness.state.reservations.get(request.reservation_id)
        now = harness.now
        if found is not None and now <= start:
            seen["gpu_s"] += borrowed_gpus(harness.state, found) * (now - seen["last"])
            held = sum(row[0] for row in harness.state.tenant_held.values())
            seen["busy_gpu_s"] += held * (now - seen["last"])
        if found is not None and seen["at_start"] < 0 and now >= start:
            seen["at_start"] = borrowed_gpus(harness.state, found)
        seen["last"] = now

    h.observers.append(measure)
    h.run(until=start + HOUR)
    window = 16 * (start - 10.0) / HOUR
    print(f"### Reservation: 6 x 8 H100, 150 jobs of tenant lab over 4 h; 16 GPUs reserved for vip from 3 h for 2 h "
          f"(seed {seed})\n")
    print("| backfill inside the reserved GPUs before the start | of the reserved GPU-hours | other tenants' GPUs on "
          "them at the start | vip's gang started after the start | fleet busy before the start |")
    print("|---|---|---|---|---|")
    late = (vip.started_at - start) if vip.started_at is not None else float("nan")
    print(f"| {seen['gpu_s'] / HOUR:.1f} GPU-h | {100 * seen['gpu_s'] / HOUR / window:.0f} % of {window:.1f} | "
          f"{seen['at_start']:g} | {late:.0f} s | {100 * seen['busy_gpu_s'] / (48 * start):.0f} % |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("topology", "reservation", "all"), default="all")
    parser.add_argument("--racks", type=int, default=8)
    parser.add_argument("--nodes-per-rack", type=int, default=8)
    parser.add_argument("--gangs", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    if args.part in ("topology", "all"):
        topology_part(args.racks, args.nodes_per_rack, args.gangs, args.seeds)
    if args.part in ("reservation", "all"):
        reservation_part(args.seeds[0])


if __name__ == "__main__":
    main()
