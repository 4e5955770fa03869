"""Admission through a gateway (the API): a SubmitJob/CancelJob naming ``on_behalf_of`` is judged as that identity
when its verified publisher is the gateway, and refused when anyone else names it (decision 25)."""

from __future__ import annotations

import asyncpg
import pytest
from gpuorch_contracts import CancelJob, ProcessRun, SubmitJob
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.scheduler import SchedulerConfig

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])
MAP = IdentityMap(identities={
    "api": Identity(role="gateway"),
    "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme"),
    "research-ci": Identity(role="submitter", tenants=["research"], default_tenant="research"),
})


def submit(on_behalf_of: str | None, tenant: str | None = None) -> SubmitJob:
    spec = {"run": RUN.model_dump(mode="json"), **({"tenant": tenant} if tenant else {})}
    return SubmitJob.model_validate({"spec": spec, "on_behalf_of": on_behalf_of})


async def test_on_behalf_of_is_honoured_from_the_gateway_only(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig(identity=MAP))
        await service.recover()
        for_acme, forged, as_itself, other_tenant = (
            submit("acme-ci"), submit("acme-ci"), submit(None, "acme"), submit("acme-ci", "research"))
        await service.handle_batch([for_acme, forged, as_itself, other_tenant],
                                   senders=["api", "research-ci", "api", "api"])
        rows = {r["job_id"]: r for r in await conn.fetch("SELECT job_id, state, tenant, reason FROM jobs")}
        assert (rows[for_acme.job_id]["state"], rows[for_acme.job_id]["tenant"]) == ("queued", "acme")
        assert rows[forged.job_id]["state"] == "rejected"
        assert "only a gateway" in rows[forged.job_id]["reason"]
        assert "gateway" in rows[as_itself.job_id]["reason"]  # the gateway never submits as itself
        assert "may not submit for tenant 'research'" in rows[other_tenant.job_id]["reason"]

        # cancel: another tenant's identity through the gateway changes nothing; the job's own tenant cancels it
        await service.handle_batch([CancelJob(job_id=for_acme.job_id, on_behalf_of="research-ci")], senders=["api"])
        assert service.state.jobs[for_acme.job_id].state == "queued"
        await service.handle_batch([CancelJob(job_id=for_acme.job_id, on_behalf_of="acme-ci")], senders=["api"])
        assert service.state.jobs[for_acme.job_id].state == "cancelled"
    finally:
        await conn.close()
