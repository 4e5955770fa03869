"""Every error the API answers, in one shape: RFC 9457 problem details, ``application/problem+json``.

    {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "no job 'abc1'", "error": "no job 'abc1'"}
    a request that does not validate (422): every error in ``errors`` ({"where": "query.limit", "problem": ...}),
        ``detail`` the same in one line, "; "-joined
    401: a ``WWW-Authenticate: Bearer realm="gpuorch"`` header (RFC 6750), with ``error="invalid_token"`` when a
        token was sent that the identity map does not know

``detail`` is one line for people; ``error`` repeats it for the clients written before problem details (gpuctl,
the dashboard). ``documented_as_problems`` files them so in the OpenAPI document. Pure: the route handlers, the error handlers and the request guard (limits.py) all answer through
``problem_body``/``problem``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

MEDIA_TYPE = "application/problem+json"
REALM = 'Bearer realm="gpuorch"'


class InvalidField(BaseModel):
    """One validation error: where (``query.limit``, ``body.spec.resources.gpus``) and what is wrong there."""

    where: str
    problem: str


class Problem(BaseModel):
    """An error answer (RFC 9457); ``errors`` only on a request that does not validate."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    error: str
    errors: list[InvalidField] | None = None


def problem_body(status: int, detail: str, errors: list[InvalidField] | None = None) -> dict[str, Any]:
    """The JSON object of a problem: ``detail`` (and ``error``) on one line."""
    line = " ".join(detail.split())
    body: dict[str, Any] = {"type": "about:blank", "title": HTTPStatus(status).phrase, "status": status,
                            "detail": line, "error": line}
    if errors is not None:
        body["errors"] = [e.model_dump() for e in errors]
    return body


def problem(status: int, detail: str, *, errors: list[InvalidField] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(problem_body(status, detail, errors), status_code=status, headers=headers,
                        media_type=MEDIA_TYPE)


def invalid_fields(errors: Any) -> list[InvalidField]:
    """FastAPI's (pydantic's) validation errors as ``InvalidField``s, the allowed values named when pydantic
    gives them (``state``: one of ...)."""
    found = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()))
        text = str(error.get("msg", "invalid"))
        allowed = (error.get("ctx") or {}).get("expected")
        if allowed and str(allowed) not in text:
            text += f" (expected {allowed})"
        found.append(InvalidField(where=where, problem=text))
    return found


def validation_detail(fields: list[InvalidField]) -> str:
    """One line naming every invalid field (``state: ...; limit: ...``; ``query.``/``body.``/``path.`` dropped)."""
    def short(where: str) -> str:
        head, _, rest = where.partition(".")
        return rest if head in ("query", "body", "path", "header") and rest else where
    return "; ".join(f"{short(f.where)}: {f.problem}" if f.where else f.problem for f in fields) or "invalid request"


def documented_as_problems(document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI ``document`` with each error response (4xx, 5xx) under ``application/problem+json`` only
    (FastAPI files a response model under ``application/json``, the route's own media type)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                content = response.get("content", {})
                if str(status)[0] in "45" and "application/json" in content:
                    content[MEDIA_TYPE] = content.pop("application/json")
    return document
