"""Sessions on the executor: the port in the argv and the environment (no shell), a work directory that outlives the
placement, and the proxy of ``logs_http`` to the session's port, which counts as traffic."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
from gpuorch_contracts import JobSpec, LaunchJob, ProcessRun, SessionSpec, StopJob

from gpuorch_executor.domain.sessions import expand, is_session, proxied_path, session_launch
from gpuorch_executor.logs_http import LogServer, SessionTarget

from .conftest import NODE, Harness

TOKEN = "node-credential"
# serves its own GPUORCH_* variables and cwd, and keeps a counter in a file of its work directory
SESSION = """
import http.server, json, os, sys
count = os.path.join(os.environ['GPUORCH_WORK_DIR'], 'visits')
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        visits = int(open(count).read()) + 1 if os.path.exists(count) else 1
        open(count, 'w').write(str(visits))
        body = json.dumps({'path': self.path, 'argv_port': sys.argv[1], 'visits': visits, 'cwd': os.getcwd(),
                           **{k: v for k, v in os.environ.items() if k.startswith('GPUORCH_') and 'URL' in k
                              or k in ('GPUORCH_PORT', 'GPUORCH_WORK_DIR')}}).encode()
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Handler).serve_forever()
"""


def test_expansion_is_kubernetes_like_and_shell_free() -> None:
    variables = {"GPUORCH_PORT": "8123", "GPUORCH_BASE_URL": "/sessions/x/", "GPUORCH_WORK_DIR": "/w"}
    assert expand("--port=$(GPUORCH_PORT)", variables) == "--port=8123"
    assert expand("$$(GPUORCH_PORT) $(HOME) `id` $(GPUORCH_BASE_URL)", variables) == \
        "$(GPUORCH_PORT) $(HOME) `id` /sessions/x/"
    job = uuid.uuid4()
    assert proxied_path(job, "/a/b", "q=1", True) == "/a/b?q=1"
    assert proxied_path(job, "", "", False) == f"/sessions/{job}/"
    launch = LaunchJob(node_id=NODE, job_id=job, placement_id=uuid.uuid4(), spec=JobSpec(
        tier="interactive", run=ProcessRun(argv=["srv", "$(GPUORCH_PORT)"], env={"GPUORCH_PORT": "1"})))
    run = session_launch(launch, 8123, Path("/w")).spec.run
    assert isinstance(run, ProcessRun)
    assert run.argv == ["srv", "8123"] and run.env["GPUORCH_PORT"] == "8123" and run.workdir == "/w"
    assert is_session(launch) and not is_session(launch.model_copy(update={"spec": JobSpec(run=run)}))


def _session(job_id: uuid.UUID) -> LaunchJob:
    spec = JobSpec(tier="interactive", session=SessionSpec(idle_park_after_s=60),
                   run=ProcessRun(argv=["python", "-c", SESSION, "$(GPUORCH_PORT)"]))
    return LaunchJob(node_id=NODE, job_id=job_id, placement_id=uuid.uuid4(), spec=spec)


async def test_a_session_is_proxied_and_keeps_its_work_directory_across_placements(harness: Harness) -> None:
    job_id = uuid.uuid4()
    executor = harness.executor
    server = LogServer(TOKEN, [], lambda j: False, session=lambda j: (
        SessionTarget(r.session_port, r.session_strip_prefix) if (r := executor.session(j)) and r.session_port
        else None), requested=executor.session_requested, exec_launch=executor.exec_launch)
    url = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            visits = []
            for _ in range(2):  # a placement, parked (stopped), then resumed as another placement
                launch = _session(job_id)
                await executor.handle(launch)
                await harness.until(lambda: executor.session(job_id) is not None)
                record = executor.session(job_id)
                assert record is not None and record.session_port is not None
                executor.session_requests[job_id] -= 100  # as if idle for 100 s
                assert executor.session_idle_s(record) >= 99
                answer = None
                async with asyncio.timeout(20):
                    while answer is None or answer.status_code == 502:  # until it listens
                        answer = await http.get(f"/jobs/{job_id}/proxy/tree/a?x=1")
                        await asyncio.sleep(0.05)
                assert answer.status_code == 200, answer.text
                seen = answer.json()
                work_dir = str(harness.state_dir.parent / "sessions" / str(job_id))
                assert seen["path"] == "/tree/a?x=1" and seen["argv_port"] == str(record.session_port)
                assert seen["GPUORCH_PORT"] == str(record.session_port)
                assert seen["GPUORCH_BASE_URL"] == f"/sessions/{job_id}/"
                assert seen["GPUORCH_WORK_DIR"] == work_dir and seen["cwd"] == work_dir
                assert executor.session_idle_s(record) < 5  # the request counted as traffic
                visits.append(seen["visits"])
                # gpuctl exec: a command inside the running placement (its env and cwd), output streamed
                ran = await http.post(f"/jobs/{job_id}/exec", json={"argv": [
                    "python", "-c", "import os; print(os.getcwd(), os.environ['GPUORCH_PORT'])"]})
                assert ran.status_code == 200
                assert ran.content == f"{work_dir} {record.session_port}\n\0exit=0\n".encode()
                refused = await http.post(f"/jobs/{job_id}/exec", json={"argv": ["bash", "-c", "id"]})
                assert refused.status_code == 403 and "allow" in refused.text
                await executor.handle(StopJob(node_id=NODE, job_id=job_id, placement_id=launch.placement_id,
                                              reason="preempt", grace_s=5))
                await harness.until_ended(launch.placement_id)
            assert visits == [1, 2]  # the second placement found the file the first one wrote
            assert (await http.get(f"/jobs/{job_id}/proxy/")).status_code == 404  # no running session
            assert (await http.get(f"/jobs/{job_id}/proxy/", headers={"Authorization": "Bearer x"})).status_code \
                == 401
    finally:
        await server.close()
