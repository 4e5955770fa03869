"""/readyz is 503 with each failing check's reason until every check passes; /healthz answers regardless."""

from __future__ import annotations

import asyncio
import json

import httpx
from gpuorch_observability.health import Readiness, keep_probing
from gpuorch_observability.metrics import start_metrics_server


def test_readiness_names_what_fails_and_turns_ready_once_all_checks_pass() -> None:
    readiness = Readiness()
    port = start_metrics_server(_port(), "127.0.0.1", readiness=readiness)
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/readyz").status_code == 503, "nothing registered yet: not ready"
    readiness.mark("consuming", "starting")
    readiness.add("broker", lambda: None)
    readiness.add("broken", lambda: 1 / 0)  # type: ignore[func-returns-value]
    answer = httpx.get(f"{base}/readyz")
    assert answer.status_code == 503
    checks = json.loads(answer.text)["checks"]
    assert checks["consuming"] == "starting" and checks["broker"] == "ok" and "ZeroDivisionError" in checks["broken"]
    readiness.add("broken", lambda: None)
    readiness.mark("consuming", None)
    assert httpx.get(f"{base}/readyz").json() == {"ready": True, "checks": {"broken": "ok", "broker": "ok",
                                                                             "consuming": "ok"}}
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert "python_info" in httpx.get(f"{base}/metrics").text


def test_a_probe_marks_its_check_by_its_last_outcome() -> None:
    readiness = Readiness()
    outcomes = [RuntimeError("refused"), None]

    async def probe() -> None:
        outcome = outcomes.pop(0) if outcomes else None
        if outcome is not None:
            raise outcome

    async def scenario() -> list[dict[str, str]]:
        seen = []
        task = asyncio.create_task(keep_probing("database", probe, failing="PostgreSQL unreachable", period_s=0.01,
                                                readiness=readiness))
        while len(seen) < 2 or seen[-1]["database"] != "ok":
            await asyncio.sleep(0.005)
            report = readiness.report()[1]
            if not seen or seen[-1] != report:
                seen.append(report)
        task.cancel()
        return seen

    seen = asyncio.run(scenario())
    assert any("PostgreSQL unreachable: RuntimeError('refused')" in s["database"] for s in seen)
    assert seen[-1]["database"] == "ok"


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
