"""Where the unallocated GPU goes at the end of one openb protocol replay: every GPU classified by what it holds.

    uv run python bench/replay_end_state.py                    # gpuorch, seed 42
    uv run python bench/replay_end_state.py --policy FGD --seed 48 [--variant gpu_share-60]

Prints, for the end state at 130 % arrived: GPUs holding whole-GPU tasks, GPUs holding an 810-milli share (alone or
with others), GPUs holding other shares only, and free GPUs, each with its free GPU-milli as % of capacity; the most
common share combinations and what they leave; and how the free milli splits into leftovers no task type of the
workload fits by size, leftovers a type fits by size but not by its node's free CPU or memory, and the rest (a task
that would fit never arrived). Used for "Why 4.0 % is not reached" in docs/placement.md. Same replay code as
`gpuctl replay` (gpuorch_scheduling.trace_replay.replay_protocol with recorded outcomes).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

from gpuorch_policy import TaskMix
from gpuorch_policy.openb import parse_nodes, parse_tasks, protocol_workload
from gpuorch_policy.variants import make_variant
from gpuorch_scheduling.trace_replay import replay_protocol

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "openb"
STARVED_SIZE = 810  # the openb share size whose 190-milli leftover almost nothing fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--policy", default="gpuorch")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--variant", default="default")
    args = parser.parse_args()
    nodes = parse_nodes((args.trace / "openb_node_list_gpu_node.csv").read_text().splitlines())
    tasks = parse_tasks((args.trace / "openb_pod_list_default.csv").read_text().splitlines())
    if args.variant != "default":
        tasks = make_variant(tasks, nodes, args.variant)
    mix = TaskMix.from_requests(t.request for t in tasks)
    result = replay_protocol(nodes, tasks, args.policy, args.seed, mix=mix, record_outcomes=True)
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    workload = protocol_workload(tasks, capacity, 1.3, args.seed)

    held: dict[tuple[str, int], list[int]] = defaultdict(list)
    cpu_used: Counter[str] = Counter()
    mem_used: Counter[str] = Counter()
    for task, outcome in zip(workload, result.outcomes, strict=True):
        if outcome.node is None:
            continue
        cpu_used[outcome.node] += task.request.cpu_milli
        mem_used[outcome.node] += task.request.memory_mib
        for slot, milli in outcome.gpus:
            held[(outcome.node, slot)].append(milli)

    one_gpu_types = [(t.gpu_milli, t.cpu_milli, memory) for t, _, memory in mix.observed if t.num_gpu == 1]
    gpus: Counter[str] = Counter()
    free: Counter[str] = Counter()
    combos: Counter[tuple[int, ...]] = Counter()
    by_size = by_host = 0
    for node in nodes:
        cpu_free = node.cpu_milli_total - cpu_used[node.node_id]
        mem_free = node.memory_mib_total - mem_used[node.node_id]
        for slot in range(len(node.gpus)):
            content = sorted(held.get((node.node_id, slot), []))
            kind = ("free" if not content else "whole-GPU tasks" if content[-1] >= 1000
                    else f"an {STARVED_SIZE}-milli share" if STARVED_SIZE in content else "other shares only")
            left = 1000 - sum(content)
            gpus[kind] += 1
            free[kind] += left
            if kind == "other shares only":
                combos[tuple(content)] += 1
            if 0 < left < 1000:
                fits = [t for t in one_gpu_types if t[0] <= left]
                if not fits:
                    by_size += left
                elif not any(c <= cpu_free and m <= mem_free for _, c, m in fits):
                    by_host += left

    print(f"{args.policy}, {args.variant}, seed {args.seed}: unallocated {result.unallocated_pct_at_130:.2f} % "
          f"at 130 % arrived (end state below: {100 * sum(free.values()) / capacity:.2f} %)")
    print(f"{'what the GPU holds':<34}{'GPUs':>7}{'free, % of capacity':>22}")
    for kind in ("whole-GPU tasks", f"an {STARVED_SIZE}-milli share", "other shares only", "free"):
        print(f"{kind:<34}{gpus[kind]:>7}{100 * free[kind] / capacity:>22.3f}")
    alone = sum(1 for c in held.values() if c == [STARVED_SIZE])
    print(f"  {STARVED_SIZE}-milli shares alone on their GPU: {alone}")
    print("most common share combinations (GPUs, milli left each):")
    for combo, count in combos.most_common(8):
        print(f"  {'+'.join(map(str, combo)):<18}{count:>5}{1000 - sum(combo):>6}")
    print(f"free milli no task type fits by size: {100 * by_size / capacity:.3f} % of capacity; "
          f"fits by size but not by its node's CPU or memory: {100 * by_host / capacity:.3f} %")


if __name__ == "__main__":
    main()
