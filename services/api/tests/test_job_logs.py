"""Job logs through the API and the executor's real ``logs_http.LogServer``: ``since`` (a duration or a time),
``tail`` and ``timestamps`` reach the node, whose time index (``log_times``, written as the executor's watch writes
it) decides which lines were written since when."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
from gpuorch_client.logs import LogsRefused, job_logs
from gpuorch_executor.log_times import LogTimes
from gpuorch_executor.logs_http import LogServer
from gpuorch_identity import log_credential
from gpuorch_messaging import Broker

from .conftest import TOKENS, RunningApi, announce, auth

pytestmark = pytest.mark.integration


async def _seed_running(dsn: str, job_id: uuid.UUID) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, assignments, node_ids,
                                 submitted_at, started_at)
               VALUES ($1, 'train', 'acme', 'batch', 'normal', 'running', $2::text::jsonb, '[]', $3, $4, $4)""",
            job_id, json.dumps({"run": {"runtime": "process", "argv": ["python", "train.py"]}}), ["n1"],
            datetime.now(UTC) - timedelta(hours=2))
    finally:
        await conn.close()


async def test_since_tail_and_timestamps_pass_through_the_api_to_the_nodes_log_index(
        api: RunningApi, migrated_dsn: str, amqp_url: str, tmp_path: Path) -> None:
    job_id = uuid.uuid4()
    await _seed_running(migrated_dsn, job_id)
    log_file = tmp_path / str(job_id) / f"{uuid.uuid4()}.log"
    log_file.parent.mkdir()
    now = time.time()
    times = LogTimes()
    log_file.write_bytes(b"an hour ago\n")
    times.note(log_file, now - 3600)
    with log_file.open("ab") as handle:
        handle.write(b"a minute ago\n")
    times.note(log_file, now - 60, final=True)

    api.backends.logs.secret = "issuing-secret"
    executor = LogServer(log_credential("issuing-secret", "guest"), [tmp_path], lambda _: False)
    node_url = await executor.start("127.0.0.1", 0)
    publisher = Broker(amqp_url, producer="executor")
    await publisher.connect()
    try:
        await announce(api, publisher, node_url)
        async with httpx.AsyncClient(base_url=api.url, headers=auth("acme")) as http:
            async def logs(**params: str) -> httpx.Response:
                return await http.get(f"/api/v1/jobs/{job_id}/logs", params=params)

            assert (await logs()).text == "an hour ago\na minute ago\n"
            assert (await logs(since="10m")).text == "a minute ago\n"
            assert (await logs(since="2h")).text == "an hour ago\na minute ago\n"
            assert (await logs(since="30s")).text == ""
            half_an_hour_ago = datetime.fromtimestamp(now - 1800, UTC).replace(tzinfo=None).isoformat()
            assert (await logs(since=half_an_hour_ago)).text == "a minute ago\n"  # a time, UTC without a zone
            assert (await logs(tail="1")).text == "a minute ago\n"
            assert (await logs(since="2h", tail="1")).text == "a minute ago\n"
            stamped = (await logs(timestamps="1")).text.splitlines()
            assert [line.split(" ", 1)[1] for line in stamped] == ["an hour ago", "a minute ago"]
            assert [datetime.fromisoformat(line.split(" ", 1)[0]).timestamp() for line in stamped] == [
                pytest.approx(now - 3600, abs=0.002), pytest.approx(now - 60, abs=0.002)]
            bad = await logs(since="yesterday")
            assert bad.status_code == 422 and "since" in bad.text
            assert (await logs(tail="-1")).status_code == 422
        # the typed client's reader (gpuctl's `logs --since` sends the same query)
        read = [line async for line in job_logs(api.url, TOKENS["acme"], job_id, since=timedelta(minutes=10))]
        assert read == ["a minute ago"]
        stamped_lines = [line async for line in job_logs(api.url, TOKENS["acme"], job_id, since="2h", tail=1,
                                                          timestamps=True)]
        assert len(stamped_lines) == 1 and stamped_lines[0].endswith("Z a minute ago")
        with pytest.raises(LogsRefused) as refused:
            [line async for line in job_logs(api.url, TOKENS["research"], job_id)]
        assert refused.value.status == 404  # another tenant's job: not disclosed
    finally:
        await publisher.close()
        await executor.close()
