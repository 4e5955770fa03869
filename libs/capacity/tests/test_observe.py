"""Read-model rows to an observation, and the pool configuration (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from gpuorch_capacity.observe import observation, pool_of, pools_from_json

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
POOLS = pools_from_json('[{"name": "big", "node_type": "h100x8", "ceiling": 4, "min_wait_s": {"batch": 600}},'
                        ' {"name": "small", "node_type": {"name": "l4x2", "gpu_model": "L4", "gpus": 2,'
                        ' "gpu_memory_mib": 23034}}]')


def test_pools_from_json_and_bad_configs() -> None:
    assert [(p.name, p.node_type.gpus, p.wait_threshold_s("batch")) for p in POOLS] == [("big", 8, 600.0),
                                                                                      ("small", 2, 0.0)]
    for bad in ('{"name": "x"}', '[{"name": "x", "node_type": "b200x8"}]',
                '[{"name": "x", "node_type": "l4x4", "floor": 3, "ceiling": 1}]',
                '[{"name": "x", "node_type": "l4x4"}, {"name": "x", "node_type": "l4x4"}]'):
        with pytest.raises(ValueError):
            pools_from_json(bad)


def test_nodes_join_pools_by_label_then_by_shape() -> None:
    l4 = {"gpus": [{"model": "L4", "index": 0}, {"model": "L4", "index": 1}]}
    assert pool_of(l4, POOLS) == "small"
    assert pool_of({**l4, "labels": {"gpuorch.io/pool": "big"}}, POOLS) == "big"
    assert pool_of({"gpus": [{"model": "T4", "index": 0}]}, POOLS) is None


def test_observation_from_rows() -> None:
    inv = {"gpus": [{"model": "H100-80GB", "index": i} for i in range(8)]}
    nodes = [{"node_id": "a", "liveness": "alive", "inventory": inv, "last_job_end": NOW - timedelta(hours=2)},
             {"node_id": "b", "liveness": "alive", "inventory": inv, "last_job_end": None},
             {"node_id": "c", "liveness": "lost", "inventory": inv, "last_job_end": None}]
    running = [{"job_id": "j", "preemptible": False,
                "assignments": '[{"node_id": "b", "gpus": [{"gpu_index": 0}, {"gpu_index": 3}]}]'}]
    queued = [{"tier": "training", "spec": {"resources": {"gpus": 4}}, "submitted_at": NOW - timedelta(minutes=5),
               "pending_reason": "no node has 4 free GPUs"},
              {"tier": "training", "spec": {"resources": {"gpus": 4}}, "submitted_at": NOW - timedelta(minutes=9),
               "pending_reason": None},
              {"tier": "batch", "spec": {"resources": {"gpus": 1}}, "submitted_at": NOW,
               "pending_reason": "tenant x is over its quota"},
              # the MIG plan hosts it on a GPU the fleet has: repartitioning, not a new node
              {"tier": "inference", "spec": {"resources": {"mig_profiles": ["1g.10gb"]}},
               "submitted_at": NOW - timedelta(minutes=30), "pending_reason": "no free MIG instance of 1g.10gb; "
               "the MIG plan (mode advise) would repartition a GPU 3 for it: `gpuctl mig plan`"},
              {"tier": "inference", "spec": {"resources": {"mig_profiles": ["1g.10gb"]}},
               "submitted_at": NOW - timedelta(minutes=1), "pending_reason": "no free MIG instance of 1g.10gb"}]
    pressure = [{"job_id": "p", "tier": "inference", "node_id": "a", "gpus": 0.5}]
    history = [{"pool": "big", "last_scale_out_at": NOW - timedelta(minutes=1), "last_scale_in_at": None}]
    obs = observation(NOW, POOLS, nodes, running, queued, pressure, history, draining=["a"], asked={"big": 3})
    by_id = {n.node_id: n for n in obs.nodes}
    assert set(by_id) == {"a", "b", "big/requested-0", "big/requested-1"}  # 3 asked, 1 ready + 'a' draining
    assert by_id["a"].phase == "draining" and by_id["a"].idle_since == (NOW - timedelta(hours=2)).timestamp()
    assert by_id["b"].runs_non_preemptible and by_id["b"].free_gpus == 6 and by_id["b"].idle_since is None
    demand, mig = sorted(obs.pending, key=lambda d: d.tier, reverse=True)
    assert (demand.count, demand.gpus, demand.oldest_wait_s) == (2, 4, 540.0)
    assert (mig.count, mig.mig_profile, mig.oldest_wait_s) == (1, "1g.10gb", 60.0)  # only the one no plan hosts
    assert obs.pressure[0].gpu_model == "H100-80GB" and obs.history_of("big").last_scale_out_at is not None
