"""The broker settings every service shares (``gpuorch_settings``: environment, optional file, validated).

A service's settings class inherits ``BrokerSettings`` and passes ``broker_options()`` to its ``Broker``:
the library itself reads no environment, so a ``Broker`` built in code is exactly what its arguments say.
"""

from __future__ import annotations

from typing import Any, Literal

from gpuorch_settings import ServiceSettings, setting

from gpuorch_messaging.topology import DEFAULT_WAIT_S


class BrokerSettings(ServiceSettings):
    identity: Literal["strict", "trust_all"] = setting(
        "GPUORCH_IDENTITY", "strict", "strict: each queue takes a message only from the senders allowed to send it "
        "(by the AMQP user_id); trust_all: types only, for a local stack where every process is guest")
    broker_topology: Literal["passive", "declare"] = setting(
        "GPUORCH_BROKER_TOPOLOGY", "passive", "passive: look exchanges and queues up (declared at install by "
        "gpuctl setup broker or the definitions file; runtime users have no configure right); declare: declare "
        "them (a development user with every right)")
    topology_wait_s: float = setting("GPUORCH_BROKER_TOPOLOGY_WAIT_S", DEFAULT_WAIT_S, "seconds a passive service "
                                     "waits for a queue or exchange the setup step has not declared yet", ge=0)

    def broker_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Broker`` for these settings."""
        return {"identity": self.identity, "declare_topology": self.broker_topology == "declare",
                "topology_wait_s": self.topology_wait_s}
