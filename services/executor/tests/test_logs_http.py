"""The executor's log endpoint: the service token, the job id as the only input, and follow until the job's
placement is no longer active."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest

from gpuorch_executor.logs_http import LogServer

TOKEN = "service-token"


@pytest.fixture
async def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    job_id = uuid.uuid4()
    log_file = tmp_path / "logs" / str(job_id) / f"{uuid.uuid4()}.log"
    log_file.parent.mkdir(parents=True)
    log_file.write_text("line 1\n")
    running = {job_id}
    server = LogServer(TOKEN, [tmp_path / "logs"], lambda j: j in running, poll_s=0.02)
    url = await server.start("127.0.0.1", 0)
    try:
        yield url, job_id, log_file, running
    finally:
        await server.close()


async def test_only_the_token_reads_and_only_a_job_id_reaches_the_disk(served) -> None:  # type: ignore[no-untyped-def]
    url, job_id, _, running = served
    running.clear()
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get(f"/jobs/{job_id}/logs")).status_code == 401
        assert (await http.get(f"/jobs/{job_id}/logs", headers={"Authorization": "Bearer nope"})).status_code == 401
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert (await http.get(f"/jobs/{job_id}/logs", headers=ok)).text == "line 1\n"
        assert (await http.get("/jobs/..%2F..%2Fetc/logs", headers=ok)).status_code == 400
        assert (await http.get(f"/jobs/{uuid.uuid4()}/logs", headers=ok)).status_code == 404
        assert (await http.get("/healthz")).status_code == 200


async def test_follow_sends_what_the_job_writes_until_its_placement_ends(served) -> None:  # type: ignore[no-untyped-def]
    url, job_id, log_file, running = served
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, http.stream(
            "GET", f"/jobs/{job_id}/logs", params={"follow": "1"},
            headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        received = b""
        chunks = response.aiter_raw()
        while b"line 1\n" not in received:
            received += await anext(chunks)
        with log_file.open("a") as handle:
            handle.write("line 2\n")
        while b"line 2\n" not in received:
            received += await anext(chunks)
        with log_file.open("a") as handle:
            handle.write("last line\n")
        running.clear()  # the placement ended: the rest is sent, then the response ends
        async with asyncio.timeout(10):
            async for chunk in chunks:
                received += chunk
    assert received == b"line 1\nline 2\nlast line\n"
