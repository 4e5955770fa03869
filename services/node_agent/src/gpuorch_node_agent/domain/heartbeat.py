"""When a node sends its whole inventory and when only a compact heartbeat.

``HeartbeatState.messages`` (pure apart from its own counters):
- the first call, and every call whose inventory hash differs from the last one sent, yields ``NodeRegistered``
  followed by a ``NodeHeartbeat`` carrying the new hash;
- otherwise only a ``NodeHeartbeat`` (compact live state, the hash, a sequence number that grows by one per
  heartbeat so receivers can drop stale ones);
- every ``reregister_every`` heartbeats the inventory is sent again even if unchanged, so a scheduler that missed
  it (started after this node on a fresh broker, or restored from an old backup) learns the node within that many
  heartbeats; receivers ignore an inventory whose hash they already know;
- ``forget_sent`` makes the next call re-send the inventory (e.g. after the broker lost a publish).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuorch_contracts import GpuLive, Message, NodeHeartbeat, NodeInventory, NodeRegistered

from gpuorch_node_agent.domain.inventory import inventory_hash


@dataclass
class HeartbeatState:
    node_id: str
    producer: str = "node-agent"
    sequence: int = 0
    sent_hash: str | None = None
    reregister_every: int = 30

    def messages(self, inventory: NodeInventory, gpus: Sequence[GpuLive], *, nvml_errors: Sequence[str] = ()
                 ) -> list[Message]:
        digest = inventory_hash(inventory)
        out: list[Message] = []
        periodic = self.reregister_every > 0 and self.sequence > 0 and self.sequence % self.reregister_every == 0
        if digest != self.sent_hash or periodic:
            out.append(NodeRegistered(inventory=inventory, inventory_hash=digest, producer=self.producer))
            self.sent_hash = digest
        out.append(NodeHeartbeat(
            node_id=self.node_id, inventory_hash=digest, sequence=self.sequence, gpus=list(gpus),
            nvml_errors=[e[:1024] for e in nvml_errors[:64]], producer=self.producer,
        ))
        self.sequence += 1
        return out

    def forget_sent(self) -> None:
        self.sent_hash = None
