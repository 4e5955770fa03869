"""The API's limits (issue 29, the smaller items): what one request or one caller may cost, and what a wrong job id
tells.

- A 200 MB body is refused with 413 before it is read or its sender authenticated, with Content-Length or streamed
  without it, and the API process's memory stays flat (the real ``gpuorch-api`` process, its RSS measured).
- Each token has its own rate limit (the ``limits`` library); made-up tokens share their address's budget.
- A NUL (or another control character) in a path gives 400, never 500.
- Another tenant's job answers 404 on read, cancel and logs, exactly as a job that does not exist; a job-id prefix
  is looked up as a range of the primary key (its index), never by a scan.
- ``/metrics`` is not on the API's port; it is on the internal metrics port.
"""

from __future__ import annotations

import select
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest
from gpuorch_api.backends import open_backends
from gpuorch_api.entrypoint import create_app
from gpuorch_api.limits import RateLimits
from gpuorch_api.readmodels import RESOLVE_SQL, ReadModels, job_id_range
from gpuorch_gpuctl_ops.stack import LocalStack, free_port
from gpuorch_messaging import Broker

from services.api.tests.conftest import IDENTITY_MAP, auth, serve

pytestmark = [pytest.mark.security, pytest.mark.integration]

BIG = 200 * 1024 * 1024


@pytest.fixture
async def exchanges(amqp_url: str) -> AsyncIterator[None]:
    declarer = Broker(amqp_url, producer="test")  # declares the gpuorch exchanges, as the services do
    await declarer.connect()
    yield
    await declarer.close()


@pytest.fixture
def api_process(amqp_url: str, migrated_dsn: str, exchanges: None, tmp_path: Path) -> Iterator[tuple[str, int, int]]:
    """The real ``gpuorch-api`` (URL, pid, metrics port) with the API tests' identity map."""
    stack = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=migrated_dsn, nodes=[],
                       identity_map=IDENTITY_MAP.model_dump(mode="json"), extra_env={"GPUORCH_IDENTITY": "strict"})
    metrics_port = free_port()
    try:
        url = stack.start_api(GPUORCH_METRICS_PORT=str(metrics_port))
        popen = stack.processes["api"].popen
        assert popen is not None
        yield url, popen.pid, metrics_port
    finally:
        stack.stop_all()


def _status_line(sock: socket.socket) -> str:
    sock.settimeout(30)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0].decode()


def _settled_rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def test_a_200_mb_body_is_refused_before_it_is_read_and_memory_stays_flat(api_process: tuple[str, int, int]) -> None:
    url, pid, _ = api_process
    port = int(url.rsplit(":", 1)[1])
    before = _settled_rss(pid)
    # declared: the answer comes while only the headers were sent, without a token (before authentication)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {BIG}\r\n\r\n".encode())
        assert _status_line(sock).startswith("HTTP/1.1 413")
    # streamed without Content-Length: refused once past the limit, while the sender is still sending
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n" % (1024 * 1024) + b"[" * (1024 * 1024) + b"\r\n"
        try:
            while sent < BIG and not select.select([sock], [], [], 0)[0]:
                sock.sendall(piece)
                sent += 1024 * 1024
        except OSError:
            pass  # the API closed the connection after answering
        status = _status_line(sock) if select.select([sock], [], [], 5)[0] else ""
    assert sent < BIG, "the API read a 200 MB body to its end"
    assert status == "" or status.startswith("HTTP/1.1 413"), status
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    grown = _settled_rss(pid) - before
    print(f"API RSS {before / 2**20:.0f} MiB -> {(before + grown) / 2**20:.0f} MiB; streamed {sent / 2**20:.0f} MiB")
    assert grown < 48 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_metrics_are_on_the_internal_port_not_the_apis(api_process: tuple[str, int, int]) -> None:
    url, _, metrics_port = api_process
    assert httpx.get(f"{url}/api/v1/jobs", headers=auth("acme"), timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 404
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'gpuorch_api_requests_total{code="200",method="GET",route="/api/v1/jobs"}' in text


@pytest.fixture
async def limited_api(amqp_url: str, migrated_dsn: str, exchanges: None, request: pytest.FixtureRequest
                      ) -> AsyncIterator[str]:
    """The API in process: 5 requests a minute per caller, or the default limits for tests marked ``roomy``."""
    limits = RateLimits() if request.node.get_closest_marker("roomy") else RateLimits("5/minute")
    backends = await open_backends(amqp_url=amqp_url, database_url=migrated_dsn, identity_map=IDENTITY_MAP)
    try:
        async with serve(create_app(backends=backends, rate_limits=limits)) as url:
            yield url
    finally:
        await backends.close()


async def test_each_token_has_its_own_rate_limit_and_made_up_tokens_share_their_address(limited_api: str) -> None:
    async with httpx.AsyncClient(base_url=limited_api, timeout=10) as http:
        answers = [(await http.get("/api/v1/whoami", headers=auth("acme"))).status_code for _ in range(6)]
        assert answers == [200] * 5 + [429]
        limited = await http.get("/api/v1/whoami", headers=auth("acme"))
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert "rate limit" in limited.json()["error"]
        assert (await http.get("/api/v1/whoami", headers=auth("research"))).status_code == 200  # its own budget
        made_up = [(await http.get("/api/v1/whoami", headers={"Authorization": f"Bearer {uuid.uuid4()}"})).status_code
                   for _ in range(6)]
        assert made_up == [401] * 5 + [429]
        assert (await http.get("/healthz")).status_code == 200  # health is not rate limited


@pytest.mark.parametrize("path", ["/api/v1/jobs/%00", "/api/v1/jobs/abc%00def/cancel", "/%00", "/api/v1/dlq/%00/replay",
                                  "/api/v1/jobs/%0a", "/index.html%00.js", "/api/v1/nodes%00"])
async def test_a_nul_in_the_path_gives_400_not_500(limited_api: str, path: str) -> None:
    async with httpx.AsyncClient(base_url=limited_api, timeout=10) as http:
        answer = await http.request("POST" if path.endswith(("cancel", "replay")) else "GET", path,
                                    headers=auth("ops"))
    assert answer.status_code == 400 and "control character" in answer.json()["error"]


@pytest.mark.roomy
async def test_not_yours_and_not_there_get_the_same_404(limited_api: str, migrated_dsn: str) -> None:
    theirs = uuid.uuid4()
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute("""INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, assignments,
                                                node_ids, submitted_at, started_at)
                              VALUES ($1, 'x', 'research', 'batch', 'normal', 'running', '{}', '[]', '{n1}', now(),
                                      now())""", theirs)
    finally:
        await conn.close()
    nowhere = uuid.UUID(int=theirs.int ^ 1)
    async with httpx.AsyncClient(base_url=limited_api, timeout=10) as http:
        for ref in (str(theirs), str(theirs)[:8]):
            for method, suffix in (("GET", ""), ("POST", "/cancel"), ("GET", "/logs")):
                mine = await http.request(method, f"/api/v1/jobs/{ref}{suffix}", headers=auth("acme"))
                none = await http.request(method, f"/api/v1/jobs/{str(nowhere)[:len(ref)]}{suffix}",
                                          headers=auth("acme"))
                assert (mine.status_code, none.status_code) == (404, 404), (method, suffix, mine.text)
                assert mine.json()["error"].replace(ref, "REF") == none.json()["error"].replace(
                    str(nowhere)[:len(ref)], "REF")
        assert (await http.get(f"/api/v1/jobs/{str(theirs)[:8]}", headers=auth("research"))).status_code == 200


def test_job_id_prefixes_are_ranges_of_the_id() -> None:
    job = uuid.UUID("3fa85f64-5717-4562-b3fc-2c963f66afa6")
    for prefix in ("3", "3fa85f64", "3FA85F64-57", "3fa85f64-5717-4562-b3fc-2c963f66afa6"):
        bounds = job_id_range(prefix)
        assert bounds is not None and bounds[0] <= job <= bounds[1], prefix
    assert job_id_range("3fa85f645717") is None  # a dash belongs after 8 digits
    for bad in ("", "\x00", "3fa8%", "3fa8_", "g", "3fa85f64-5717-4562-b3fc-2c963f66afa6-", "' OR 1=1 --"):
        assert job_id_range(bad) is None, bad


async def test_prefix_lookup_uses_the_primary_key_index(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        ids = [uuid.uuid4() for _ in range(50)]
        await conn.executemany("""INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec,
                                      assignments, node_ids, submitted_at)
                                  VALUES ($1, 'x', 'acme', 'batch', 'normal', 'queued', '{}', '[]', '{}', now())""",
                               [(i,) for i in ids])
        await conn.execute("ANALYZE jobs")
        await conn.execute("SET enable_seqscan = off")  # a plan that cannot use the index shows a Seq Scan anyway
        low, high = job_id_range(str(ids[0])[:6]) or (ids[0], ids[0])
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + RESOLVE_SQL, low, high, ["acme"]))
        assert "jobs_pkey" in plan and "Seq Scan on jobs" not in plan, plan
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(migrated_dsn, min_size=1, max_size=2)
    try:
        read = ReadModels(pool)
        assert await read.resolve(str(ids[0]), tenants={"acme"}) == ids[0]
        assert await read.resolve(str(ids[0]).upper()[:36], tenants={"acme"}) == ids[0]
        assert await read.resolve(str(ids[0]), tenants={"research"}) is None
        assert await read.resolve("", tenants=None) is None and await read.resolve("\x00", tenants=None) is None
        shortest_unique = next(n for n in range(1, 37) if sum(str(i).startswith(str(ids[0])[:n]) for i in ids) == 1)
        assert await read.resolve(str(ids[0])[:shortest_unique], tenants=None) == ids[0]
        if shortest_unique > 1:  # a shorter prefix matches several: none is chosen
            assert await read.resolve(str(ids[0])[:shortest_unique - 1], tenants=None) is None
    finally:
        await pool.close()
