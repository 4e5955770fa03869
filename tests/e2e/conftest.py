"""Fixtures for end-to-end tests: a LocalStack of real service processes on a fresh vhost and database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    nodes = getattr(request, "param", None) or [SimNode("node-1", "a100-80", 4)]
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=nodes,
                       extra_env={"GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5"})
    try:
        yield local
    finally:
        local.stop_all()
        local.kill_jobs()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            for name in local.processes:
                print(f"--- {name} ---\n{local.tail(name, 60)}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
