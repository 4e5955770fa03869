"""``gpuctl replay`` on a small generated trace: seeds replayed in several processes give exactly what one process
gives (summary and placement records), and the placements pass ``--verify``."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpuorch_gpuctl.cli import app
from typer.testing import CliRunner


def write_trace(tmp_path: Path) -> tuple[Path, Path]:
    draw = random.Random(7)
    nodes = ["sn,cpu_milli,memory_mib,gpu,model"]
    for i in range(40):
        gpus = draw.choice([0, 2, 4, 8])
        nodes.append(f"node-{i:03d},{draw.choice([32000, 64000, 96000])},262144,{gpus},{'V100' if gpus else ''}")
    pods = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
            "scheduled_time"]
    for i in range(300):
        gpus = draw.choice([0, 1, 1, 1, 2, 4])
        milli = draw.choice([1000, 1000, 500, 250, 810]) if gpus == 1 else 1000
        pods.append(f"pod-{i:04d},{draw.choice([2000, 4000, 8000])},8192,{gpus},{milli if gpus else 0},,LS,Running,"
                    f"{i},{i + 100},{i}")
    node_file, pod_file = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    node_file.write_text("\n".join(nodes) + "\n")
    pod_file.write_text("\n".join(pods) + "\n")
    return node_file, pod_file


def test_seeds_in_several_processes_give_what_one_process_gives(tmp_path: Path) -> None:
    node_file, pod_file = write_trace(tmp_path)
    runner = CliRunner()
    outputs = {}
    for jobs in ("1", "2"):
        placements = tmp_path / f"placements-{jobs}.jsonl"
        result = runner.invoke(app, ["replay", "--nodes", str(node_file), "--pods", str(pod_file), "--seeds", "1-3",
                                     "--json", "--jobs", jobs, "--placements", str(placements)])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        for seed in summary["seeds"]:
            seed.pop("seconds")
        summary["mean"].pop("seconds"), summary["mean"].pop("seconds_total")
        outputs[jobs] = (summary, placements.read_text())
    assert outputs["1"] == outputs["2"]
    summary, records = outputs["2"]
    assert [s["seed"] for s in summary["seeds"]] == [1, 2, 3]
    seeds = [json.loads(line)["seed"] for line in records.splitlines()]
    assert seeds == sorted(seeds) and set(seeds) == {1, 2, 3}  # written in seed order
    assert any(json.loads(line)["node"] for line in records.splitlines())  # something was placed
    checked = runner.invoke(app, ["replay", "--nodes", str(node_file), "--pods", str(pod_file), "--json",
                                  "--verify", str(tmp_path / "placements-2.jsonl")])
    assert checked.exit_code == 0 and json.loads(checked.stdout)["violations"] == 0
