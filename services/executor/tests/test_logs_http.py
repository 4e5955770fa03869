"""The executor's log endpoint: the service token, the job id as the only input, and follow until the job's
placement is no longer active."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import websockets

from gpuorch_executor.log_times import read_index
from gpuorch_executor.logs_http import READ_CHUNK, LogServer, SessionTarget, tail_offset

from .conftest import Harness, launch_job

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


WAITS_FOR_TRIGGER = ("import os, sys, time\nprint('early', flush=True)\n"
                     "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\nprint('late', flush=True)\n")


async def test_since_tail_and_timestamps_use_the_times_the_executor_saw_the_log_grow(
        harness: Harness, tmp_path: Path) -> None:
    """A real job writes a line, the watch indexes it; the next line is written after ``since``: ``since`` serves
    only that one, ``timestamps`` dates both (the raw log stays as written), ``tail`` counts lines."""
    trigger = tmp_path / "go"
    launch = launch_job(["python", "-c", WAITS_FOR_TRIGGER, str(trigger)])
    await harness.executor.handle(launch)
    log_file = harness.executor.store.log_path(launch.job_id, launch.placement_id)
    await harness.until(lambda: bool(read_index(log_file)) and read_index(log_file)[-1][0] >= len(b"early\n"))
    between = time.time()
    trigger.touch()
    await harness.until_ended(launch.placement_id)
    assert log_file.read_bytes() == b"early\nlate\n"
    entries = read_index(log_file)
    assert entries[-1][0] == len(b"early\nlate\n") and entries[-1][1] >= between

    server = LogServer(TOKEN, [harness.executor.store.logs_dir], lambda j: False)
    url = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            path = f"/jobs/{launch.job_id}/logs"
            assert (await http.get(path, params={"since": str(between)})).text == "late\n"
            assert (await http.get(path, params={"since": str(between - 3600)})).text == "early\nlate\n"
            assert (await http.get(path, params={"since": str(time.time() + 60)})).text == ""
            assert (await http.get(path, params={"tail": "1"})).text == "late\n"
            assert (await http.get(path, params={"tail": "0"})).text == ""
            assert (await http.get(path, params={"tail": "5"})).text == "early\nlate\n"
            assert (await http.get(path, params={"tail": "x"})).status_code == 400
            stamped = (await http.get(path, params={"timestamps": "1"})).text.splitlines()
            times = [datetime.fromisoformat(line.split(" ", 1)[0]).timestamp() for line in stamped]
            assert [line.split(" ", 1)[1] for line in stamped] == ["early", "late"]
            assert times[0] < between <= times[1]
            assert (await http.get(path)).text == "early\nlate\n"  # the raw bytes, unchanged, by default
    finally:
        await server.close()


def test_tail_offset_counts_lines_across_reads_and_a_last_line_without_newline(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"a\n" + b"b" * (READ_CHUNK + 10) + b"\nc")
    assert log.read_bytes()[tail_offset(log, 1):] == b"c"
    assert log.read_bytes()[tail_offset(log, 2):] == b"b" * (READ_CHUNK + 10) + b"\nc"
    assert tail_offset(log, 3) == 0 and tail_offset(log, 9) == 0
    log.write_bytes(b"a\nb\n")
    assert log.read_bytes()[tail_offset(log, 1):] == b"b\n"


async def test_a_websocket_is_relayed_to_the_session_with_its_subprotocol_and_refusals_are_answers() -> None:
    job_id = uuid.uuid4()

    async def echo(socket: websockets.ServerConnection) -> None:
        assert socket.request is not None
        async for message in socket:
            text = message if isinstance(message, str) else message.decode()
            await socket.send(f"{text} {socket.request.path} {socket.request.headers.get('x-forwarded-prefix')} "
                              f"{socket.request.headers.get('authorization')}")

    session = await websockets.serve(echo, "127.0.0.1", 0, subprotocols=["v2"])  # type: ignore[list-item]
    port = session.sockets[0].getsockname()[1]
    traffic: list[uuid.UUID] = []
    server = LogServer(TOKEN, [], lambda j: False, requested=traffic.append,
                       session=lambda j: SessionTarget(port, True) if j == job_id else None)
    url = (await server.start("127.0.0.1", 0)).replace("http", "ws", 1)
    ok = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for headers, target, status in (({}, job_id, 401), (ok, uuid.uuid4(), 404)):
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"{url}/jobs/{target}/proxy/ws", additional_headers=headers):
                    pass
            assert refused.value.response.status_code == status
            assert refused.value.response.headers["x-gpuorch-executor"] == "1"  # the endpoint's own answer
        async with websockets.connect(f"{url}/jobs/{job_id}/proxy/ws?a=1", additional_headers=ok,
                                      subprotocols=["v1", "v2"]) as socket:  # type: ignore[list-item]
            assert socket.subprotocol == "v2"
            await socket.send("hi")
            assert await socket.recv() == f"hi /ws?a=1 /sessions/{job_id} None"  # no credential passed on
        assert traffic.count(job_id) >= 3  # the handshake and each message
    finally:
        await server.close()
        session.close()
