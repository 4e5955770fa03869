"""The planner's input from read-model rows, and the snapshot file format."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuorch_policy.mig_planner import InstanceState
from gpuorch_policy.mig_snapshot import MigSnapshot, from_read_models

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def test_read_models_become_gpu_states_and_pending_jobs() -> None:
    nodes = [{"node_id": "n1", "liveness": "alive", "inventory": {"node_id": "n1", "gpus": [
        {"uuid": "GPU-a", "index": 0, "model": "H100-80GB", "mig_enabled": True, "mig_instances": [
            {"uuid": "MIG-1", "profile": "3g.40gb", "placement_start": 0},
            {"uuid": "MIG-2", "profile": "3g.40gb", "placement_start": 4}]},
        {"uuid": "GPU-b", "index": 1, "model": "H100-80GB", "health": "unhealthy"}]}},
        {"node_id": "n2", "liveness": "suspect", "inventory": {"gpus": [{"uuid": "GPU-c", "index": 0, "model": "A100-40GB"}]}}]
    jobs = [
        {"job_id": "r1", "name": "serve", "tier": "inference", "state": "running", "spec": {},
         "assignments": [{"node_id": "n1", "gpus": [{"gpu_uuid": "MIG-2"}]}], "submitted_at": NOW},
        {"job_id": "r2", "name": "share", "tier": "batch", "state": "placed", "spec": {},
         "assignments": [{"node_id": "n1", "gpus": [{"gpu_uuid": "GPU-b"}]}], "submitted_at": NOW},
        {"job_id": "q1", "name": "serve", "tier": "inference", "state": "queued",
         "spec": {"resources": {"mig_profiles": ["2g.20gb"], "gpu_models": ["H100-80GB"]}},
         "submitted_at": NOW - timedelta(seconds=90)},
        {"job_id": "q2", "name": "train", "tier": "training", "state": "queued",
         "spec": {"resources": {"gpus": 8}, "gang": {"nodes": 2}}, "submitted_at": NOW},
        {"job_id": "q3", "name": "cpu", "tier": "batch", "state": "queued", "spec": {"resources": {}},
         "submitted_at": NOW},
    ]
    snapshot = from_read_models(nodes, jobs, {"serve": 7000}, NOW)
    a, b, c = snapshot.gpus
    assert a.instances == (InstanceState("3g.40gb", 0, None, "MIG-1"), InstanceState("3g.40gb", 4, "r1", "MIG-2"))
    assert a.in_service and not b.in_service and not c.in_service   # unhealthy GPU; suspect node
    assert b.whole_job_ids == ("r2",)
    q1, q2 = snapshot.pending                                          # the CPU-only job asks no GPU
    assert (q1.waiting_s, q1.mig_profiles, q1.peak_memory_mib, q1.gpu_models) == (90.0, ("2g.20gb",), 7000,
                                                                                 ("H100-80GB",))
    assert (q2.whole_gpus, q2.nodes, q2.peak_memory_mib) == (8, 2, None)
    assert MigSnapshot.from_json(snapshot.to_json()) == snapshot
