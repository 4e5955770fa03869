"""Independent check of recorded placements against node capacities.

Given the node list, the original tasks (by name) and placement records (`seed`, `task`, `source`, `node`,
`gpus`), it replays the records per seed with plain Python integers (no shared code with the placer beyond the
parsed inputs) and reports every record that would take a node's host CPU, host memory or any GPU beyond its
capacity, uses a GPU index that does not exist, a model the task refuses, or the wrong number of GPUs or milli.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuorch_policy.model import GPU_MILLI, NodeView, Request


def check_placements(
    nodes: Sequence[NodeView], requests: Mapping[str, Request], records: Iterable[Mapping[str, Any]]
) -> list[str]:
    """All violations found, as sentences; empty when every placement respects every capacity."""
    by_id = {n.node_id: n for n in nodes}
    state: dict[Any, dict[str, Any]] = {}
    problems: list[str] = []
    for number, record in enumerate(records, start=1):
        seed = record.get("seed")
        node_id = record.get("node")
        if node_id is None:
            continue
        where = f"record {number} (seed {seed}, task {record.get('task')})"
        request = requests.get(str(record.get("source")))
        if request is None:
            problems.append(f"{where}: unknown source task {record.get('source')!r}")
            continue
        node = by_id.get(str(node_id))
        if node is None:
            problems.append(f"{where}: unknown node {node_id!r}")
            continue
        used = state.setdefault(seed, {}).setdefault(
            node.node_id, {"cpu": 0, "mem": 0, "gpu": [0] * len(node.gpus)}
        )
        gpus = [(int(i), int(m)) for i, m in record.get("gpus", [])]
        if len(gpus) != request.num_gpu or len({i for i, _ in gpus}) != len(gpus):
            problems.append(f"{where}: {len(gpus)} distinct GPUs given, {request.num_gpu} requested")
        used["cpu"] += request.cpu_milli
        used["mem"] += request.memory_mib
        if used["cpu"] > node.cpu_milli_total:
            problems.append(f"{where}: {node.node_id} CPU {used['cpu']} > {node.cpu_milli_total}")
        if used["mem"] > node.memory_mib_total:
            problems.append(f"{where}: {node.node_id} memory {used['mem']} > {node.memory_mib_total}")
        for index, milli in gpus:
            if not 0 <= index < len(node.gpus):
                problems.append(f"{where}: {node.node_id} has no GPU {index}")
                continue
            if milli != request.gpu_milli:
                problems.append(f"{where}: GPU {index} given {milli} milli, task asks {request.gpu_milli}")
            if request.gpu_models and node.gpus[index].model not in request.gpu_models:
                problems.append(f"{where}: GPU {index} is {node.gpus[index].model}, task accepts {request.gpu_models}")
            used["gpu"][index] += milli
            if used["gpu"][index] > GPU_MILLI:
                problems.append(f"{where}: {node.node_id} GPU {index} at {used['gpu'][index]} milli > {GPU_MILLI}")
    return problems
