"""gpuctl's job arrays and dependencies: Slurm's ``--array`` and ``--dependency`` for ``submit``, and ``gpuctl array``.

    gpuctl submit --array 0-11%3 --dependency afterok:ID[:ID],afterany:ID -- cmd     spec.array, spec.depends_on
    gpuctl array set ID --parallelism N            POST /api/v1/jobs/ID/parallelism {"parallelism": N}
    gpuctl array cancel ID --tasks 3,5-9           POST /api/v1/jobs/ID/cancel {"array_tasks": "3,5-9"}
    gpuctl jobs --array ID                         GET  /api/v1/jobs?array=ID (the tasks, by index)

A dependency's ID may be a unique prefix: it is resolved through the API to the full id before submitting.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import typer

from gpuorch_gpuctl.api_client import api
from gpuorch_gpuctl.errors import USAGE, fail

array_app = typer.Typer(help="Steer job arrays: their parallelism, and cancels of some of their tasks.",
                        no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
CONDITIONS = ("afterok", "afternotok", "afterany", "aftercorr")


def dependencies(text: str, resolve: Callable[[str], str]) -> list[dict[str, str]]:
    """``afterok:ID[:ID...][,condition:ID...]`` (Slurm's ``--dependency``) as ``JobSpec.depends_on`` entries;
    ``resolve`` turns an id or unique prefix into the full id. Raises ValueError with the reason."""
    found: list[dict[str, str]] = []
    for part in text.split(","):
        condition, _, ids = part.strip().partition(":")
        if condition not in CONDITIONS or not ids:
            raise ValueError(f"--dependency: {part!r} is not CONDITION:ID[:ID...] with CONDITION one of "
                             f"{', '.join(CONDITIONS)}")
        found += [{"condition": condition, "job_id": resolve(job)} for job in ids.split(":") if job]
    return found


def array_field(text: str) -> dict[str, Any]:
    """``0-11%3`` -> the spec's ``array`` (``{"indices": "0-11", "parallelism": 3}``); raises ValueError. The
    indices are checked here where the job contracts are installed, else by the API (``_check_indices``)."""
    indices, _, parallelism = text.partition("%")
    if parallelism and not parallelism.isdigit():
        raise ValueError(f"array parallelism: {parallelism!r} is not a number")
    _check_indices(indices)
    return {"indices": indices, **({"parallelism": int(parallelism)} if parallelism else {})}


def _check_indices(text: str) -> None:
    """Slurm's index syntax checked by the contracts' own parser (raises ValueError) where they are installed (the
    workspace, gpuorch-gpuctl-ops); the thin client alone leaves it to the API (its 422: exit 2 as well)."""
    try:
        from gpuorch_contracts import parse_indices
    except ModuleNotFoundError:
        return
    parse_indices(text)


def resolver(client: Any) -> Callable[[str], str]:
    """Full ids as they are; a prefix through the API (``fail`` when it names no job or several)."""
    def resolve(ref: str) -> str:
        try:
            return str(uuid.UUID(ref))
        except ValueError:
            job = client.find(f"/api/v1/jobs/{ref}")
            if job is None:
                fail(f"--dependency: no job {ref!r} (or several match: give more characters)", USAGE)
            return str(job["id"])

    return resolve


@array_app.command("set")
def set_parallelism(
    array_id: Annotated[str, typer.Argument(help="the array's job id (or a unique prefix)")],
    parallelism: Annotated[int, typer.Option(help="at most this many tasks at once (0: as many as fit)", min=0)],
    as_json: JsonOpt = False,
) -> None:
    """Change how many tasks of an array run at once (running tasks keep running when it is lowered)."""
    with api() as client:
        answer = client.post(f"/api/v1/jobs/{array_id}/parallelism", {"parallelism": parallelism or None})
    print(json.dumps({"job_id": answer["job_id"], "parallelism": parallelism or None}) if as_json
          else f"parallelism {parallelism or 'unlimited'} requested: {answer['job_id']}")


@array_app.command("cancel")
def cancel_tasks(
    array_id: Annotated[str, typer.Argument(help="the array's job id (or a unique prefix)")],
    tasks: Annotated[str, typer.Option(help="the task indices: 3, 5-9, 0-99:10 (Slurm's syntax)")],
    reason: Annotated[str, typer.Option(help="why")] = "cancelled by user",
    as_json: JsonOpt = False,
) -> None:
    """Cancel some tasks of an array (gpuctl cancel ID cancels all of them)."""
    try:
        _check_indices(tasks)
    except ValueError as exc:
        fail(str(exc), USAGE)
    with api() as client:
        answer = client.post(f"/api/v1/jobs/{array_id}/cancel", {"reason": reason, "array_tasks": tasks})
    print(json.dumps({"job_id": answer["job_id"], "array_tasks": tasks, "cancel": "requested"}) if as_json
          else f"cancel of tasks {tasks} requested: {answer['job_id']}")
