from __future__ import annotations

import re
from pathlib import Path

import pytest
from gpuorch_contracts import NodeHeartbeat, NodeRegistered
from gpuorch_node_agent.entrypoint import build_simulated_agents, parse_config
from gpuorch_node_agent.sim.nvml import SimulatedNvml
from gpuorch_node_agent.sim.processes import StaticProcessTable
from gpuorch_node_agent.sim.profiles import device_profile, parse_node_csv, parse_profile_mix

UUID = re.compile(r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
def _openb_csv() -> Path:
    """shared/ sits beside the repository (CI lays a copy there); GPUORCH_OPENB_DIR overrides."""
    import os

    root = os.environ.get("GPUORCH_OPENB_DIR") or str(Path(__file__).resolve().parents[3].parent / "shared/traces/openb")
    return Path(root) / "openb_node_list_gpu_node.csv"


OPENB_CSV = _openb_csv()


def _agents(mix: str, seed: int = 1):
    return build_simulated_agents(parse_profile_mix(mix, prefix="det"), seed=seed, inventory_s=60,
                                  processes=StaticProcessTable())


def test_registered_at_start_and_only_when_the_inventory_changes():
    (agent,) = _agents("a100x8:1")
    agent.start()
    first = agent.heartbeat_messages()
    assert [type(m) for m in first] == [NodeRegistered, NodeHeartbeat]
    assert first[0].inventory_hash == first[1].inventory_hash
    second = agent.heartbeat_messages()
    assert [type(m) for m in second] == [NodeHeartbeat]
    assert second[0].sequence == first[1].sequence + 1
    agent.nvml.inject_xid(0, 74)
    agent.on_nvml_event(agent.uuid_of(0), 0x8, 74)
    third = agent.heartbeat_messages()
    assert [type(m) for m in third] == [NodeRegistered, NodeHeartbeat]
    assert third[0].inventory_hash != first[0].inventory_hash
    assert third[0].inventory.gpus[0].health == "unhealthy"


def test_inventory_contents_for_an_h100_node():
    (agent,) = _agents("h100x8:1")
    agent.start()
    inventory = agent.inventory
    assert inventory is not None
    assert [g.index for g in inventory.gpus] == list(range(8))
    assert all(UUID.match(g.uuid) for g in inventory.gpus)
    assert len({g.uuid for g in inventory.gpus}) == 8
    assert {g.model for g in inventory.gpus} == {"H100-80GB"}
    assert inventory.gpus[0].compute_capability == "9.0" and inventory.gpus[0].memory_total_mib == 81559
    assert len(inventory.nvlink_pairs) == 28 and len(inventory.topology) == 28


def test_topology_levels_without_nvlink():
    (agent,) = _agents("l4x4:1")
    agent.start()
    levels = {(a, b): level for a, b, level in agent.inventory.topology}
    assert agent.inventory.nvlink_pairs == []
    assert levels[(0, 1)] == "single_switch" and levels[(0, 2)] == "system"


def test_v100_cube_mesh_nvlink():
    (agent,) = _agents("v100x8:1")
    agent.start()
    pairs = set(agent.inventory.nvlink_pairs)
    assert (0, 1) in pairs and (0, 4) in pairs and (0, 5) not in pairs


def test_deterministic_by_seed_and_node_id():
    a = _agents("h100x8:1,t4x4:1", seed=9)
    b = _agents("h100x8:1,t4x4:1", seed=9)
    c = _agents("h100x8:1,t4x4:1", seed=10)
    for agents in (a, b, c):
        for agent in agents:
            agent.start()
    hashes = [[m.inventory_hash for m in (ag.heartbeat_messages()[0],)] for ag in a]
    assert hashes == [[m.inventory_hash for m in (ag.heartbeat_messages()[0],)] for ag in b]
    assert a[0].uuid_of(0) == c[0].uuid_of(0)  # UUIDs come from (node id, index) only
    assert a[0].uuid_of(0) != a[1].uuid_of(0)
    temps_a = [g.temperature_c for g in a[0].heartbeat_messages()[-1].gpus]
    temps_b = [g.temperature_c for g in b[0].heartbeat_messages()[-1].gpus]
    temps_c = [g.temperature_c for g in c[0].heartbeat_messages()[-1].gpus]
    assert temps_a == temps_b and temps_a != temps_c
    other = SimulatedNvml("another-node", device_profile("h100"), 1)
    assert other.gpus[0].uuid != a[0].nvml.gpus[0].uuid


def test_profile_mix_and_openb_csv():
    specs = parse_profile_mix("h100x8:2,a100x8:1,l4x4:2", prefix="f")
    assert [(s.node_id, s.gpu_profile.key, s.gpu_count) for s in specs][:3] == [
        ("f-00000", "h100", 8), ("f-00001", "h100", 8), ("f-00002", "a100", 8)]
    assert len(specs) == 5
    openb = parse_node_csv(OPENB_CSV.read_text())
    assert len(openb) == 1213
    assert sum(s.gpu_count for s in openb) == 6212
    assert {s.gpu_profile.model for s in openb} == {"G2", "G3", "P100", "T4", "V100M16", "V100M32", "A10"}
    agents = build_simulated_agents(openb[:3], seed=0, inventory_s=60, processes=StaticProcessTable())
    agents[0].start()
    assert agents[0].inventory.gpus[0].model == "P100" and agents[0].inventory.cpu_milli == 64000


def test_a_fleet_mix_describes_its_racks_as_topology_labels():
    specs = parse_profile_mix("h100x8:3@rack=2,a100x8:2@block=4@rack=2", prefix="t")
    racks = [s.labels["topology.gpuorch.io/rack"] for s in specs]
    assert racks == ["rack-0", "rack-0", "rack-1", "rack-2", "rack-2"]
    assert [s.labels.get("topology.gpuorch.io/block") for s in specs] == [None, None, None, "block-0", "block-0"]
    agents = build_simulated_agents(specs[:1], seed=0, inventory_s=60, processes=StaticProcessTable())
    agents[0].start()
    assert agents[0].inventory.labels["topology.gpuorch.io/rack"] == "rack-0"
    with pytest.raises(ValueError, match="bad topology"):
        parse_profile_mix("h100x8:2@row=2")


def test_config_from_environment_and_flags():
    env = {"GPUORCH_NVML": "sim", "GPUORCH_HEARTBEAT_S": "5", "GPUORCH_FLEET_NODES": "l4x4:3",
           "GPUORCH_NODE_ID": "n7"}
    config = parse_config([], env)
    assert (config.nvml, config.heartbeat_s, config.is_fleet, config.node_id) == ("sim", 5.0, True, "n7")
    assert parse_config(["--heartbeat-s", "2"], env).heartbeat_s == 2.0
    with pytest.raises(SystemExit):  # invalid settings: exit 2, each named (gpuorch_settings)
        parse_config(["--nvml", "gpu"], env)


def test_inventory_is_resent_periodically_even_when_unchanged() -> None:
    from gpuorch_contracts import GpuLive, NodeInventory, NodeRegistered
    from gpuorch_node_agent.domain.heartbeat import HeartbeatState

    state = HeartbeatState(node_id="n1", reregister_every=3)
    inventory = NodeInventory(node_id="n1", cpu_milli=1000, memory_mib=1024)
    kinds = [[type(m) for m in state.messages(inventory, [GpuLive(index=0)])] for _ in range(7)]
    registered_at = [i for i, k in enumerate(kinds) if NodeRegistered in k]
    assert registered_at == [0, 3, 6]


def test_heartbeats_carry_the_gpus_state_when_utilisation_or_health_changed_and_every_few_beats():
    (agent,) = _agents("a100x8:1")
    agent.start()
    beats = []
    for _ in range(8):
        beats.append(next(m for m in agent.heartbeat_messages() if isinstance(m, NodeHeartbeat)))
    carried = [bool(b.gpus) for b in beats]
    # with the inventory, then unchanged idle GPUs: empty until the sixth beat since the last full one
    assert carried == [True, False, False, False, False, False, True, False]
    assert [b.sequence for b in beats] == list(range(beats[0].sequence, beats[0].sequence + 8))  # liveness as before
    agent.nvml.inject_xid(0, 74)
    agent.on_nvml_event(agent.uuid_of(0), 0x8, 74)
    changed = next(m for m in agent.heartbeat_messages() if isinstance(m, NodeHeartbeat))
    assert changed.gpus and changed.gpus[0].health == "unhealthy"
    agent.heartbeat.forget_sent()
    assert next(m for m in agent.heartbeat_messages() if isinstance(m, NodeHeartbeat)).gpus


def test_the_hash_sent_is_the_current_inventorys_although_it_is_computed_once_per_inventory(monkeypatch) -> None:
    """The agent hashes an inventory once (issue 25: not on every heartbeat), but a rebuilt or replaced inventory
    is hashed again: the hash sent always equals ``inventory_hash`` of the inventory in force."""
    from gpuorch_node_agent import agent as agent_module
    from gpuorch_node_agent.domain.inventory import inventory_hash

    calls: list[object] = []

    def counting(inventory):
        calls.append(inventory)
        return inventory_hash(inventory)

    monkeypatch.setattr(agent_module, "inventory_hash", counting)
    (agent,) = _agents("h100x8:1")
    agent.start()
    beats = [agent.heartbeat_messages() for _ in range(10)]
    assert len(calls) == 1  # ten heartbeats, one inventory, one hash
    first_hash = beats[0][-1].inventory_hash
    assert all(b[-1].inventory_hash == first_hash == inventory_hash(agent.inventory) for b in beats)
    agent.nvml.inject_xid(2, 74)  # an NVLink error: the GPU turns unhealthy, the inventory is rebuilt
    agent.on_nvml_event(agent.uuid_of(2), 0x8, 74)
    rebuilt = agent.heartbeat_messages()
    registered = next(m for m in rebuilt if isinstance(m, NodeRegistered))
    assert registered.inventory_hash != first_hash
    assert registered.inventory_hash == rebuilt[-1].inventory_hash == inventory_hash(agent.inventory)
    assert registered.inventory.gpus[2].health == "unhealthy"
    assert len(calls) == 2
    agent.inventory = agent.inventory.model_copy(update={"labels": {"rack": "r9"}})  # replaced from outside
    replaced = agent.heartbeat_messages()
    assert [type(m) for m in replaced] == [NodeRegistered, NodeHeartbeat]
    assert replaced[-1].inventory_hash == inventory_hash(agent.inventory) != registered.inventory_hash


def test_lazy_gpus_send_the_same_heartbeats_and_build_them_only_when_carried() -> None:
    """``HeartbeatState.messages`` with ``LazyGpus`` (and a given digest) sends what it sends with the built list;
    the builder runs only for heartbeats that carry ``gpus``."""
    from gpuorch_contracts import GpuLive, NodeInventory
    from gpuorch_node_agent.domain.heartbeat import HeartbeatState, LazyGpus, judge
    from gpuorch_node_agent.domain.inventory import inventory_hash

    inventory = NodeInventory(node_id="n1", cpu_milli=1000, memory_mib=1024)
    readings = [[GpuLive(index=0, utilization_pct=u, power_w=100.0 + i), GpuLive(index=1, utilization_pct=0.0)]
                for i, u in enumerate([0.0, 0.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0, 0.0])]
    plain, lazy = HeartbeatState("n1", gpus_every=4), HeartbeatState("n1", gpus_every=4)
    builds = 0

    def builder(gpus):
        def build():
            nonlocal builds
            builds += 1
            return gpus
        return build

    carried = 0
    for gpus in readings:
        expected = plain.messages(inventory, gpus)
        carried += bool(expected[-1].gpus)
        got = lazy.messages(inventory, LazyGpus(judge(gpus), builder(gpus)), digest=inventory_hash(inventory))
        strip = {"message_id", "occurred_at"}
        assert [m.model_dump(exclude=strip) for m in got] == [m.model_dump(exclude=strip) for m in expected]
    # the first, the change to 50, the 4th unchanged one after it, the change back to 0
    assert builds == carried == 4


def test_a_gpus_live_state_is_rebuilt_when_its_reading_changes_and_reused_while_it_does_not() -> None:
    """The agent keeps the last ``GpuLive`` per GPU: an unchanged reading reuses it (the same immutable model), a
    changed one (utilisation, memory, power, temperature or health) is sent with its new values."""
    from gpuorch_node_agent.sim.processes import DeclaredUsage, SimProcess

    (agent,) = _agents("h100x8:1")
    agent.start()
    first = agent.heartbeat_messages()[-1]
    agent.heartbeat.forget_sent()
    again = agent.heartbeat_messages()[-1]
    assert first.gpus and [g.model_dump() for g in again.gpus] == [g.model_dump() for g in first.gpus]
    assert all(a is b for a, b in zip(again.gpus, first.gpus, strict=True))  # reused, not rebuilt
    uuid = agent.uuid_of(3)
    agent.nvml.processes.by_uuid = {uuid: [SimProcess(4242, DeclaredUsage(util_pct=80.0, mem_mib=20_000))]}
    busy = agent.heartbeat_messages()[-1]
    assert busy.gpus[3].utilization_pct == 80.0 and busy.gpus[3].memory_used_mib == 20_000
    assert busy.gpus[3].power_w > first.gpus[3].power_w and busy.gpus[3].temperature_c > first.gpus[3].temperature_c
    assert all(busy.gpus[i] is first.gpus[i] for i in range(8) if i != 3)
    agent.nvml.processes.by_uuid = {}
    idle = agent.heartbeat_messages()[-1]
    assert idle.gpus[3].model_dump() == first.gpus[3].model_dump()
