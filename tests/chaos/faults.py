"""Fault injection for the chaos suite: a broker proxy a test can cut, refuse, or freeze; a stack with one process
per node; and the knobs (counts, timings) that CI keeps small and docs/RELIABILITY.md lists at full size."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from gpuorch_gpuctl_ops.stack import LocalStack, ServiceProcess, SimNode


def scale(name: str, ci_default: int) -> int:
    """A count for a scenario: ``GPUORCH_CHAOS_<NAME>`` if set (the large runs), else the small CI default."""
    return int(os.environ.get(f"GPUORCH_CHAOS_{name.upper()}", ci_default))


SEED = int(os.environ.get("GPUORCH_CHAOS_SEED", "12"))

# Lease timings shortened for the suite; their order is what production needs: executor heartbeat < half of
# (fencing deadline - grace), fencing deadline < the scheduler's lost-after, node heartbeat < suspect-after.
FAST_LEASES = {
    "GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5",
    "GPUORCH_SUSPECT_AFTER_S": "3", "GPUORCH_LOST_AFTER_S": "8",
    "GPUORCH_FENCING_DEADLINE_S": "5", "GPUORCH_FENCING_GRACE_S": "1", "GPUORCH_EXECUTOR_HEARTBEAT_S": "0.5",
    "GPUORCH_EXECUTOR_POLL_S": "0.1",
}
LOST_AFTER_S = float(FAST_LEASES["GPUORCH_LOST_AFTER_S"])


class BrokerProxy:
    """A TCP proxy in front of RabbitMQ for the processes a test wants to fault.

    - ``cut()`` aborts every connection at once (a broker restart or a network blip, as clients see it);
    - ``refuse = True`` closes new connections at once (the broker still down);
    - ``freeze()`` holds every byte the clients send (publishes, confirms' acks, heartbeats) while the broker's
      side still flows, as a broker memory alarm blocks publishers; ``thaw()`` lets the held bytes through.
    """

    def __init__(self, target_host: str = "127.0.0.1", target_port: int = 5672) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.refuse = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()

    def url(self, amqp_url: str) -> str:
        """``amqp_url`` with its host and port replaced by this proxy's."""
        scheme_auth, rest = amqp_url.split("@", 1)
        vhost = rest.split("/", 1)[1] if "/" in rest else ""
        return f"{scheme_auth}@127.0.0.1:{self.port}/{vhost}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            client_writer.transport.abort()
            return
        try:
            broker_reader, broker_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        self._transports.update({client_writer.transport, broker_writer.transport})
        await asyncio.gather(self._forward(client_reader, broker_writer, upstream=True),
                             self._forward(broker_reader, client_writer, upstream=False))
        self._transports.difference_update({client_writer.transport, broker_writer.transport})

    async def _forward(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, upstream: bool) -> None:
        try:
            while chunk := await source.read(65536):
                if upstream:
                    await self._flowing.wait()
                sink.write(chunk)
                await sink.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sink.transport.abort()

    async def cut(self) -> None:
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def stop(self) -> None:
        self.thaw()
        await self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@dataclass
class ChaosStack(LocalStack):
    """A LocalStack that can also run one node-agent or one executor per node, each on its own broker URL (so a
    fault can hit one node alone)."""

    def start_node_agent_for(self, node: SimNode, amqp_url: str | None = None, **env: str) -> ServiceProcess:
        return self._spawn(f"node-agent-{node.node_id}", "gpuorch-node-agent", {
            "GPUORCH_NVML": "sim", "GPUORCH_NODE_ID": node.node_id, "GPUORCH_SIM_PROFILE": f"{node.profile}x{node.gpus}",
            "GPUORCH_USAGE_S": "600", "GPUORCH_AMQP_URL": amqp_url or self.amqp_url,
            "GPUORCH_NODE_AGENT_STATE_DIR": str(self.root / "node-agent"), **env,
        })

    def start_executor_for(self, nodes: list[SimNode], amqp_url: str | None = None, **env: str) -> ServiceProcess:
        name = "executor-" + "-".join(n.node_id for n in nodes)
        return self._spawn(name, "gpuorch-executor", {
            "GPUORCH_NODE_IDS": ",".join(n.node_id for n in nodes),
            "GPUORCH_EXECUTOR_STATE_DIR": str(self.root / "executor"), "GPUORCH_AMQP_URL": amqp_url or self.amqp_url,
            **env,
        })


