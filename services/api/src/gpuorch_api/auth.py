"""Who is calling: a bearer token turned into an identity of the identity map, and what it may see.

    Authorization: Bearer <token> --IdentityMap.user_for_token--> identity name --identity_of--> Identity
        no header, unknown token             -> Unauthorized (401)
        a service or gateway identity        -> Forbidden (403): they do not act through the API
    Caller.tenants: None for an operator (and an identity whose tenants include "*"): every tenant; else the
    tenants it names (its default tenant included). Every read of the API is filtered by it.

Pure: no I/O. Tokens are compared by their sha256 digest (the map keeps digests only).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_identity import ANY_TENANT, Identity, IdentityMap


class ApiError(Exception):
    """An answer other than success: HTTP ``status`` and one line for the caller (``{"error": message}``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Unauthorized(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(401, message)


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


def authenticate(identity_map: IdentityMap, authorization: str | None) -> Caller:
    """The caller of a request from its ``Authorization`` header, or Unauthorized/Forbidden."""
    if not authorization:
        raise Unauthorized("no token: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer <token>'")
    name = identity_map.user_for_token(token)
    identity = identity_map.identities.get(name) if name is not None else None
    if name is None or identity is None:
        raise Unauthorized("unknown token")
    if identity.role in ("service", "gateway"):
        raise Forbidden(f"{name} is a {identity.role} identity: it does not use the API")
    return Caller(name, identity)
