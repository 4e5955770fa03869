"""``python -m gpuorch_dst`` (``make sim``): run many seeds, or replay one.

    python -m gpuorch_dst --seeds 500               seeds 0..499, progress on stderr, each failure with the
                                                    command that replays it; exit 1 if any failed
    python -m gpuorch_dst --seed 51 --trace         one seed, every action and publish printed
    python -m gpuorch_dst --seeds 200 --no-epoch-fencing   the guard switched off: expect failures
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

from gpuorch_dst.simulation import Outcome, SimConfig, run_seed

SWITCHES = {
    "--no-gangs": ("gang_p", 0.0, "no gang jobs (by default 8 %% of jobs are two-node gangs)"),
    "--gangs": ("gang_p", 0.08, "two-node gangs in 8 %% of jobs: the default (kept for older replay commands)"),
    "--no-commit-fence": ("fence_commits", False, "the database accepts a commit of a replaced leader's epoch"),
    "--no-epoch-check": ("epoch_check", False, "executors accept commands of any epoch"),
    "--no-launch-recovery-check": ("refuse_launches_before_recovery", False,
                                   "executors start LaunchJobs decided before their last recovery"),
}


def config_from(args: argparse.Namespace) -> SimConfig:
    config = SimConfig(nodes=args.nodes, jobs=args.jobs, fault_window_s=args.fault_window)
    for flag, (name, value, _) in SWITCHES.items():
        if getattr(args, _dest(flag)):
            config = replace(config, **{name: value})
    if args.no_epoch_fencing:
        config = config.without_epoch_fencing()
    return config


def replay_command(seed: int, argv: list[str]) -> str:
    """The command that replays ``seed`` with the same configuration (what a failure prints)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--seeds", "--start", "--seed"):
            skip = True
            continue
        if arg.startswith(("--seeds=", "--start=", "--seed=")) or arg in ("--json", "--trace"):
            continue
        kept.append(arg)
    return " ".join(["uv run python -m gpuorch_dst", f"--seed {seed}", *kept, "--trace"])


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuorch_dst", description=(
        "Deterministic simulation of the control plane: the real scheduling library as leader and standby, "
        "simulated executors, node-agents, broker and database, faults at any step, invariants after each. "
        "A failing seed prints the command that replays it exactly."))
    p.add_argument("--seeds", type=int, default=100, help="how many seeds to run (default 100)")
    p.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--seed", type=int, default=None, help="run this one seed only (a replay)")
    p.add_argument("--trace", action="store_true", help="print every action and publish (with --seed)")
    p.add_argument("--json", action="store_true", help="one JSON object per seed on stdout, then a summary")
    p.add_argument("--nodes", type=int, default=SimConfig.nodes, help="nodes in the fleet")
    p.add_argument("--jobs", type=int, default=SimConfig.jobs, help="jobs submitted per seed")
    p.add_argument("--fault-window", type=float, default=SimConfig.fault_window_s,
                   help="simulated seconds during which faults happen")
    p.add_argument("--no-epoch-fencing", action="store_true",
                   help="switch off both epoch guards (the database's commit fence and the executors' check)")
    for flag, (_, _, text) in SWITCHES.items():
        p.add_argument(flag, action="store_true", help=text)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    config = config_from(args)
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.seeds))
    trace = print if args.trace and args.seed is not None else None
    failed: list[Outcome] = []
    started = time.perf_counter()
    for k, seed in enumerate(seeds, 1):
        outcome = run_seed(seed, config, trace)
        if args.json:
            print(json.dumps({"seed": seed, "ok": outcome.ok, "invariant": outcome.invariant,
                              "detail": outcome.detail, "step": outcome.step, "at": outcome.at,
                              "stats": outcome.stats}))
        if not outcome.ok:
            failed.append(outcome)
            print(f"FAIL {outcome.describe()}\n  replay: {replay_command(seed, argv)}", file=sys.stderr)
        elapsed = time.perf_counter() - started
        if not args.json and (k == len(seeds) or k % max(1, len(seeds) // 20) == 0):
            print(f"seeds {k}/{len(seeds)}  {k / elapsed:.1f} seeds/s  {len(failed)} failed", file=sys.stderr)
    elapsed = time.perf_counter() - started
    summary = {"seeds": len(seeds), "failed": [o.seed for o in failed], "seconds": round(elapsed, 2),
               "seeds_per_s": round(len(seeds) / elapsed, 1), "config": asdict(config)}
    if args.json:
        print(json.dumps(summary))
    elif args.seed is not None:
        print(failed[0].describe() if failed else f"seed {args.seed}: every invariant held")
    else:
        print(f"{len(seeds)} seeds in {elapsed:.1f}s ({summary['seeds_per_s']}/s): "
              f"{'every invariant held' if not failed else f'{len(failed)} failed: ' + str(summary['failed'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
