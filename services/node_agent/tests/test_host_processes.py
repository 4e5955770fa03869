"""Host-side process facts (real processes): CPU of a busy process, I/O-free sleeper, process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpuorch_node_agent.host_processes import HostProcessSampler


def test_busy_process_shows_cpu_and_a_sleeper_does_not() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = HostProcessSampler()
        first = sampler.sample([busy.pid, idle.pid])
        assert first[busy.pid].host_cpu_pct is None  # no rate before a second sample
        # Each sample is the average since the previous one. On a busy machine the spinner may get little CPU in
        # one interval, so sample until it shows (a state, with a deadline), not once after a fixed sleep.
        deadline = time.monotonic() + 60.0
        while True:
            time.sleep(0.5)
            second = sampler.sample([busy.pid, idle.pid])
            cpu = second[busy.pid].host_cpu_pct
            if (cpu is not None and cpu > 30) or time.monotonic() > deadline:
                break
        assert second[busy.pid].host_cpu_pct is not None and second[busy.pid].host_cpu_pct > 30
        assert second[idle.pid].host_cpu_pct is not None and second[idle.pid].host_cpu_pct < 10
        assert second[busy.pid].pgid == busy.pid  # its own session: its own group
        assert second[idle.pid].pgid == os.getpgid(os.getpid())
        assert second[idle.pid].io_wait_pct is not None and second[idle.pid].io_wait_pct < 10
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_vanished_process_yields_unknowns() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    facts = HostProcessSampler().sample([gone.pid])
    assert facts[gone.pid].host_cpu_pct is None and facts[gone.pid].pgid is None


def test_metrics_collector_reports_the_fleet_counters() -> None:
    from gpuorch_node_agent.fleet import FleetRunner
    from gpuorch_node_agent.metrics import FleetCollector
    from prometheus_client import CollectorRegistry, generate_latest

    class Agent:
        handles = [object(), object()]
        node_id = "n1"

    runner = FleetRunner([Agent()], publisher=None)  # type: ignore[list-item]
    runner.stats.heartbeats = 7
    runner.stats.lag_s = [0.1, 0.2, 0.3]
    registry = CollectorRegistry()
    registry.register(FleetCollector(runner))
    text = generate_latest(registry).decode()
    assert "gpuorch_node_agent_gpus 2.0" in text
    assert "gpuorch_node_agent_heartbeats_total 7.0" in text
    assert 'gpuorch_node_agent_heartbeat_lag_seconds{quantile="0.5"} 0.2' in text
