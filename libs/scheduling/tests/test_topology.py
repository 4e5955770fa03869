"""Topology-aware gangs on the Harness: a gang goes into the smallest rack that holds it (big free racks stay free),
waits for one rack when the level is required, and takes the fewest racks when it is only preferred."""

from __future__ import annotations

from gpuorch_contracts import TOPOLOGY_LABEL_PREFIX, GpuRequest, JobSpec, NodeInventory, ProcessRun
from gpuorch_scheduling.harness import Harness, SimJob
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def fleet(h: Harness, racks: dict[str, int]) -> None:
    for rack, count in racks.items():
        for n in range(count):
            inventory = registered_node(f"{rack}-n{n}", gpus=8).inventory
            h.add_node(NodeInventory.model_validate(
                {**inventory.model_dump(), "labels": {TOPOLOGY_LABEL_PREFIX + "rack": rack}}))


def gang(h: Harness, nodes: int, at: float, topology: dict[str, str] | None, runtime_s: float = 600) -> SimJob:
    shape: dict[str, object] = {"nodes": nodes, **({"topology": topology} if topology else {})}
    return h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=8), gang=shape, runtime_estimate_s=runtime_s),  # type: ignore[arg-type]
                    at=at, runtime_s=runtime_s)


def racks_of(h: Harness, job: SimJob) -> set[str]:
    return {a.node_id.split("-")[0] for a in h.state.jobs[job.job_id].assignments}


def test_a_gang_takes_the_smallest_rack_that_holds_it_and_keeps_the_big_one_free() -> None:
    h = Harness(keep_steps=True)
    fleet(h, {"ra": 2, "rb": 4})
    small = gang(h, 2, 1.0, {"preferred": "rack"})
    h.run(until=5.0)
    assert racks_of(h, small) == {"ra"}  # rb stays whole for a 4-node gang
    big = gang(h, 4, 6.0, {"required": "rack"})
    h.run(until=10.0)
    assert racks_of(h, big) == {"rb"}


def test_a_required_level_waits_for_one_rack_and_a_preferred_one_takes_the_fewest_racks() -> None:
    h = Harness(keep_steps=True)
    fleet(h, {"ra": 3, "rb": 3, "rc": 1})
    blockers = [gang(h, 2, 1.0, {"required": "rack"}, runtime_s=1000) for _ in range(2)]  # one in ra, one in rb
    h.run(until=5.0)
    assert {frozenset(racks_of(h, b)) for b in blockers} == {frozenset({"ra"}), frozenset({"rb"})}
    required = gang(h, 3, 6.0, {"required": "rack"})
    preferred = gang(h, 3, 7.0, {"preferred": "rack"})
    h.run(until=10.0)
    assert required.state == "queued"
    waiting = h.scheduler.pending[required.job_id]
    assert waiting.reason.startswith("gang needs 3 nodes in one rack; the roomiest rack has")
    assert waiting.estimated_start == 1001.0  # when a blocker frees its rack
    assert preferred.state in ("placed", "running") and len(racks_of(h, preferred)) == 3  # 1 free node in each
    h.run()
    assert required.state == "succeeded" and len(racks_of_placed(h, required)) == 1


def racks_of_placed(h: Harness, job: SimJob) -> set[str]:
    """The racks of the job's (last) placement, from the log (the job may have left memory)."""
    placed = [e for e in h.logged() if e.TYPE == "job.placed" and e.job_id == job.job_id]  # type: ignore[attr-defined]
    return {a.node_id.split("-")[0] for a in placed[-1].assignments}  # type: ignore[attr-defined]
