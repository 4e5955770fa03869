"""Shared pytest fixtures: a fresh RabbitMQ vhost and a fresh PostgreSQL database per test.

Tests talk to the real servers (127.0.0.1:5672 guest/guest with the management API on 15672, and PostgreSQL on
127.0.0.1:5432 with trust auth). Override with GPUORCH_TEST_AMQP_ADMIN / GPUORCH_TEST_PG_ADMIN.
Each fixture deletes what it created, so a run leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

# Tests connect as guest, so the senders' identities cannot be told apart: every Broker checks message types only,
# unless a test about identity asks for Broker(identity="strict") (libs/messaging/tests/test_identity.py).
os.environ.setdefault("GPUORCH_IDENTITY", "trust_all")
# ... and may declare what it consumes (production services only look their queues up: the setup step declares
# them, tests/deploy and tests/security run that way with least-privilege users).
os.environ.setdefault("GPUORCH_BROKER_TOPOLOGY", "declare")
# A developer's own gpuctl contexts (~/.config/gpuctl, left by `gpuctl demo --keep` or `gpuctl up`) must not steer a
# test's gpuctl to their API: every process of the run reads a config file of its own that does not exist, unless
# a test names one (services/gpuctl/tests give each test its own).
os.environ["GPUCTL_CONFIG"] = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"gpuorch-tests-{os.getpid()}-{uuid.uuid4().hex[:8]}", "gpuctl.yaml")
for _name in ("GPUCTL_SERVER", "GPUCTL_TOKEN"):
    os.environ.pop(_name, None)

AMQP_HOST = os.environ.get("GPUORCH_TEST_AMQP_HOST", "127.0.0.1")
AMQP_PORT = int(os.environ.get("GPUORCH_TEST_AMQP_PORT", "5672"))
AMQP_MGMT = os.environ.get("GPUORCH_TEST_AMQP_ADMIN", "http://guest:guest@127.0.0.1:15672")
PG_ADMIN = os.environ.get("GPUORCH_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _mgmt(method: str, path: str, body: dict[str, str] | None = None) -> None:
    import httpx

    url = httpx.URL(AMQP_MGMT)
    base = f"{url.scheme}://{url.host}:{url.port}"
    auth = (url.username or "guest", url.password or "guest")
    response = httpx.request(method, base + path, auth=auth, timeout=30, json=body if body is not None else ({} if method == "PUT" else None))
    response.raise_for_status()


def make_vhost() -> str:
    name = f"gpuorch-test-{uuid.uuid4().hex[:12]}"
    _mgmt("PUT", f"/api/vhosts/{name}")
    _mgmt("PUT", f"/api/permissions/{name}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    return name


def drop_vhost(name: str) -> None:
    try:
        _mgmt("DELETE", f"/api/vhosts/{name}")
    except Exception:
        pass


@pytest.fixture
def broker_service_users() -> Iterator[None]:
    """Held by a test that runs ``gpuctl up``: it gives the broker's service users (``api``, ``scheduler``, ...: one
    name each, broker-wide) new passwords, so two at once, in two xdist workers or two runs on this machine, lock
    each other's services out. A file lock, so it holds across workers and runs."""
    import fcntl
    import tempfile
    from pathlib import Path

    with open(Path(tempfile.gettempdir()) / "gpuorch-broker-service-users.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def amqp_vhost() -> Iterator[str]:
    name = make_vhost()
    yield name
    drop_vhost(name)


@pytest.fixture
def amqp_url(amqp_vhost: str) -> str:
    """URL of a fresh, empty RabbitMQ vhost for this test."""
    return f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{amqp_vhost}"


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def make_database() -> str:
    name = f"gpuorch_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    return name


def drop_database(name: str) -> None:
    try:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    except Exception:
        pass


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """DSN of a fresh, empty PostgreSQL database for this test (migrations not applied)."""
    name = make_database()
    base = PG_ADMIN.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    drop_database(name)


@pytest.fixture
async def migrated_dsn(pg_dsn: str) -> AsyncIterator[str]:
    """DSN of a fresh database with every gpuorch migration applied."""
    from gpuorch_store.migrations import migrate

    await migrate(pg_dsn)
    yield pg_dsn


@pytest.fixture
async def late_database(migrated_dsn: str) -> AsyncIterator[tuple[str, Callable[[], Awaitable[None]]]]:
    """(dsn, appear): ``dsn`` names a database that does not exist until ``await appear()``, which brings it into
    being at once with every migration applied (a migrated database renamed to that name): a database that is not
    there yet when a service starts, without racing the service against the migrations."""
    name = migrated_dsn.rsplit("/", 1)[1]
    await _admin(f'ALTER DATABASE "{name}" RENAME TO "{name}_later"')

    async def appear() -> None:
        await _admin(f'ALTER DATABASE "{name}_later" RENAME TO "{name}"')

    yield migrated_dsn, appear
    with contextlib.suppress(Exception):
        await _admin(f'DROP DATABASE IF EXISTS "{name}_later" WITH (FORCE)')


# -- the order modules start in under pytest-xdist ------------------------------------------------------------------
# `make test` hands whole modules to its workers (`--dist loadscope`) in collection order (`--no-loadscope-reorder`;
# xdist would otherwise hand out the modules with most tests first, whatever they last). The run ends when its
# last module ends: a long module started last (tests/e2e/test_demo.py used to) leaves the other workers idle.
# So each worker orders the collected items: the modules below first, longest first (measured in a `make test` on
# the 2-core box, docs/CONTRIBUTING.md), then every other module with a test marked `slow`, then the rest; each
# module's tests stay together and in their order. A module missing from the list only starts later.
LONG_MODULES = (
    "libs/scheduling/tests/test_trace_sanity.py",
    "services/gpuctl/tests/test_gpuctl_api.py",
    "services/gpuctl-ops/tests/test_bench_capacity.py",
    "libs/dst/tests/test_seeds.py",
    "libs/capacity/tests/test_mig_simulation.py",
    "services/executor/tests/test_integration_broker.py",
    "services/scheduler/tests/test_live.py",
    "services/gpuctl-ops/tests/test_up.py",
    "services/gpuctl-ops/tests/test_demo_lifecycle.py",
    "libs/scheduling/tests/test_harness.py",
    "tests/e2e/test_dashboard.py",
    "services/gpuctl-ops/tests/test_bench.py",
    "services/gpuctl/tests/test_lazy_commands.py",
    "services/api/tests/test_api.py",
    "services/gpuctl-ops/tests/test_mig_cmd.py",
    "services/scheduler/tests/test_stateful.py",
    "services/telemetry/tests/test_service.py",
    "tests/e2e/test_failures.py",
    "tests/e2e/test_demo.py",
    "tests/security/test_sandbox.py",
    "tests/security/test_api_limits.py",
    "services/gpuctl/tests/test_gpuctl_arrays.py",
    "libs/messaging/tests/test_broker.py",
)


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist workers (whose collection order the controller schedules by), long modules first (see above);
    a run without workers keeps pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {_module_of(item) for item in items if item.get_closest_marker("slow") is not None}
    rank = {name: index for index, name in enumerate(LONG_MODULES)}

    def order(item: pytest.Item) -> tuple[int, int]:
        module = _module_of(item)
        return (0, rank[module]) if module in rank else (1, 0) if module in slow else (2, 0)

    items.sort(key=order)  # stable: modules of one rank keep their order, tests within a module theirs
