"""Fixtures for the scheduler's tests against real service processes (LocalStack on a fresh vhost and database)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[SimNode("node-1", "a100-80", 1)],
                       extra_env={"GPUORCH_TICK_S": "0.3"})
    try:
        yield local
    finally:
        local.stop_all()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for name in local.processes:
                print(f"--- {name} ---\n{local.tail(name, 40)}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
