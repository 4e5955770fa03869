"""Nodes that left the fleet for good (scale-in, decommissioning, dead) stay silent: they must not turn one live
node's failure into a mass silence that requeues nothing."""

from __future__ import annotations

from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.testing import registered_node


def test_nodes_lost_long_ago_do_not_count_towards_mass_silence() -> None:
    h = Harness(heartbeat_s=5.0)
    for k in range(4):
        h.add_node(registered_node(f"old{k}", gpus=1).inventory, at=0)
    for k in range(3):  # scale-in, one node at a time: each alone is no mass silence
        h.lose_node(f"old{k}", at=20 + k * 200)
    for k in range(3):  # scale-out: fresh nodes, fresh names
        h.add_node(registered_node(f"new{k}", gpus=1).inventory, at=710)
    h.run(until=720)
    assert [h.state.nodes[f"old{k}"].liveness for k in range(3)] == ["lost"] * 3
    job = h.submit(JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["x"])), at=721, runtime_s=1e9)
    h.run(until=730)
    first = h.state.jobs[job.job_id]
    node_id, placement_id = first.assignments[0].node_id, first.placement_id
    h.lose_node(node_id, at=740)  # one of the four live nodes dies
    h.run(until=1200)
    assert not h.scheduler.mass_silence
    assert h.state.nodes[node_id].liveness == "lost"
    job_now = h.state.jobs[job.job_id]
    assert job_now.state == "running" and job_now.placement_id != placement_id
    assert job_now.assignments[0].node_id != node_id


def test_most_live_nodes_silent_at_once_is_still_a_mass_silence() -> None:
    h = Harness(heartbeat_s=5.0)
    for k in range(5):
        h.add_node(registered_node(f"n{k}", gpus=1).inventory, at=0)
    h.lose_node("n0", at=20)
    h.run(until=200)
    assert h.state.nodes["n0"].liveness == "lost"
    for k in (1, 2, 3):  # 3 of the 4 nodes not lost go silent at once (a broker fault)
        h.lose_node(f"n{k}", at=300)
    h.run(until=600)
    assert h.scheduler.mass_silence
    assert [h.state.nodes[f"n{k}"].liveness for k in (1, 2, 3)] == ["suspect"] * 3
