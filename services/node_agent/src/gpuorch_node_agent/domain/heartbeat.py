"""When a node sends its whole inventory and when only a compact heartbeat.

``HeartbeatState.messages`` (pure apart from its own counters):
- the first call, and every call whose inventory hash differs from the last one sent, yields ``NodeRegistered``
  followed by a ``NodeHeartbeat`` carrying the new hash;
- otherwise only a ``NodeHeartbeat`` (compact live state, the hash, a sequence number that grows by one per
  heartbeat so receivers can drop stale ones);
- every ``reregister_every`` heartbeats the inventory is sent again even if unchanged, so a scheduler that missed
  it (started after this node on a fresh broker, or restored from an old backup) learns the node within that many
  heartbeats; receivers ignore an inventory whose hash they already know;
- a heartbeat carries its GPUs' live state (``gpus``) when a GPU's utilisation or health differs from the last
  heartbeat that carried it, with every inventory, and at least every ``gpus_every`` heartbeats; otherwise ``gpus``
  is empty, which receivers read as "as last reported" (the scheduler judges idle sessions by utilisation; an idle
  fleet's heartbeats shrink from about 1.2 KB to 0.3 KB, and so does decoding them). Liveness is unchanged: a
  heartbeat still goes every interval;
- ``forget_sent`` makes the next call re-send the inventory and the GPUs' state (e.g. after the broker lost a
  publish).

Cost (a fleet process runs thousands of these; issue 25): the caller may pass the inventory's hash (``digest``,
computed once per inventory: ``NodeAgent`` hashes it when it rebuilds it) and the GPUs' state lazily (``LazyGpus``:
the judged tuple plus a builder of the ``GpuLive`` list, called only for a heartbeat that carries ``gpus``). What is
sent is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuorch_contracts import GpuLive, Message, NodeHeartbeat, NodeInventory, NodeRegistered

from gpuorch_node_agent.domain.inventory import inventory_hash

Judged = tuple[tuple[int, float | None, str], ...]
"""(index, utilisation, health) of each GPU: what decides whether a heartbeat carries ``gpus``."""


@dataclass(frozen=True)
class LazyGpus:
    """The GPUs' live state without building it: ``judged`` must equal ``judge(build())``."""

    judged: Judged
    build: Callable[[], Sequence[GpuLive]]


def judge(gpus: Sequence[GpuLive]) -> Judged:
    return tuple((g.index, g.utilization_pct, g.health) for g in gpus)


@dataclass
class HeartbeatState:
    node_id: str
    producer: str = "node-agent"
    sequence: int = 0
    sent_hash: str | None = None
    reregister_every: int = 30
    gpus_every: int = 6
    """Heartbeats between two that carry the GPUs' state although nothing the receiver judges by changed (a
    scheduler that started meanwhile learns it within this many)."""
    sent_gpus: Judged | None = None
    """(index, utilisation, health) of each GPU as the last heartbeat that carried ``gpus`` reported them."""
    since_gpus: int = 0

    def messages(self, inventory: NodeInventory, gpus: Sequence[GpuLive] | LazyGpus, *,
                 nvml_errors: Sequence[str] = (), digest: str | None = None) -> list[Message]:
        """``digest``, when given, must be ``inventory_hash(inventory)``."""
        if digest is None:
            digest = inventory_hash(inventory)
        out: list[Message] = []
        periodic = self.reregister_every > 0 and self.sequence > 0 and self.sequence % self.reregister_every == 0
        registered = digest != self.sent_hash or periodic
        if registered:
            out.append(NodeRegistered(inventory=inventory, inventory_hash=digest, producer=self.producer))
            self.sent_hash = digest
        judged = gpus.judged if isinstance(gpus, LazyGpus) else judge(gpus)
        self.since_gpus += 1
        with_gpus = registered or judged != self.sent_gpus or self.since_gpus >= self.gpus_every
        if with_gpus:
            self.sent_gpus, self.since_gpus = judged, 0
        carried = (list(gpus.build()) if isinstance(gpus, LazyGpus) else list(gpus)) if with_gpus else []
        out.append(NodeHeartbeat(
            node_id=self.node_id, inventory_hash=digest, sequence=self.sequence, gpus=carried,
            nvml_errors=[e[:1024] for e in nvml_errors[:64]], producer=self.producer,
        ))
        self.sequence += 1
        return out

    def forget_sent(self) -> None:
        self.sent_hash = None
        self.sent_gpus = None
