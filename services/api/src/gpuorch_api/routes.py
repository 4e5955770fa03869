"""HTTP handlers: each parses a request, asks ``auth`` who calls, reads (``readmodels``) or publishes (``gateway``),
and shapes the answer with ``domain.views``. Errors are problem details (problems.py): ``detail`` one line.

    GET  /healthz, /readyz                        no token (/metrics: on GPUORCH_METRICS_PORT, an internal port)
    GET  /api/v1/whoami                           the caller: identity, role, tenants
    GET  /api/v1/jobs?state=&tenant=&tier=&q=&sort=&limit=&cursor=
                                                  a page of the caller's tenants' jobs (operator: all); headers
                                                  X-Total-Count, X-Next-Cursor, Link rel=next
    POST /api/v1/jobs                             {"spec": JobSpec, "job_id"?: uuid} -> 202 {"job_id"}, Location
    GET  /api/v1/jobs/{id}                        spec, state, reason, placement, timeline, usage, advice, trace link
    GET  /api/v1/jobs?array={id}                  the tasks of one array, by index (an array is otherwise one row)
    POST /api/v1/jobs/{id}/cancel                 {"reason"?, "array_tasks"?: "0-9"} -> 202, Location (the job);
                                                  409 when the job has already ended
    POST /api/v1/jobs/{id}/priority               {"priority_class"} (operators) -> 202, Location; 409 once ended
    POST /api/v1/jobs/{id}/resubmit               an ended job queued again as a new job (same spec) -> 202, Location
    POST /api/v1/jobs/{id}/parallelism            {"parallelism": N | null} -> 202, Location (an array's)
    GET  /api/v1/jobs/{id}/logs?follow=1          the job's output, fetched from its node's executor;
                                                  &since=10m|<time> &tail=N &timestamps=1
    GET  /api/v1/jobs/{id}/utilisation            utilisation and memory per device over the job's life (chart series)
    GET  /api/v1/nodes/{node}/utilisation?since=1h  per GPU of the node, over time (chart series)
    GET  /api/v1/nodes, /queues, /tenants         fleet, queues per tier, allocation against quota and use
    GET  /api/v1/usage?days=7                     GPU-hours per day and tenant: allocated, used, idle
    GET  /api/v1/share                            fair share over time per tenant (as sshare): share, decayed usage,
                                                  factor
    GET  /api/v1/report?since=7d&from=&to=&tenant= the weekly review (``gpuorch_report``) of the caller's tenants
    GET  /api/v1/events                           Server-Sent Events (``live``)
    GET  /api/v1/events/recent?since=1h&limit=    the newest logged events the caller sees, newest first
    (dead letters, for operators: dlq_routes.py)

A job of a tenant the caller does not see answers 404, exactly as a job that does not exist, on reads, cancels and
log reads alike (its existence is not disclosed). A job reference is a job id or a unique prefix of one, found
through the primary key's index (``readmodels.resolve``).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from gpuorch_contracts import JobSpec
from gpuorch_contracts.arrays import MAX_ARRAY_PARALLELISM, IndexText
from gpuorch_contracts.jobs import TERMINAL_STATES, JobState, PriorityClass, Tier
from gpuorch_contracts.text import ShortText, TenantName
from gpuorch_identity import authorize_job_access
from gpuorch_observability import READINESS
from gpuorch_report import WeeklyReport, parse_since, resolve_period
from pydantic import BaseModel, ConfigDict, Field

from gpuorch_api import schemas
from gpuorch_api.auth import ApiError, Caller, Forbidden, authenticate
from gpuorch_api.backends import Backends
from gpuorch_api.domain import views
from gpuorch_api.domain.series import SeriesWindow
from gpuorch_api.node_logs import log_since
from gpuorch_api.oidc import verifier_for
from gpuorch_api.readmodels import JOB_SORTS, JobCursor

router = APIRouter()


class SubmitRequest(BaseModel):
    """A submission: the SubmitJob spec (fields it omits, such as ``tenant``, get the caller's defaults)."""

    model_config = ConfigDict(extra="forbid")
    spec: JobSpec
    job_id: uuid.UUID | None = None


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: ShortText = "cancelled by user"
    array_tasks: IndexText | None = None


class ParallelismRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parallelism: int | None = Field(ge=1, le=MAX_ARRAY_PARALLELISM)


class PriorityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority_class: PriorityClass
AcceptedStatus = Literal["submitted", "resubmitted", "cancel requested", "priority change requested",
                         "parallelism change requested"]


class Accepted(BaseModel):
    job_id: uuid.UUID
    status: AcceptedStatus


def backends(request: Request) -> Backends:
    """The app's backends; 503 with why while they are still connecting (a server down at start)."""
    return connected_backends(request.app)


def connected_backends(app: Any) -> Backends:
    found: Backends | None = getattr(app.state, "backends", None)
    if found is None:
        raise ApiError(503, f"not ready: {_not_ready()}")
    return found


def _not_ready() -> str:
    _, answers = READINESS.report()
    return "; ".join(f"{name}: {why}" for name, why in answers.items() if why != "ok") or "starting"


BackendsDep = Annotated[Backends, Depends(backends)]


BEARER = HTTPBearer(auto_error=False, scheme_name="bearer", description="an API token of the identity map")
"""The security scheme of every /api/ route (OpenAPI ``securitySchemes``); auth.authenticate answers 401."""


def caller(request: Request,
           credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> Caller:
    identity_map = backends(request).identity_map
    return authenticate(identity_map, credentials.credentials if credentials else None, verifier_for(identity_map.oidc))


CallerDep = Annotated[Caller, Depends(caller)]


@router.get("/healthz", tags=["health"])
async def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["health"])
async def readyz(request: Request) -> JSONResponse:
    """Ready when the database and the broker are reachable (503 with what is not, also while still connecting)."""
    svc = getattr(request.app.state, "backends", None)
    problems = await svc.problems() if svc is not None else [f"connecting: {_not_ready()}"]
    if problems:
        return JSONResponse({"status": "not ready", "error": "; ".join(problems)}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/api/v1/whoami", tags=["auth"], response_model=schemas.Caller)
async def whoami(who: CallerDep) -> dict[str, Any]:
    tenants = who.tenants
    return {"identity": who.name, "user": who.user, "role": who.identity.role, "tenants": sorted(tenants) if tenants is not None
            else ["*"], "default_tenant": who.identity.default_tenant, "max_priority": who.identity.max_priority}


SortText = Annotated[str, Query(pattern=f"^-?({'|'.join(k for k in JOB_SORTS if k != 'index')})$", description=(
    "order: submitted, name, state, tenant, tier or ended; a leading `-` for descending (default `-submitted`, "
    "newest first); ties are broken by job id"))]


@router.get("/api/v1/jobs", tags=["jobs"], response_model=list[schemas.JobSummary],
            responses={200: {"headers": {
                "X-Total-Count": {"description": "jobs matching the filters, on every page together",
                                  "schema": {"type": "integer"}},
                "X-Next-Cursor": {"description": "the next page's `cursor` (absent on the last page)",
                                  "schema": {"type": "string"}},
                "Link": {"description": "`<next page URL>; rel=\"next\"` (absent on the last page)",
                         "schema": {"type": "string"}}}}})
async def list_jobs(
    who: CallerDep, svc: BackendsDep, request: Request, response: Response,
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    tenant: Annotated[TenantName | None, Query(description="only this tenant's jobs")] = None,
    tier: Annotated[Tier | None, Query(description="only this tier")] = None,
    limit: Annotated[int, Query(ge=1, le=5000, description="at most this many jobs on the page")] = 100,
    array: Annotated[str | None, Query(description="an array's id (or prefix): list its tasks")] = None,
    q: Annotated[str | None, Query(max_length=100, description=(
        "search: a name containing this (any case), or a job id starting with it"))] = None,
    sort: SortText = "-submitted",
    cursor: Annotated[str | None, Query(max_length=500, description=(
        "where to go on: the `X-Next-Cursor` of the previous page (opaque; stable while jobs are added)"))] = None,
) -> list[dict[str, Any]]:
    """A page of jobs, newest first unless ``sort`` says otherwise: the caller's tenants' (an operator's: every
    tenant's); an array is one row with its tasks counted. With ``array``: that array's tasks, by index.

    The body stays a plain list (clients from before paging keep working); the page's metadata is in headers:
    ``X-Total-Count`` (every matching job), ``X-Next-Cursor`` and ``Link rel="next"`` while more follow. The cursor
    is a keyset (the last row's sort value and id), so jobs submitted while a client pages never shift or repeat
    a row of a later page."""
    if tenant is not None and not who.sees(tenant):
        raise Forbidden(f"{who.name} may not read jobs of tenant {tenant!r}")
    array_id = (await _visible_job(svc, who, array))["job_id"] if array is not None else None
    try:
        after = JobCursor.decode(cursor, sort) if cursor else None
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    rows, total = await svc.read.jobs(tenants=who.tenants, state=state, tenant=tenant, tier=tier, limit=limit + 1,
                                      array=array_id, search=q, sort=sort, after=after, with_total=True)
    response.headers["X-Total-Count"] = str(total)
    if len(rows) > limit:
        rows = rows[:limit]
        following = JobCursor(rows[-1]["sort_value"], rows[-1]["job_id"]).encode(sort)
        response.headers["X-Next-Cursor"] = following
        response.headers["Link"] = f'<{request.url.include_query_params(cursor=following)}>; rel="next"'
    return [views.job_view(r) for r in rows]


@router.post("/api/v1/jobs", status_code=202, tags=["jobs"])
async def submit_job(body: SubmitRequest, who: CallerDep, svc: BackendsDep, request: Request,
                     response: Response) -> Accepted:
    """Publish a SubmitJob on the caller's behalf; the answer (accepted/rejected) follows as an event and in the
    job's state, at ``Location``. 403 when the identity map does not let the caller submit this spec."""
    message = await svc.gateway.submit(who, body.spec, body.job_id)
    await svc.read.record_submission(message.job_id, who.name, message.spec.model_dump(mode="json"))
    return _accepted(request, response, message.job_id, "submitted")


def _accepted(request: Request, response: Response, job_id: uuid.UUID, status: AcceptedStatus) -> Accepted:
    """A 202's body, with ``Location``: the job, where what was asked will show."""
    response.headers["Location"] = str(request.url_for("get_job", job_ref=str(job_id)))
    return Accepted(job_id=job_id, status=status)


async def _visible_job(svc: Backends, who: Caller, job_ref: str) -> dict[str, Any]:
    job_id = await svc.read.resolve(job_ref, tenants=who.tenants)
    job = await svc.read.job(job_id) if job_id is not None else None
    if job is None:
        raise ApiError(404, f"no job {job_ref!r} (or several match: give more characters)")
    return job


@router.get("/api/v1/jobs/{job_ref}", tags=["jobs"], response_model=schemas.JobDetail)
async def get_job(job_ref: str, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """One job (id or unique prefix): spec, state, reason, placement, timeline, usage so far, telemetry's advice
    and alerts, and a link to its trace."""
    job = await _visible_job(svc, who, job_ref)
    out = views.job_view(job, full=True)
    out["timeline"] = await svc.read.timeline(job["job_id"], job["submitted_at"], job["ended_at"])
    out["usage"] = await svc.read.usage(job["job_id"], job["started_at"] or job["submitted_at"])
    out["advice"] = await svc.read.advice(job["job_id"])
    out["trace_url"] = trace_url(svc.jaeger_url, job["job_id"], job["submitted_at"], job["ended_at"])
    return out


TRACE_SERVICE = "gpuorch-scheduler"
"""The service Jaeger's search looks in (it needs one): the scheduler admits every job, however it was submitted
(API, ``gpuctl --amqp-url``, another system on the broker), and its ``scheduler.admit`` span is in the job's trace."""
JOB_ID_TAG = "job_id"
"""The attribute ``gpuorch_observability.job_span`` sets on every span of a job (scheduler, executor, telemetry,
the outbox's publishes) and the API's submission span sets too; ``tests/test_trace_link.py`` holds them together."""


def trace_url(jaeger_url: str | None, job_id: uuid.UUID, since: datetime, until: datetime | None = None) -> str | None:
    """Jaeger UI's search (``/search?service=&tags=``, tags as URL-encoded JSON as its search form sends them) for
    the job's spans, over the job's lifetime (a minute before it was submitted to five after it ended, or now)."""
    if not jaeger_url:
        return None
    tags = json.dumps({JOB_ID_TAG: str(job_id)}, separators=(",", ":"))
    start = since - timedelta(minutes=1)
    end = (until or datetime.now(UTC)) + timedelta(minutes=5)
    query = urlencode({"service": TRACE_SERVICE, "tags": tags, "lookback": "custom", "limit": 20,
                       "start": int(start.timestamp() * 1e6), "end": int(end.timestamp() * 1e6)}, quote_via=quote)
    return f"{jaeger_url.rstrip('/')}/search?{query}"


@router.post("/api/v1/jobs/{job_ref}/cancel", status_code=202, tags=["jobs"],
             responses={409: {**schemas.ERRORS[403], "description": "the job has already ended"}})
async def cancel_job(job_ref: str, who: CallerDep, svc: BackendsDep, request: Request, response: Response,
                     body: CancelRequest | None = None) -> Accepted:
    """Publish a CancelJob on the caller's behalf (a running job gets its checkpoint signal, then is stopped).
    409 for a job that has already ended (an array: every task has)."""
    job = await _job_for_action(svc, who, job_ref)
    if job["state"] in TERMINAL_STATES:
        raise ApiError(409, f"job {job['job_id']} has already ended ({job['state']}): nothing to cancel")
    body = body or CancelRequest()
    if body.array_tasks is not None and _array_of(job) is None:
        raise ApiError(400, f"job {job['job_id']} is not an array: array_tasks names tasks of an array")
    await svc.gateway.cancel(who, job, body.reason, body.array_tasks)
    return _accepted(request, response, job["job_id"], "cancel requested")


@router.post("/api/v1/jobs/{job_ref}/resubmit", status_code=202, tags=["jobs"],
             responses={409: {**schemas.ERRORS[403], "description": "the job has not ended"}})
async def resubmit_job(job_ref: str, who: CallerDep, svc: BackendsDep, request: Request,
                       response: Response) -> Accepted:
    """Queue an ended job again (the dashboard's requeue): a new job with the same spec, submitted on the
    caller's behalf and judged as any submission (403 when the caller may not submit it). Its id is in the answer
    and ``Location``. 409 for a job still queued or running (cancel it first); 400 for a task of an array."""
    job = await _visible_job(svc, who, job_ref)
    if job["state"] not in TERMINAL_STATES:
        raise ApiError(409, f"job {job['job_id']} has not ended ({job['state']}): cancel it first")
    if job.get("array_id") is not None:
        raise ApiError(400, f"job {job['job_id']} is a task of array {job['array_id']}: resubmit the array")
    spec = JobSpec.model_validate(job["spec"])
    message = await svc.gateway.submit(who, spec)
    await svc.read.record_submission(message.job_id, who.name, message.spec.model_dump(mode="json"))
    return _accepted(request, response, message.job_id, "resubmitted")  # job_id: the new job


@router.post("/api/v1/jobs/{job_ref}/priority", status_code=202, tags=["jobs"],
             responses={409: {**schemas.ERRORS[403], "description": "the job has already ended"}})
async def set_priority(job_ref: str, body: PriorityRequest, who: CallerDep, svc: BackendsDep, request: Request,
                       response: Response) -> Accepted:
    """Publish a SetJobPriority on the caller's behalf: the job's place in the queue and which jobs it may preempt
    follow the new class. Operators only (403 for anyone else); 409 for a job that has already ended, 400 for an
    array (change its tasks' class by resubmitting it)."""
    job = await _job_for_action(svc, who, job_ref)
    if not who.is_operator:
        raise Forbidden(f"{who.name} is not an operator: a job's priority is changed by operators")
    if job["state"] in TERMINAL_STATES:
        raise ApiError(409, f"job {job['job_id']} has already ended ({job['state']}): nothing to change")
    if _array_of(job) is not None:
        raise ApiError(400, f"job {job['job_id']} is an array: its priority is its tasks'; resubmit it")
    await svc.gateway.set_priority(who, job, body.priority_class)
    return _accepted(request, response, job["job_id"], "priority change requested")


@router.post("/api/v1/jobs/{job_ref}/parallelism", status_code=202, tags=["jobs"],
             responses={409: {**schemas.ERRORS[403], "description": "the array has already ended"}})
async def set_parallelism(job_ref: str, body: ParallelismRequest, who: CallerDep, svc: BackendsDep,
                          request: Request, response: Response) -> Accepted:
    """Publish a SetArrayParallelism on the caller's behalf: at most ``parallelism`` tasks of the array run at once
    (running tasks keep running when it is lowered). 409 for an array that has already ended."""
    job = await _job_for_action(svc, who, job_ref)
    if _array_of(job) is None:
        raise ApiError(400, f"job {job['job_id']} is not an array")
    if job["state"] in TERMINAL_STATES:
        raise ApiError(409, f"array {job['job_id']} has already ended ({job['state']}): nothing to change")
    await svc.gateway.set_parallelism(who, job, body.parallelism)
    return _accepted(request, response, job["job_id"], "parallelism change requested")


def _array_of(job: dict[str, Any]) -> Any:
    """The job's ``array`` field when it is an array (its tasks carry the same spec, and an ``array_id``)."""
    spec = job["spec"]
    spec = json.loads(spec) if isinstance(spec, str) else spec
    return None if job.get("array_id") is not None else (spec or {}).get("array")


async def _job_for_action(svc: Backends, who: Caller, job_ref: str) -> dict[str, Any]:
    """The job a cancel or a log read names: the same 404 for another tenant's job as for none (``_visible_job``),
    so that a caller cannot learn that a job id exists."""
    return await _visible_job(svc, who, job_ref)


@router.get("/api/v1/jobs/{job_ref}/logs", tags=["jobs"], response_class=StreamingResponse)
async def job_logs(job_ref: str, who: CallerDep, svc: BackendsDep,
                   follow: Annotated[bool, Query(description="keep sending what the job writes until it ends")] = False,
                   node: Annotated[str | None, Query(description="for a gang job: which of its nodes")] = None,
                   since: Annotated[str | None, Query(
                       max_length=40, description="only lines written since: a duration back from now (30s, 10m, "
                       "2h, 7d) or a time (2026-12-05T09:00, UTC without a zone); a line's time is when its "
                       "executor saw it, at most about a second late")] = None,
                   tail: Annotated[int | None, Query(ge=0, description="only the last N lines (of those since)")]
                   = None,
                   timestamps: Annotated[bool, Query(description="each line prefixed with its time (RFC 3339, UTC) "
                                                     "and a space")] = False,
                   ) -> StreamingResponse:
    """The job's output (stdout and stderr), fetched from the executor of the node it ran on, whichever node."""
    try:
        since_unix = log_since(since, datetime.now(UTC)) if since else None
    except ValueError as exc:
        raise ApiError(422, f"since: {exc}") from exc
    job = await _job_for_action(svc, who, job_ref)
    refused = authorize_job_access(svc.identity_map, who.name, job["tenant"])
    if refused is not None:
        raise Forbidden(refused.reason)
    nodes = job["node_ids"] or []
    if not nodes:
        raise ApiError(404, f"job {job['job_id']} has no log: it never ran (state {job['state']})")
    if node is not None and node not in nodes:
        raise ApiError(404, f"job {job['job_id']} did not run on {node!r} (its nodes: {', '.join(nodes)})")
    chunks = await svc.logs.open(node or nodes[0], job["job_id"], follow=follow, since=since_unix, tail=tail,
                                 timestamps=timestamps)
    return StreamingResponse(chunks, media_type="text/plain; charset=utf-8", headers={"Cache-Control": "no-cache"})


@router.get("/api/v1/nodes", tags=["fleet"], response_model=list[schemas.Node])
async def list_nodes(who: CallerDep, svc: BackendsDep) -> list[dict[str, Any]]:
    """Every node: liveness, last seen, GPUs and MIG slices free or allocated, live usage, health, isolation.
    Jobs of tenants the caller does not see are shown without their id."""
    now = datetime.now(UTC)
    nodes = await svc.read.nodes()
    return [views.node_view(n, n["allocations"], now, who.tenants) for n in nodes]


@router.get("/api/v1/jobs/{job_ref}/utilisation", tags=["jobs"], response_model=schemas.Series)
async def job_utilisation(job_ref: str, who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """Utilisation and memory of each device the job held, from its start to its end (or now), read from
    telemetry's rollups (raw samples for a run shorter than half an hour). 404 for a job the caller does not see."""
    job = await _visible_job(svc, who, job_ref)
    start = job["started_at"] or job["submitted_at"]
    window = SeriesWindow.pick(start, job["ended_at"] or datetime.now(UTC))
    return await svc.read.job_series(job["job_id"], window)


@router.get("/api/v1/nodes/{node_id}/utilisation", tags=["fleet"], response_model=schemas.Series)
async def node_utilisation(node_id: str, who: CallerDep, svc: BackendsDep,
                           since: Annotated[str, Query(pattern=r"^\s*\d+(\.\d+)?\s*[mhdw]\s*$", description=(
                               "how far back: 30m, 12h, 7d (at most 31d)"))] = "1h") -> dict[str, Any]:
    """Utilisation and memory of each GPU of the node over the last ``since`` (rollups, or raw samples for a
    window under half an hour). Whole GPUs, as ``/nodes`` shows them to everyone: no job or tenant is named."""
    back = parse_since(since)
    if back > timedelta(days=31):
        raise ApiError(400, f"since={since}: at most 31d")
    now = datetime.now(UTC)
    return await svc.read.gpu_series(node_id, SeriesWindow.pick(now - back, now))


@router.get("/api/v1/mig/plan", tags=["fleet"], response_model=schemas.MigPlan)
async def mig_plan(who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """What the scheduler's MIG planner would change now and why (mode advise: recommendations; auto: carried
    out), the reconfigurations under way and each GPU's last reconfigurations. Job ids only for operators."""
    found = await svc.read.mig_plan()
    if found is None:
        return {"mode": "unknown", "proposals": [], "under_way": [], "history": []}
    plan = found["plan"]

    def shown(item: dict[str, Any]) -> dict[str, Any]:
        if who.is_operator:
            return item
        return {**{k: v for k, v in item.items() if k not in ("drains", "enables", "preempted")},
                "drains": len(item.get("drains", [])), "enables": len(item.get("enables", []))}

    return {"mode": found["mode"], "updated_at": found["updated_at"],
            "proposals": [shown(p) for p in plan.get("proposals", [])], "unmet_jobs": plan.get("unmet_jobs", 0),
            "held_back": plan.get("held_back", 0), "under_way": [shown(e) for e in found["under_way"]],
            "history": [{"node_id": n, "gpu_index": g, "ended_at": times} for n, g, times in found["history"]]}


@router.get("/api/v1/queues", tags=["fleet"], response_model=list[schemas.Queue])
async def list_queues(who: CallerDep, svc: BackendsDep) -> list[dict[str, Any]]:
    """Per tier: depth, oldest wait, pending reasons, next estimated starts (of the caller's tenants' jobs)."""
    return views.queue_views(await svc.read.queued(tenants=who.tenants), datetime.now(UTC))


@router.get("/api/v1/tenants", tags=["fleet"], response_model=list[schemas.Tenant])
async def list_tenants(who: CallerDep, svc: BackendsDep) -> list[dict[str, Any]]:
    """Per tenant the caller sees: GPUs allocated, quota, GPUs used (allocation x mean utilisation)."""
    also = who.tenants if who.tenants is not None else frozenset(svc.quotas)
    return views.tenant_views(await svc.read.tenant_use(tenants=who.tenants), svc.quotas, also)


@router.get("/api/v1/share", tags=["fleet"], response_model=schemas.FairShare)
async def fair_share(who: CallerDep, svc: BackendsDep) -> dict[str, Any]:
    """Fair share over time, per tenant the caller sees (as Slurm's sshare): share, decayed usage (GPU-hours
    weighted by GPU model, halved every half-life) and the resulting factor, as the scheduler last computed them."""
    found = await svc.read.fair_share()
    if found is None:
        return {"tenants": []}
    return {**found, "tenants": [t for t in found["tenants"] if who.sees(t["tenant"])]}


@router.get("/api/v1/usage", tags=["fleet"], response_model=list[schemas.DailyUsage])
async def usage(who: CallerDep, svc: BackendsDep,
                days: Annotated[int, Query(ge=1, le=92, description="the last N days")] = 7) -> list[dict[str, Any]]:
    """GPU-hours per UTC day and tenant (the caller's): allocated, used (allocation x utilisation), idle."""
    return await svc.read.usage_by_day(tenants=who.tenants, days=days)


@router.get("/api/v1/report", tags=["fleet"], response_model=WeeklyReport)
async def weekly_report(
    who: CallerDep, svc: BackendsDep,
    since: Annotated[str, Query(description="how far back: 30m, 12h, 7d, 2w (unless from)", max_length=16)] = "7d",
    start: Annotated[str | None, Query(alias="from", max_length=40,
                                       description="start: 2026-11-24, 2026-11-24T09:00 or 7d")] = None,
    end: Annotated[str | None, Query(alias="to", max_length=40,
                                     description="end (exclusive), same forms; default now")] = None,
    tenant: Annotated[TenantName | None, Query(description="only this tenant (one of the caller's)")] = None,
) -> WeeklyReport:
    """The weekly review: per tenant and job, GPUs and memory allocated against used, mean and p95 utilisation,
    idle GPU-hours, utilisation over time, queue wait by request shape, and conclusions. A submitter's report
    covers its own tenants (fleet-wide lines name nodes and pools, never another tenant's jobs)."""
    if tenant is not None and not who.sees(tenant):
        raise Forbidden(f"{who.name} may not read the report of tenant {tenant!r}")
    try:
        period = resolve_period(datetime.now(UTC), since, start, end)
    except ValueError as exc:
        raise ApiError(422, str(exc)) from exc
    return await svc.read.report(period, tenants={tenant} if tenant is not None else who.tenants, tenant=tenant)


@router.get("/api/v1/events/recent", tags=["live"], response_model=list[schemas.RecentEvent])
async def recent_events(
    who: CallerDep, svc: BackendsDep,
    since: Annotated[str, Query(description="how far back: 30m, 12h, 7d", max_length=16)] = "1h",
    limit: Annotated[int, Query(ge=1, le=1000, description="at most N events, the newest")] = 100,
) -> list[dict[str, Any]]:
    """The newest events of the caller's tenants' jobs and of the fleet, from the scheduler's log and telemetry's
    detections, newest first (what ``/api/v1/events`` would have streamed; ``gpuctl events``, like ``kubectl get
    events``)."""
    try:
        back = parse_since(since)
    except ValueError as exc:
        raise ApiError(422, f"since: {exc}") from exc
    return await svc.read.recent_events(tenants=who.tenants, since=datetime.now(UTC) - back, limit=limit)


@router.get("/api/v1/events", tags=["live"], response_class=StreamingResponse)
async def events(who: CallerDep, svc: BackendsDep) -> StreamingResponse:
    """Server-Sent Events: the caller's tenants' job events and fleet events, live (nothing from before)."""
    return StreamingResponse(svc.streams.stream(who), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
