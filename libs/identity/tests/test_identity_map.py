"""Tenancy from identity: table-driven checks of the pure admission rules, and the checked-in map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpuorch_contracts import JobSpec, SubmitJob, decode
from gpuorch_identity import (
    Identity,
    IdentityMap,
    Rejection,
    authorize_cancel,
    authorize_submission,
    load_identity_map,
    token_digest,
)

DEPLOYED = Path(__file__).resolve().parents[3] / "deploy" / "identity.json"
MAP = IdentityMap(identities={
    "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme", max_priority="normal"),
    "multi": Identity(role="submitter", tenants=["a", "b"], max_priority="low"),
    "ops": Identity(role="operator", default_tenant="default", max_priority="critical"),
    "executor-n1": Identity(role="service", nodes=["n1"]),
}, tokens={token_digest("s3cret"): "acme-ci"})


def submission(**spec: object) -> SubmitJob:
    """A SubmitJob as decoded from the wire (so omitted fields stay omitted)."""
    body = {"type": "job.submit", "spec": {"run": {"runtime": "process", "argv": ["python"]}, **spec}}
    decoded = decode(json.dumps(body))
    assert isinstance(decoded, SubmitJob)
    return decoded


@pytest.mark.parametrize(("user", "spec", "expected"), [
    ("acme-ci", {}, ("acme", "normal")),
    ("acme-ci", {"tenant": "acme", "priority_class": "low"}, ("acme", "low")),
    ("acme-ci", {"tenant": "other"}, "may not submit for tenant 'other'"),
    ("acme-ci", {"tenant": "default"}, ("acme", "normal")),  # what an encoder writes for an omitted tenant
    ("acme-ci", {"priority_class": "critical"}, "at most priority 'normal', not 'critical'"),
    ("multi", {"tenant": "b"}, ("b", "low")),  # omitted priority is lowered to the ceiling
    ("multi", {}, "names no tenant and multi has no default tenant"),
    ("ops", {"tenant": "anyone", "priority_class": "critical"}, ("anyone", "critical")),
    ("executor-n1", {}, "services do not submit jobs"),
    ("stranger", {}, "is not in the identity map"),
    (None, {}, "is not in the identity map"),
])
def test_authorize_submission(user: str | None, spec: dict[str, object], expected: object) -> None:
    result = authorize_submission(MAP, user, submission(**spec))
    if isinstance(expected, tuple):
        assert isinstance(result, JobSpec) and (result.tenant, result.priority_class) == expected
    else:
        assert isinstance(result, Rejection) and str(expected) in result.reason


@pytest.mark.parametrize(("user", "tenant", "allowed"), [
    ("acme-ci", "acme", True), ("acme-ci", "other", False), ("ops", "other", True),
    ("executor-n1", "acme", False), ("stranger", "acme", False),
])
def test_cancel_only_by_the_jobs_tenant_or_an_operator(user: str, tenant: str, allowed: bool) -> None:
    assert (authorize_cancel(MAP, user, tenant) is None) is allowed


def test_tokens_scopes_and_defaults() -> None:
    assert MAP.user_for_token("s3cret") == "acme-ci" and MAP.user_for_token("guess") is None
    assert MAP.node_scopes == {"executor-n1": ["n1"]}
    assert MAP.default_tenant("acme-ci") == "acme" and MAP.default_tenant("stranger") is None
    dev = IdentityMap.development()
    assert isinstance(authorize_submission(dev, "guest", submission(tenant="x")), JobSpec)
    with pytest.raises(ValueError, match="not one of its tenants"):
        Identity(role="submitter", tenants=["a"], default_tenant="b")
    with pytest.raises(ValueError, match="do not exist"):
        IdentityMap(tokens={token_digest("t"): "nobody"})


def test_the_checked_in_map_loads_and_separates_submit_from_operate() -> None:
    deployed = load_identity_map(DEPLOYED)
    assert deployed.identities["gpuctl-submit"].role == "submitter"
    assert deployed.identities["gpuctl-operator"].role == "operator"
    assert isinstance(authorize_submission(deployed, "gpuctl-submit", submission(tenant="acme")), Rejection)
    assert "sim-00001" in deployed.node_scopes["executor-sim"]


GATEWAY_MAP = IdentityMap(identities={**MAP.identities, "api": Identity(role="gateway")})


@pytest.mark.parametrize(("publisher", "on_behalf_of", "expected"), [
    ("acme-ci", None, "acme-ci"),  # a plain publisher is judged as itself
    ("api", "acme-ci", "acme-ci"),  # the gateway speaks for an identity it authenticated
    ("ops", "acme-ci", "acme-ci"),  # an operator may too (it may already do anything)
    ("acme-ci", "ops", "refused"),  # a submitter cannot borrow an operator's identity
    ("multi", "acme-ci", "refused"),
    ("api", "executor-n1", "refused"),  # nor make a service submit
    ("api", "nobody", "refused"),
])
def test_acting_user_honours_on_behalf_of_only_from_a_gateway_or_operator(
        publisher: str, on_behalf_of: str | None, expected: str) -> None:
    from gpuorch_identity import acting_user

    verdict = acting_user(GATEWAY_MAP, publisher, on_behalf_of)
    assert (verdict.reason if isinstance(verdict, Rejection) else verdict) == expected or (
        expected == "refused" and isinstance(verdict, Rejection))


def test_a_gateway_never_submits_or_cancels_as_itself() -> None:
    assert isinstance(authorize_submission(GATEWAY_MAP, "api", submission(tenant="acme")), Rejection)
    assert isinstance(authorize_cancel(GATEWAY_MAP, "api", "acme"), Rejection)
