"""``gpuctl session resume``: it waits for the scheduler's answer and says why a resume was refused (pure: a fake
API client answering as the read model would)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from gpuorch_gpuctl.session_cmd import resume_and_wait

PARKED = {"id": "j1", "state": "parked", "pending_reason": None, "updated_at": "t0"}
REFUSED = "resume refused: alice already has 1 live session(s), its cap (park or stop one first)"


class FakeApi:
    """Answers GET /api/v1/jobs/j1 with ``rows`` in turn (the last one for ever); records the POSTs."""

    def __init__(self, *rows: dict[str, Any]) -> None:
        self.rows, self.posted = list(rows), []  # type: ignore[var-annotated]

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        self.posted.append(path)
        return {}

    def get(self, path: str) -> dict[str, Any]:
        assert path == "/api/v1/jobs/j1"
        return self.rows.pop(0) if len(self.rows) > 1 else self.rows[0]


def test_a_resume_the_scheduler_takes_returns_the_queued_session() -> None:
    api = FakeApi(PARKED, {**PARKED, "state": "queued", "updated_at": "t1"})
    assert resume_and_wait(api, PARKED, 5)["state"] == "queued"  # type: ignore[arg-type]
    assert api.posted == ["/api/v1/sessions/j1/resume"]


def test_a_resume_over_the_cap_fails_with_the_schedulers_reason(capsys: pytest.CaptureFixture[str]) -> None:
    stale = {**PARKED, "pending_reason": REFUSED}  # an earlier refusal: not this resume's answer yet
    api = FakeApi(stale, stale, {**stale, "updated_at": "t2"})
    with pytest.raises(typer.Exit) as ended:
        resume_and_wait(api, stale, 5)  # type: ignore[arg-type]
    assert ended.value.exit_code == 1
    assert capsys.readouterr().err == f"gpuctl: session j1 stays parked: {REFUSED}\n"


def test_a_container_session_spec_names_its_image() -> None:
    from gpuorch_contracts import JobSpec
    from gpuorch_gpuctl.session_cmd import session_spec

    image = "registry.example/lab/jupyter@sha256:" + "c" * 64
    spec = session_spec(["jupyter", "lab", "--port", "$(GPUORCH_PORT)"], gpus=1, mig=None, share=None,
                        park_after="30m", keep_prefix=True, name=None, tenant=None, priority=None, env=None,
                        image=image)
    run = JobSpec.model_validate(spec).run
    assert (run.runtime, getattr(run, "image", None), run.argv[-1]) == ("container", image, "$(GPUORCH_PORT)")
