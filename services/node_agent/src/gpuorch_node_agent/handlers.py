"""Command handlers of the node agent (one registry: ``handlers(...)``, dispatched by ``gpuorch_messaging.dispatch``).

``ApplyMigLayoutHandler``: applies an ``ApplyMigLayout`` to the node it names, if this process runs that node.
- Each GPU of the command is applied or refused on its own; a refusal (work still running, layout against NVIDIA's
  rules, unhealthy GPU, no MIG support) changes nothing on that GPU and is logged with its reason.
- Every command is answered with one ``MigLayoutApplied`` event carrying each GPU's outcome and reason.
- When any GPU changed, the node's new inventory is published at once (``NodeRegistered`` + ``NodeHeartbeat``).
- A command for a node this process does not run is ignored (logged); a refusal is a decision, not an error, so the
  handler returns normally and the command is acked (retrying would not drain the GPU).
- Idempotent: applying the same layout twice gives the same instances (the second run re-creates them).
- A command of a scheduler leader older than the newest this process has seen for the node
  (``gpuorch_contracts.leader_epoch``, the executor's rule) changes nothing: every GPU of it is answered refused
  with that reason (a leader that still counts on it puts the GPU back in service at once; one that does not
  ignores an answer to a command it is not applying), logged and counted in
  ``gpuorch_node_agent_stale_commands_total``. The newest epoch is kept per node in the node-agent's state directory
  (``leader_epochs.LeaderEpochStore``), written before the command acts, so a restarted node-agent still refuses a
  superseded leader's command; if it cannot be written the handler raises and nothing changes (the command is
  redelivered and judged again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from gpuorch_contracts import ApplyMigLayout, Message, MigGpuOutcome, MigLayoutApplied
from gpuorch_contracts.leader_epoch import judge_leader_epoch
from gpuorch_observability import get_logger
from prometheus_client import Counter

from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.leader_epochs import LeaderEpochStore
from gpuorch_node_agent.nvml.mig import MigApplyResult

log = get_logger(__name__)

STALE_COMMANDS = Counter("gpuorch_node_agent_stale_commands_total", "Commands refused: decided by a scheduler "
                         "leader older than the newest seen (gpuorch_contracts.leader_epoch)", ["node_id", "type"])


class ApplyMigLayoutHandler:
    def __init__(self, agents: Mapping[str, NodeAgent],
                 publish: Callable[[list[Message]], Awaitable[None]], leader_epochs: LeaderEpochStore) -> None:
        self.agents = agents
        self.publish = publish
        self.outcomes: dict[str, list[MigApplyResult]] = {}
        """Last outcome per node id (for tests and the CLI); the log carries every one."""
        self.leader_epochs = leader_epochs
        """The newest scheduler leader epoch each node's commands carried (durable, see the module)."""

    async def __call__(self, message: Message) -> None:
        if not isinstance(message, ApplyMigLayout):
            log.warning("command.unexpected", type=message.TYPE)
            return
        agent = self.agents.get(message.node_id)
        if agent is None:
            log.warning("command.unknown_node", node_id=message.node_id, message_id=str(message.message_id))
            return
        results = (agent.apply_mig_layout(message) if self._from_current_leader(message)
                   else self._refused_as_stale(message))
        self.outcomes[message.node_id] = results
        for result in results:
            if result.applied:
                log.info("mig.applied", node_id=message.node_id, gpu_index=result.gpu_index, detail=result.reason)
            else:
                log.warning("mig.refused", node_id=message.node_id, gpu_index=result.gpu_index,
                            reason=result.reason, message_id=str(message.message_id))
        answer = MigLayoutApplied(
            node_id=message.node_id, command_id=str(message.message_id),
            outcomes=[MigGpuOutcome(gpu_index=r.gpu_index, applied=r.applied, reason=r.reason[:1024])
                      for r in results],
        )
        await self.publish([answer, *(agent.heartbeat_messages() if any(r.applied for r in results) else [])])


    def _from_current_leader(self, command: ApplyMigLayout) -> bool:
        newest = self.leader_epochs.newest_seen(command.node_id)
        verdict = judge_leader_epoch(command.leader_epoch, newest)
        if not verdict.admitted:
            log.warning("command.stale_leader", type=command.TYPE, node_id=command.node_id,
                        message_id=str(command.message_id), leader_epoch=command.leader_epoch, newest_seen=newest)
            STALE_COMMANDS.labels(command.node_id, command.TYPE).inc()
            return False
        self.leader_epochs.record(command.node_id, verdict.newest_seen)
        return True

    def _refused_as_stale(self, command: ApplyMigLayout) -> list[MigApplyResult]:
        why = (f"refused: decided by scheduler leader epoch {command.leader_epoch}, older than epoch "
               f"{self.leader_epochs.newest_seen(command.node_id)} this node has seen")
        return [MigApplyResult(gpu_index=layout.gpu_index, applied=False, reason=why) for layout in command.layouts]


def handlers(agents: Mapping[str, NodeAgent], publish: Callable[[list[Message]], Awaitable[None]],
             state_root: Path) -> dict[str, Callable[[Message], Awaitable[None]]]:
    """Message type -> handler: the registry the entrypoint consumes with (``state_root``: where each node's newest
    leader epoch is kept, ``leader_epochs``)."""
    return {ApplyMigLayout.TYPE: ApplyMigLayoutHandler(agents, publish, LeaderEpochStore(state_root))}
