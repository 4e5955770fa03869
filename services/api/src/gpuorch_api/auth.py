"""Who is calling: a bearer token turned into an identity of the identity map, and what it may see.

    Authorization: Bearer <token> (FastAPI's HTTPBearer: routes.caller) --IdentityMap.user_for_token-->
        identity name --identity_of--> Identity
        no bearer token, unknown token       -> Unauthorized (401, WWW-Authenticate: Bearer, RFC 6750)
        a service or gateway identity        -> Forbidden (403): they do not act through the API
    with the map's ``oidc`` section, a token no static token matches and that looks like a JWT:
        --OidcVerifier.verify (oidc.py)--> claims --identity_for_claims--> identity name (the first group rule)
        a token the provider did not sign, expired, for another audience or issuer -> Unauthorized (401)
        a valid token of a user in no mapped group                              -> Forbidden (403)
        the provider's keys unreachable                                          -> 503
    Caller.tenants: None for an operator (and an identity whose tenants include "*"): every tenant; else the
    tenants it names (its default tenant included). Every read of the API is filtered by it.

Pure but for the provider's keys (fetched and cached by the verifier). Static tokens are compared by their sha256
digest (the map keeps digests only); they stay for machines next to single sign-on.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_identity import ANY_TENANT, Identity, IdentityMap, groups_of, identity_for_claims, user_of

from gpuorch_api.oidc import OidcVerifier, ProviderUnavailable, TokenRefused, looks_like_jwt
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
    """An authenticated caller: its identity-map name and what the map says about it; ``user``: who signed in
    through the OpenID provider (None for a static token)."""

    name: str
    identity: Identity
    user: str | None = None

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


def authenticate(identity_map: IdentityMap, token: str | None, verifier: OidcVerifier | None = None) -> Caller:
    """The caller of a request from its bearer token (None: no ``Authorization: Bearer`` header), or
    Unauthorized/Forbidden. ``verifier``: the provider's, when the map has an ``oidc`` section."""
    if not token:
        raise Unauthorized("no token: send 'Authorization: Bearer <token>'")
    name = identity_map.user_for_token(token)
    if name is None and verifier is not None and looks_like_jwt(token):
        return _signed_in(identity_map, verifier, token)
    identity = identity_map.identities.get(name) if name is not None else None
    if name is None or identity is None:
        raise Unauthorized("unknown token", token_sent=True)
    if identity.role in ("service", "gateway"):
        raise Forbidden(f"{name} is a {identity.role} identity: it does not use the API")
    return Caller(name, identity)


def _signed_in(identity_map: IdentityMap, verifier: OidcVerifier, token: str) -> Caller:
    """The caller a verified provider token names: the identity of the first group rule the user's groups match."""
    try:
        claims = verifier.verify(token)
    except TokenRefused as exc:
        raise Unauthorized(str(exc), token_sent=True) from exc
    except ProviderUnavailable as exc:
        raise ApiError(503, f"cannot verify the sign-in: {exc}") from exc
    config = verifier.config
    user = user_of(config, claims)
    name = identity_for_claims(config, claims)
    if name is None:
        groups = ", ".join(groups_of(config, claims)) or "none"
        raise Forbidden(f"{user} is signed in but in no group gpuorch maps to a tenant or role (claim "
                        f"{config.groups_claim!r}: {groups}); ask an operator to add your group to the identity map")
    return Caller(name, identity_map.identities[name], user=user)
