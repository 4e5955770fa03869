"""The chaos suite: faults and hostile inputs against real service processes, checked by ``invariants``.

Selected by ``-m chaos`` (``make chaos``); a plain ``pytest``/``make test`` run skips these tests, so that CI runs
them once, in their own step. Counts come from ``GPUORCH_CHAOS_*`` (see docs/RELIABILITY.md): small by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import SimNode

from tests.chaos.faults import FAST_LEASES, ChaosStack


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: fault and hostile-input suite (make chaos)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos" in (config.getoption("markexpr", "") or ""):
        timeout_s = os.environ.get("GPUORCH_CHAOS_TIMEOUT_S")  # full-size runs take longer than CI's limits
        if timeout_s:
            for item in items:
                item.add_marker(pytest.mark.timeout(float(timeout_s)), append=False)
        return
    skip = pytest.mark.skip(reason="the chaos suite runs with -m chaos (make chaos)")
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)


@pytest.fixture
def chaos_stack(tmp_path: Path, amqp_url: str, pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[ChaosStack]:
    """A stack on a fresh vhost and database with short leases; nothing started. On failure, each service's log
    tail is printed."""
    stack = ChaosStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn,
                       nodes=[SimNode("node-1", "a100-80", 2), SimNode("node-2", "a100-80", 2),
                              SimNode("node-3", "a100-80", 2)],
                       extra_env=dict(FAST_LEASES))
    try:
        yield stack
    finally:
        stack.stop_all()
        stack.kill_jobs()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for name in stack.processes:
                print(f"--- {name} ---\n{stack.tail(name, 40)}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
