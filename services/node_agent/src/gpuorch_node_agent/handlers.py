"""Command handlers of the node agent (one registry: ``handlers(...)``, dispatched by ``gpuorch_messaging.dispatch``).

``ApplyMigLayoutHandler``: applies an ``ApplyMigLayout`` to the node it names, if this process runs that node.
- Each GPU of the command is applied or refused on its own; a refusal (work still running, layout against NVIDIA's
  rules, unhealthy GPU, no MIG support) changes nothing on that GPU and is logged with its reason.
- Every command is answered with one ``MigLayoutApplied`` event carrying each GPU's outcome and reason.
- When any GPU changed, the node's new inventory is published at once (``NodeRegistered`` + ``NodeHeartbeat``).
- A command for a node this process does not run is ignored (logged); a refusal is a decision, not an error, so the
  handler returns normally and the command is acked (retrying would not drain the GPU).
- Idempotent: applying the same layout twice gives the same instances (the second run re-creates them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from gpuorch_contracts import ApplyMigLayout, Message, MigGpuOutcome, MigLayoutApplied
from gpuorch_observability import get_logger

from gpuorch_node_agent.agent import NodeAgent
from gpuorch_node_agent.nvml.mig import MigApplyResult

log = get_logger(__name__)


class ApplyMigLayoutHandler:
    def __init__(self, agents: Mapping[str, NodeAgent],
                 publish: Callable[[list[Message]], Awaitable[None]]) -> None:
        self.agents = agents
        self.publish = publish
        self.outcomes: dict[str, list[MigApplyResult]] = {}
        """Last outcome per node id (for tests and the CLI); the log carries every one."""

    async def __call__(self, message: Message) -> None:
        if not isinstance(message, ApplyMigLayout):
            log.warning("command.unexpected", type=message.TYPE)
            return
        agent = self.agents.get(message.node_id)
        if agent is None:
            log.warning("command.unknown_node", node_id=message.node_id, message_id=str(message.message_id))
            return
        results = agent.apply_mig_layout(message)
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


def handlers(agents: Mapping[str, NodeAgent], publish: Callable[[list[Message]], Awaitable[None]]
             ) -> dict[str, Callable[[Message], Awaitable[None]]]:
    """Message type -> handler: the registry the entrypoint consumes with."""
    return {ApplyMigLayout.TYPE: ApplyMigLayoutHandler(agents, publish)}
