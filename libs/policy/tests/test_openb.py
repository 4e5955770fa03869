"""The openb CSV format: optional columns and every task kind (replays: libs/scheduling/tests/test_trace_replay.py)."""

from __future__ import annotations

from gpuorch_policy import Placement, TaskMix, build_policy
from gpuorch_policy.openb import parse_nodes, parse_tasks

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
node-b,32000,131072,4,V100M16
node-a,16000,65536,2,T4
node-c,8000,16384,0,
"""

FIVE_COLUMN_PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli
p-cpu,2000,4096,0,0
p-share,4000,8192,1,460
p-one,8000,16384,1,1000
p-two,8000,16384,2,1000
p-four,16000,32768,4,1000
"""

FULL_PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
q-t4,1000,1024,1,500,T4,LS,Running,0,100,0
q-v100,1000,1024,1,1000,V100M16|V100M32,BE,Running,5,50,
q-any,1000,1024,1,250,,LS,Pending,7,,
"""


def test_five_column_trace_parses_every_task_kind() -> None:
    tasks = parse_tasks(FIVE_COLUMN_PODS.splitlines())
    kinds = [(t.request.num_gpu, t.request.gpu_milli, t.request.is_share) for t in tasks]
    assert kinds == [(0, 0, False), (1, 460, True), (1, 1000, False), (2, 1000, False), (4, 1000, False)]
    assert all(t.creation_time is None and t.request.gpu_models == () for t in tasks)


def test_gpu_spec_and_times_are_read_when_present() -> None:
    tasks = parse_tasks(FULL_PODS.splitlines())
    assert tasks[0].request.gpu_models == ("T4",)
    assert tasks[1].request.gpu_models == ("V100M16", "V100M32")
    assert (tasks[1].creation_time, tasks[1].deletion_time, tasks[1].scheduled_time) == (5, 50, None)
    assert tasks[2].deletion_time is None


def test_cpu_only_nodes_are_kept() -> None:
    nodes = parse_nodes(NODES_CSV.splitlines())
    assert [len(n.gpus) for n in nodes] == [4, 2, 0]


def test_model_constraint_is_respected() -> None:
    nodes = parse_nodes(NODES_CSV.splitlines())
    tasks = parse_tasks(FULL_PODS.splitlines())
    mix = TaskMix.from_requests(t.request for t in tasks)
    from gpuorch_policy import Cluster, place

    cluster = Cluster(nodes)
    decision = place(tasks[0].request, cluster, build_policy("gpuorch", mix))
    assert isinstance(decision, Placement) and decision.node_id == "node-a"
    decision = place(tasks[1].request, cluster, build_policy("gpuorch", mix))
    assert isinstance(decision, Placement) and decision.node_id == "node-b"
