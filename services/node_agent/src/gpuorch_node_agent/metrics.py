"""Prometheus metrics of a node-agent process, read from its ``FleetRunner`` at scrape time (nothing on the hot path).

GPU readings themselves are exported by telemetry under dcgm-exporter names (or by dcgm-exporter on the node); these
are the agent's own health: what it published, what failed, how late its heartbeats were confirmed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector


class FleetCollector(Collector):
    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        stats = self.runner.stats
        yield GaugeMetricFamily("gpuorch_node_agent_nodes", "Nodes this process runs", value=len(self.runner.agents))
        yield GaugeMetricFamily("gpuorch_node_agent_gpus", "GPUs discovered on those nodes",
                                value=sum(len(a.handles) for a in self.runner.agents))
        for name, value, text in (
            ("heartbeats", stats.heartbeats, "Heartbeats confirmed by the broker"),
            ("registrations", stats.registrations, "Inventories (NodeRegistered) confirmed by the broker"),
            ("usage_samples", stats.usage_samples, "GpuUsageSampled messages confirmed by the broker"),
            ("health_events", stats.health_events, "GpuHealthChanged messages confirmed by the broker"),
            ("publish_failures", stats.publish_failures, "Messages the broker did not confirm"),
            ("nvml_event_failures", stats.nvml_event_failures, "Failures of the NVML event wait"),
        ):
            yield CounterMetricFamily(f"gpuorch_node_agent_{name}", text, value=value)
        for quantile in (0.5, 0.99):
            lag = stats.lag_percentile(quantile)
            if lag is not None:
                gauge = GaugeMetricFamily("gpuorch_node_agent_heartbeat_lag_seconds",
                                          "Due time to broker confirmation of heartbeats", labels=["quantile"])
                gauge.add_metric([str(quantile)], lag)
                yield gauge


def register(runner: Any) -> FleetCollector:
    collector = FleetCollector(runner)
    REGISTRY.register(collector)
    return collector
