"""Tenancy from identity: who may submit for which tenant, at which priority, and who may cancel or read a job.

    deploy/identity.json --load_identity_map--> IdentityMap
    (SubmitJob as received, AMQP user_id) --authorize_submission--> JobSpec (tenant, priority filled) | Rejection
    (user_id, the job's tenant)           --authorize_job_access--> None (allowed) | Rejection   (cancel, logs)
    (AMQP user_id, message.on_behalf_of)  --acting_user--> the identity to judge the message as | Rejection
    (GPUORCH_LOGS_SECRET, executor's broker user) --log_credential--> that executor's log endpoint credential

Pure: no I/O besides ``load_identity_map``; the scheduler calls these at admission with the delivery's
``user_id`` (which RabbitMQ guarantees is the publisher's broker user). An API token is first turned into the name
of its identity with ``IdentityMap.user_for_token`` (only sha256 digests of tokens are checked in).

Rules:
- an unknown user may do nothing (unless the map has a ``"*"`` entry: the development map gives everyone operator);
- ``service`` identities (scheduler, executors ...) never submit or cancel;
- a ``gateway`` identity (the API's broker user) never acts for itself: it submits and cancels only
  ``on_behalf_of`` an identity it authenticated (a token); an operator may also name ``on_behalf_of`` (it may
  already do anything); anyone else naming it is refused, so a submitter cannot borrow another identity;
- a spec that omits ``tenant`` gets the identity's ``default_tenant``; a named tenant must be in ``tenants``
  (``"*"`` allows every tenant); operators may use any tenant;
- a spec that omits ``priority_class`` gets ``normal``, lowered to the identity's ``max_priority`` if that is lower;
  a named priority above ``max_priority`` is rejected (never silently lowered);
- cancel and logs: operators, or an identity whose tenants include the job's tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from gpuorch_contracts import PRIORITY_VALUE, JobSpec, SubmitJob
from gpuorch_contracts.jobs import DEFAULT_TENANT, PriorityClass
from gpuorch_contracts.text import Name, TenantName
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuorch_identity.oidc import GroupRule, OidcConfig, groups_of, identity_for_claims, user_of

__all__ = [
    "ANY_TENANT", "GroupRule", "Identity", "IdentityMap", "OidcConfig", "Rejection", "acting_user", "authorize_cancel", "authorize_job_access",
    "configured_identity_map",
    "authorize_submission", "groups_of", "identity_for_claims", "load_identity_map", "log_credential", "token_digest",
    "user_of",
]

ANY_TENANT = "*"
Role = Literal["submitter", "operator", "service", "gateway"]


class Identity(BaseModel):
    """What one broker user (or API token) may do."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    tenants: Annotated[list[TenantName | Literal["*"]], Field(max_length=1000)] = []
    default_tenant: TenantName | None = None
    max_priority: PriorityClass = "normal"
    nodes: Annotated[list[Name], Field(max_length=100_000)] = Field(
        default=[], description="service users that speak for several nodes (executor or node-agent of a rack)")
    max_sessions: int | None = Field(default=None, ge=0, le=10_000, description=(
        "interactive sessions this identity may have live at once (queued or running; parked ones do not count); "
        "None: no cap"))
    max_session_gpus: float | None = Field(default=None, ge=0, le=100_000, description=(
        "GPUs its live sessions may ask for in all (a share counts its fraction, a MIG slice 1/7); None: no cap"))

    @model_validator(mode="after")
    def _default_is_allowed(self) -> Identity:
        if self.default_tenant is not None and not self.may_use(self.default_tenant):
            raise ValueError(f"default_tenant {self.default_tenant!r} is not one of its tenants")
        return self

    def may_use(self, tenant: str) -> bool:
        return self.role == "operator" or ANY_TENANT in self.tenants or tenant in self.tenants


class IdentityMap(BaseModel):
    """``identities``: broker user (or identity name) -> Identity; ``tokens``: sha256 hex of an API token -> the
    identity name it authenticates as."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    identities: dict[str, Identity] = {}
    tokens: dict[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], str] = {}
    shares: dict[TenantName | Literal["*"], Annotated[float, Field(gt=0, le=1e9)]] = Field(
        default={}, description="tenant (or \"*\") -> its fair share, relative (tenants not named get the \"*\" "
                                "entry, else 1): what decayed past usage is measured against")
    session_idle_park_s: dict[TenantName | Literal["*"], Annotated[float, Field(ge=10, le=30 * 86_400)]] = Field(
        default={}, description="tenant (or \"*\") -> seconds an idle interactive session of it is parked after, "
                                "unless the session says otherwise (the scheduler's GPUORCH_SESSION_IDLE_PARK_BY_TENANT "
                                "and GPUORCH_SESSION_IDLE_PARK_S for tenants not named)")
    oidc: OidcConfig | None = Field(default=None, description="single sign-on with the team's OpenID provider: "
                                    "its users sign in as the identity their group maps to (gpuorch_identity.oidc)")

    @model_validator(mode="after")
    def _tokens_name_identities(self) -> IdentityMap:
        unknown = sorted(set(self.tokens.values()) - set(self.identities))
        if unknown:
            raise ValueError(f"tokens name identities that do not exist: {', '.join(unknown)}")
        if self.oidc is not None:
            mapped = {rule.identity for rule in self.oidc.groups}
            if missing := sorted(mapped - set(self.identities)):
                raise ValueError(f"oidc groups name identities that do not exist: {', '.join(missing)}")
            if bad := sorted(n for n in mapped if self.identities[n].role in ("service", "gateway")):
                raise ValueError(f"oidc groups may not map to service or gateway identities: {', '.join(bad)}")
        return self

    @classmethod
    def development(cls) -> IdentityMap:
        """Everyone is an operator of every tenant: local development and tests where all connect as guest."""
        return cls(identities={"*": Identity(role="operator", tenants=[ANY_TENANT], default_tenant="default",
                                             max_priority="critical")})

    def identity_of(self, user_id: str | None) -> Identity | None:
        if user_id is None:
            return None
        return self.identities.get(user_id) or self.identities.get("*")

    def default_tenant(self, user_id: str | None) -> str | None:
        """The tenant an identity's unnamed submissions (and their rejections) belong to; None if it has none."""
        identity = self.identity_of(user_id)
        return identity.default_tenant if identity is not None else None

    def user_for_token(self, token: str) -> str | None:
        return self.tokens.get(token_digest(token))

    @property
    def named_tenants(self) -> list[str]:
        """Every tenant an identity names (not ``*``), sorted: the tenants the scheduler gives submission lanes."""
        return sorted({t for identity in self.identities.values() for t in identity.tenants if t != ANY_TENANT}
                      | {i.default_tenant for i in self.identities.values() if i.default_tenant is not None})

    @property
    def node_scopes(self) -> dict[str, list[str]]:
        """Service users serving several nodes: pass to ``gpuorch_messaging.Broker(node_scopes=...)``."""
        return {user: list(identity.nodes) for user, identity in self.identities.items() if identity.nodes}


@dataclass(frozen=True)
class Rejection:
    """Why an identity may not do what it asked, in words for the submitter (fits ``JobRejected.reason``)."""

    reason: str


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def log_credential(secret: str, identity: str) -> str:
    """The bearer credential of the log endpoint of the executor that publishes as broker user ``identity``:
    HMAC-SHA256 of ``identity`` under ``secret``, hex. The control plane (the API) holds ``secret``
    (``GPUORCH_LOGS_SECRET``) and derives a node's credential from the identity that announced the node's endpoint;
    each executor holds only its own (``GPUORCH_LOGS_TOKEN``, issued with ``gpuctl setup logs-credential``), so a
    node's credential reads that node's logs and nothing else."""
    if not secret:
        raise ValueError("a log credential needs a secret (GPUORCH_LOGS_SECRET)")
    return hmac.new(secret.encode(), f"gpuorch-logs:{identity}".encode(), hashlib.sha256).hexdigest()


def load_identity_map(path: str | Path) -> IdentityMap:
    """Read and validate an identity map (JSON); raises ``ValueError`` (pydantic's) when it is malformed."""
    return IdentityMap.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))


def configured_identity_map(path: str, identity_mode: str) -> IdentityMap:
    """The identity map a service runs with: the file at ``path`` (``GPUORCH_IDENTITY_MAP``), else the development
    map when ``identity_mode`` (``GPUORCH_IDENTITY``) is ``trust_all``; ``ValueError`` says what is missing or
    malformed."""
    if path:
        try:
            return load_identity_map(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"GPUORCH_IDENTITY_MAP: {exc}") from exc
    if identity_mode == "trust_all":
        return IdentityMap.development()
    raise ValueError("GPUORCH_IDENTITY_MAP is required (who may do what for which tenant); "
                     "GPUORCH_IDENTITY=trust_all only for local development")


def authorize_submission(
    identity_map: IdentityMap, user_id: str | None, submission: SubmitJob | JobSpec
) -> JobSpec | Rejection:
    """The spec to admit (tenant and priority class filled from the identity) or why the submission is refused.

    ``submission`` must be the message as decoded from the wire: whether ``tenant``/``priority_class`` were
    omitted is read from the spec's ``model_fields_set``. A tenant equal to the contract's default
    (``"default"``, what an encoder writes for an omitted tenant) counts as omitted.
    """
    spec = submission.spec if isinstance(submission, SubmitJob) else submission
    identity = identity_map.identity_of(user_id)
    if identity is None:
        return Rejection(f"publisher {user_id!r} is not in the identity map: it may not submit jobs")
    if identity.role == "service":
        return Rejection(f"{user_id} is a service identity: services do not submit jobs")
    if identity.role == "gateway":
        return Rejection(f"{user_id} is a gateway: it submits only on behalf of an identity it authenticated")
    named = "tenant" in spec.model_fields_set and spec.tenant != DEFAULT_TENANT
    if named:
        tenant = spec.tenant
        if not identity.may_use(tenant):
            allowed = ", ".join(identity.tenants) or "none"
            return Rejection(f"{user_id} may not submit for tenant {tenant!r} (its tenants: {allowed})")
    elif identity.default_tenant is not None:
        tenant = identity.default_tenant
    elif identity.may_use(DEFAULT_TENANT):
        tenant = DEFAULT_TENANT
    else:
        return Rejection(f"the spec names no tenant and {user_id} has no default tenant")
    ceiling = PRIORITY_VALUE[identity.max_priority]
    if "priority_class" in spec.model_fields_set:
        priority = spec.priority_class
        if PRIORITY_VALUE[priority] > ceiling:
            return Rejection(f"{user_id} may submit at most priority {identity.max_priority!r}, not {priority!r}")
    else:
        priority = "normal" if PRIORITY_VALUE["normal"] <= ceiling else identity.max_priority
    return spec.model_copy(update={"tenant": tenant, "priority_class": priority})


def authorize_job_access(identity_map: IdentityMap, user_id: str | None, job_tenant: str) -> Rejection | None:
    """None when ``user_id`` may cancel the job or read its logs (an operator, or one of the job's tenant)."""
    identity = identity_map.identity_of(user_id)
    if identity is None:
        return Rejection(f"publisher {user_id!r} is not in the identity map")
    if identity.role == "service":
        return Rejection(f"{user_id} is a service identity: services do not cancel jobs")
    if identity.role == "gateway":
        return Rejection(f"{user_id} is a gateway: it acts only on behalf of an identity it authenticated")
    if not identity.may_use(job_tenant):
        return Rejection(f"{user_id} may not act on jobs of tenant {job_tenant!r}")
    return None


def acting_user(identity_map: IdentityMap, user_id: str | None, on_behalf_of: str | None) -> str | Rejection | None:
    """The identity a submission or cancel is judged as: the publisher (``user_id``, verified by the broker) unless
    it names ``on_behalf_of``; then that identity, provided the publisher is a gateway or an operator and the named
    identity is in the map. Refused (a Rejection) for anyone else, and for an unknown or service identity named."""
    if on_behalf_of is None:
        return user_id
    publisher = identity_map.identity_of(user_id)
    if publisher is None or publisher.role not in ("gateway", "operator"):
        return Rejection(f"{user_id} may not act on behalf of {on_behalf_of!r}: only a gateway (the API) may")
    named = identity_map.identity_of(on_behalf_of)
    if named is None or named.role in ("service", "gateway"):
        return Rejection(f"{on_behalf_of!r} is not an identity that submits or cancels jobs")
    return on_behalf_of


authorize_cancel = authorize_job_access
"""Cancel is allowed to the job's tenant or an operator: the same rule as reading its logs."""
