"""gpuctl's interactive sessions (issue 27, docs/sessions.md): all through the API of the current context.

    gpuctl session start --gpus 1 [--mig P | --share F] [--idle-park-after 30m] [--image I@sha256:..] -- CMD
                                        POST /api/v1/jobs (tier interactive), then waits until it runs; prints its URL
    gpuctl session list                 GET  /api/v1/sessions
    gpuctl session open ID              its URL (resumes a parked session first, and waits until it runs)
    gpuctl session park ID              POST /api/v1/sessions/ID/park
    gpuctl session resume ID            POST /api/v1/sessions/ID/resume, then waits until the scheduler took it (or
                                        says why the owner's session caps refused it)
    gpuctl session stop ID              POST /api/v1/jobs/ID/cancel
    gpuctl exec ID -- CMD               POST /api/v1/jobs/ID/exec: CMD inside any running job's sandbox, streamed

A URL is the API's ``/sessions/<id>/``; a browser opens it with ``?token=`` once (the API then keeps the token in a
cookie for that path only), a program sends ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Annotated, Any

import typer

from gpuorch_gpuctl.api_client import ApiClient, api
from gpuorch_gpuctl.errors import USAGE, fail

session_app = typer.Typer(help="Interactive sessions: a job with a port, reached through the API, parked when "
                               "idle and resumed on the next request.", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
IdArg = Annotated[str, typer.Argument(help="the session's job id (or a unique prefix)")]
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """``30m``, ``20s``, ``2h``, ``90`` (seconds) -> seconds; ValueError otherwise."""
    found = _DURATION.match(text)
    if found is None:
        raise ValueError(f"{text!r} is not a duration such as 20s, 30m, 2h")
    return float(found.group(1)) * _UNIT_S[found.group(2) or "s"]


def session_spec(argv: list[str], *, gpus: int, mig: str | None, share: float | None, park_after: str | None,
                 keep_prefix: bool, name: str | None, tenant: str | None, priority: str | None,
                 env: list[str] | None, image: str | None = None) -> dict[str, Any]:
    """The JobSpec fields of a session (tier interactive); raises ValueError for a wrong combination."""
    if sum([mig is not None, share is not None]) > 1:
        raise ValueError("--mig and --share exclude each other")
    resources: dict[str, Any] = {"gpus": gpus}
    if mig is not None:
        resources = {"mig_profiles": [mig]}
    elif share is not None:
        if not 0 < share < 1:
            raise ValueError("--share is a fraction of one GPU, between 0 and 1 (0.25)")
        resources = {"gpu_milli": max(1, round(share * 1000))}
    session: dict[str, Any] = {"strip_prefix": not keep_prefix}
    if park_after is not None:
        session["idle_park_after_s"] = duration_s(park_after)
    run: dict[str, Any] = {"runtime": "process", "argv": argv,
                           "env": dict(item.split("=", 1) for item in (env or []) if "=" in item)}
    if image is not None:
        run.update({"runtime": "container", "image": image})
    spec: dict[str, Any] = {"tier": "interactive", "resources": resources, "session": session, "run": run}
    spec.update({k: v for k, v in (("name", name), ("tenant", tenant), ("priority_class", priority)) if v})
    return spec


def url_of(client: ApiClient, job_id: str) -> str:
    return f"{client.endpoint.server.rstrip('/')}/sessions/{job_id}/"


def wait_running(client: ApiClient, job_id: str, timeout_s: float) -> dict[str, Any]:
    """Poll the session until it runs (its state on stderr as it changes); ``fail`` if it ends or times out."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while True:
        job = client.find(f"/api/v1/jobs/{job_id}") or {"state": "submitted"}  # not in the read model yet
        state = job["state"]
        if state != seen:
            waiting = f": {job.get('pending_reason')}" if job.get("pending_reason") else ""
            typer.echo(f"{state}{waiting}", err=True)
            seen = state
        if state == "running":
            return dict(job)
        if state in ("succeeded", "failed", "cancelled", "rejected"):
            fail(f"session {job_id} {state}: {job.get('reason') or 'no reason given'}")
        if time.monotonic() > deadline:
            fail(f"session {job_id} is still {state} after {timeout_s:g} s")
        time.sleep(0.5)


def resume_and_wait(client: ApiClient, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Ask to resume a parked session and wait until the scheduler took the resume (the session no longer parked);
    ``fail`` with the scheduler's reason when its owner's caps refused it (the row rewritten, ``updated_at``
    moved, with a ``pending_reason``), or when it is still parked after ``timeout_s``."""
    client.post(f"/api/v1/sessions/{job['id']}/resume")
    deadline = time.monotonic() + timeout_s
    while True:
        now = client.get(f"/api/v1/jobs/{job['id']}")
        if now["state"] != "parked":
            return dict(now)
        if now.get("pending_reason") and now.get("updated_at") != job.get("updated_at"):
            fail(f"session {job['id']} stays parked: {now['pending_reason']}")
        if time.monotonic() > deadline:
            why = f" (last refusal: {now['pending_reason']})" if now.get("pending_reason") else ""
            fail(f"session {job['id']} is still parked after {timeout_s:g} s{why}")
        time.sleep(0.5)


@session_app.command("start")
def start(
    argv: Annotated[list[str], typer.Argument(help="the command, after --; $(GPUORCH_PORT) becomes its port")],
    gpus: Annotated[int, typer.Option(help="whole GPUs", min=0)] = 1,
    mig: Annotated[str | None, typer.Option(help="a MIG profile instead of whole GPUs (1g.10gb)")] = None,
    share: Annotated[float | None, typer.Option(help="a share of one GPU instead (0.25)")] = None,
    idle_park_after: Annotated[str | None, typer.Option(help="park after this long idle (20s, 30m, 2h); default: "
                                                       "the tenant's")] = None,
    keep_prefix: Annotated[bool, typer.Option(help="forward /sessions/<id>/ to the app (it serves under "
                                              "GPUORCH_BASE_URL, as Jupyter's --ServerApp.base_url)")] = False,
    name: Annotated[str | None, typer.Option(help="session name")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant (default: yours)")] = None,
    priority: Annotated[str | None, typer.Option(help="critical | high | normal | low")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the session (repeatable)")] = None,
    image: Annotated[str | None, typer.Option(help="run CMD in this container image (pinned: repo@sha256:...); "
                                              "it must listen on 0.0.0.0:$(GPUORCH_PORT)")] = None,
    wait: Annotated[bool, typer.Option(help="wait until it runs and print its URL")] = True,
    timeout: Annotated[float, typer.Option(help="give up waiting after this many seconds")] = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Start a session: gpuctl session start --gpus 1 --idle-park-after 30m -- python -m http.server
    '$(GPUORCH_PORT)'. Prints its URL once it runs."""
    try:
        spec = session_spec(argv, gpus=gpus, mig=mig, share=share, park_after=idle_park_after,
                            keep_prefix=keep_prefix, name=name, tenant=tenant, priority=priority, env=env,
                            image=image)
    except ValueError as exc:
        fail(f"invalid session: {exc}", USAGE)
    with api() as client:
        job_id = client.post("/api/v1/jobs", {"spec": spec})["job_id"]
        url = url_of(client, job_id)
        if wait:
            wait_running(client, job_id, timeout)
    print(json.dumps({"job_id": job_id, "url": url}) if as_json else url)


@session_app.command("list")
def list_sessions(as_json: JsonOpt = False) -> None:
    """Your sessions, newest first: state, node, URL."""
    with api() as client:
        rows = client.get("/api/v1/sessions")
        server = client.endpoint.server.rstrip("/")
    if as_json:
        print(json.dumps([{**row, "url": server + row["url"]} for row in rows], default=str))
        return
    for row in rows:
        nodes = ",".join(row.get("nodes") or []) or "-"
        print(f"{row['id']}  {row['state']:<10} {nodes:<12} {server}{row['url']}")


@session_app.command("open")
def open_session(job_id: IdArg, timeout: Annotated[float, typer.Option(help="seconds to wait for it to run")] = 600.0,
                 as_json: JsonOpt = False) -> None:
    """The session's URL, once it runs (a parked session is resumed first)."""
    with api() as client:
        job = client.get(f"/api/v1/jobs/{job_id}")
        if job["state"] == "parked":
            resume_and_wait(client, job, timeout)
        wait_running(client, job["id"], timeout)
        url = url_of(client, job["id"])
    print(json.dumps({"job_id": job["id"], "url": url}) if as_json else url)


def _action(job_id: str, action: str, as_json: bool) -> None:
    with api() as client:
        answer = client.post(f"/api/v1/sessions/{job_id}/{action}")
    print(json.dumps(answer, default=str) if as_json else f"{action} requested: {answer['job_id']}")


@session_app.command("park")
def park(job_id: IdArg, as_json: JsonOpt = False) -> None:
    """Park a running session now: checkpoint stop, GPU freed, work directory kept."""
    _action(job_id, "park", as_json)


@session_app.command("resume")
def resume(job_id: IdArg, timeout: Annotated[float, typer.Option(
        help="seconds to wait for the scheduler to take the resume")] = 60.0, as_json: JsonOpt = False) -> None:
    """Resume a parked session (opening its URL does too) and wait until it is queued again; fails with the reason
    when its owner's session caps refuse it (park or stop another session first)."""
    with api() as client:
        job = client.get(f"/api/v1/jobs/{job_id}")
        if job["state"] != "parked":
            fail(f"session {job['id']} is {job['state']}: only a parked session resumes")
        now = resume_and_wait(client, job, timeout)
        answer = {"job_id": job["id"], "state": now["state"], "url": url_of(client, job["id"])}
    print(json.dumps(answer) if as_json else f"resumed: {job['id']} ({now['state']})")


@session_app.command("stop")
def stop(job_id: IdArg, as_json: JsonOpt = False) -> None:
    """End a session (its checkpoint signal, then stopped); its work directory is not kept for it any more."""
    with api() as client:
        answer = client.post(f"/api/v1/jobs/{job_id}/cancel", {"reason": "session stopped by its owner"})
    print(json.dumps(answer, default=str) if as_json else f"stop requested: {answer['job_id']}")


EXIT_MARK = b"\0exit="


def exec_command(
    job_id: Annotated[str, typer.Argument(help="a running job's id (or a unique prefix)")],
    argv: Annotated[list[str], typer.Argument(help="the command, after --")],
    as_json: Annotated[bool, typer.Option("--json", help="print {output, exit_code} as JSON once it ended "
                                          "instead of streaming")] = False,
) -> None:
    """Run a command inside a running job's sandbox (its uid, devices, cgroups, environment and working
    directory) and stream its output: gpuctl exec ID -- ls -la. Exits with the command's exit code. The tenant's
    allow-list judges the command as it judges jobs."""
    tail, kept = b"", bytearray()
    out = sys.stdout.buffer

    def emit(data: bytes) -> None:
        if as_json:
            kept.extend(data)
        else:
            out.write(data)
            out.flush()

    with api() as client:
        for chunk in client.stream_bytes("POST", f"/api/v1/jobs/{job_id}/exec", {"argv": argv}):
            data = tail + chunk
            cut = max(0, len(data) - len(EXIT_MARK) - 12)  # hold back what may be the start of the exit line
            emit(data[:cut])
            tail = data[cut:]
    output, mark, code = tail.rpartition(EXIT_MARK)
    emit(output if mark else tail)
    if not mark:
        fail("the command's output ended without its exit code (the node or the API went away)")
    exit_code = int(code.strip() or 1)
    if as_json:
        print(json.dumps({"output": kept.decode(errors="replace"), "exit_code": exit_code}))
    raise typer.Exit(exit_code)
