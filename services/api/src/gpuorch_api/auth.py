"""Who is calling: a bearer token turned into an identity of the identity map, and what it may see.

    Authorization: Bearer <token> (FastAPI's HTTPBearer: routes.caller) --IdentityMap.user_for_token-->
        identity name --identity_of--> Identity
        no bearer token, unknown token       -> Unauthorized (401, WWW-Authenticate: Bearer, RFC 6750)
        a service or gateway identity        -> Forbidden (403): they do not act through the API
    Caller.tenants: None for an operator (and an identity whose tenants include "*"): every tenant; else the
    tenants it names (its default tenant included). Every read of the API is filtered by it.

Pure: no I/O. Tokens are compared by their sha256 digest (the map keeps digests only).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_identity import ANY_TENANT, Identity, IdentityMap

from gpuorch_api.problems import REALM


class ApiError(Exception):
    """An answer other than success: HTTP ``status``, one line for the caller (problems.py: its ``detail``) and
    any headers the status needs."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class Unauthorized(ApiError):
    """401 with the challenge RFC 6750 asks for: ``invalid_token`` when a token was sent but is not known."""

    def __init__(self, message: str, *, token_sent: bool = False) -> None:
        challenge = REALM + (', error="invalid_token"' if token_sent else "")
        super().__init__(401, message, {"WWW-Authenticate": challenge})


class Forbidden(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(403, message)


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its identity-map name and what the map says about it."""

    name: str
    identity: Identity

    @property
    def is_operator(self) -> bool:
        return self.identity.role == "operator"

    @property
    def tenants(self) -> frozenset[str] | None:
        """The tenants whose jobs this caller sees; None: all of them."""
        if self.is_operator or ANY_TENANT in self.identity.tenants:
            return None
        named = set(self.identity.tenants)
        if self.identity.default_tenant is not None:
            named.add(self.identity.default_tenant)
        return frozenset(named)

    def sees(self, tenant: str) -> bool:
        visible = self.tenants
        return visible is None or tenant in visible


def authenticate(identity_map: IdentityMap, token: str | None) -> Caller:
    """The caller of a request from its bearer token (None: no ``Authorization: Bearer`` header), or
    Unauthorized/Forbidden."""
    if not token:
        raise Unauthorized("no token: send 'Authorization: Bearer <token>'")
    name = identity_map.user_for_token(token)
    identity = identity_map.identities.get(name) if name is not None else None
    if name is None or identity is None:
        raise Unauthorized("unknown token", token_sent=True)
    if identity.role in ("service", "gateway"):
        raise Forbidden(f"{name} is a {identity.role} identity: it does not use the API")
    return Caller(name, identity)
