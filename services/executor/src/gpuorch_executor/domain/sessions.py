"""Interactive sessions on a node: the port, the variables and the argv a session runs with (pure).

A session (tier ``interactive``) gets, on top of every job's environment (``domain.environment``):

- ``GPUORCH_PORT``: a free TCP port of its node, which it must listen on (on 127.0.0.1 or any address); the
  executor's proxy (``logs_http``, ``/jobs/<id>/proxy/``) forwards the API's requests there;
- ``GPUORCH_BASE_URL``: ``/sessions/<job id>/``, the path prefix its pages are served under by the API;
- ``GPUORCH_WORK_DIR``: its working directory (its default cwd), ``<sessions dir>/<job id>``, which outlives the
  placement: a parked session resumes with the files it left there.

``$(GPUORCH_PORT)`` (and ``$(GPUORCH_BASE_URL)``, ``$(GPUORCH_WORK_DIR)``) in the argv is replaced by the value, as
Kubernetes expands ``$(VAR)`` in a container's args; ``$$(`` stands for a literal ``$(``. No shell is involved.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from gpuorch_contracts import ContainerRun, LaunchJob, ProcessRun

_REFERENCE = re.compile(r"\$\$\(|\$\((GPUORCH_PORT|GPUORCH_BASE_URL|GPUORCH_WORK_DIR)\)")


def is_session(launch: LaunchJob) -> bool:
    return launch.spec.tier == "interactive"


def base_url(job_id: uuid.UUID) -> str:
    return f"/sessions/{job_id}/"


def session_variables(job_id: uuid.UUID, port: int, work_dir: Path) -> dict[str, str]:
    return {"GPUORCH_PORT": str(port), "GPUORCH_BASE_URL": base_url(job_id), "GPUORCH_WORK_DIR": str(work_dir)}


def expand(argument: str, variables: dict[str, str]) -> str:
    """``argument`` with each ``$(GPUORCH_...)`` of ``variables`` replaced and ``$$(`` turned into ``$(``."""
    return _REFERENCE.sub(lambda m: "$(" if m.group(0) == "$$(" else variables[m.group(1)], argument)


def session_launch(launch: LaunchJob, port: int, work_dir: Path) -> LaunchJob:
    """The launch as the session runs it: its argv expanded, the session variables in its env (they win over the
    spec's), and (a process without a ``workdir``) its work directory as cwd."""
    variables = session_variables(launch.job_id, port, work_dir)
    run = launch.spec.run
    changes: dict[str, object] = {"argv": [expand(a, variables) for a in run.argv], "env": {**run.env, **variables}}
    if isinstance(run, ProcessRun) and run.workdir is None:
        changes["workdir"] = str(work_dir)
    expanded: ProcessRun | ContainerRun = run.model_copy(update=changes)
    return launch.model_copy(update={"spec": launch.spec.model_copy(update={"run": expanded})})


def proxied_path(job_id: uuid.UUID, rest: str, query: str, strip_prefix: bool) -> str:
    """The request target the session receives for ``/jobs/<id>/proxy/<rest>?<query>``: ``/<rest>`` when the
    prefix is stripped, ``/sessions/<id>/<rest>`` when the session serves under ``GPUORCH_BASE_URL``."""
    path = ("/" if strip_prefix else base_url(job_id)) + rest.lstrip("/")
    return f"{path}?{query}" if query else path
