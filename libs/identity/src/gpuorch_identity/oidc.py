"""Single sign-on: the ``oidc`` section of the identity map, and which identity a provider's user signs in as.

    identity map {"oidc": {"issuer", "client_id", "groups_claim", "groups": [{"group", "identity"}, ...]}}
    verified ID token claims --identity_for_claims--> an identity name of the map | Rejection (no mapped group)

A group rule names an identity of the map (its role, tenants, default tenant, priority ceiling and session caps):
the scheduler judges a signed-in user's submissions as that identity, exactly as it judges a static token's. The
first rule whose group the user has wins, so list operator groups first. Pure: the API verifies the token's
signature, issuer, audience and expiry (gpuorch_api.oidc) before it asks this module.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

DEFAULT_SCOPES = ["openid", "profile", "email", "groups", "offline_access"]


class GroupRule(BaseModel):
    """Members of ``group`` (as the provider spells it in the groups claim) sign in as ``identity``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group: Annotated[str, Field(min_length=1, max_length=500)]
    identity: Annotated[str, Field(min_length=1, max_length=200)]


class OidcConfig(BaseModel):
    """The team's OpenID provider. Tokens are accepted when signed by a key of the issuer's JWKS (found through its
    discovery document), issued by ``issuer``, for one of ``audiences`` (default: the client ids) and not expired."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    issuer: HttpUrl = Field(description="the provider's issuer URL, exactly as in its tokens' iss claim")
    client_id: Annotated[str, Field(min_length=1, max_length=500)] = Field(
        description="the dashboard's client (public: authorization code + PKCE, no secret)")
    cli_client_id: Annotated[str, Field(max_length=500)] | None = Field(
        default=None, description="gpuctl login's client (device authorization grant); None: client_id")
    audiences: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default=[], max_length=20, description="accepted aud values; empty: client_id and cli_client_id (ID tokens)")
    provider_name: Annotated[str, Field(min_length=1, max_length=100)] = Field(
        default="single sign-on", description="shown on the dashboard's button: 'Sign in with <provider_name>'")
    scopes: list[Annotated[str, Field(pattern=r"^[\x21\x23-\x5b\x5d-\x7e]+$")]] = Field(
        default=DEFAULT_SCOPES, max_length=20, description="scopes the dashboard and gpuctl ask for")
    groups_claim: Annotated[str, Field(min_length=1, max_length=200)] = Field(
        default="groups", description="the claim listing the user's groups (Keycloak: groups; Okta: groups; "
                                      "Azure AD: groups (object ids) or roles; Google: a custom claim)")
    username_claim: Annotated[str, Field(min_length=1, max_length=200)] = Field(
        default="preferred_username", description="the claim shown as the signed-in user (else email, else sub)")
    leeway_s: float = Field(default=30, ge=0, le=300, description="clock skew allowed on exp, nbf and iat")
    jwks_refresh_cooldown_s: float = Field(default=30, ge=0, le=3600, description=(
        "a token naming an unknown kid fetches the provider's JWKS again (key rotation) at most this often: "
        "forged kids cannot make the API hammer the provider"))
    groups: list[GroupRule] = Field(default=[], max_length=10_000, description="group -> identity; first match wins")

    @field_validator("scopes")
    @classmethod
    def _openid(cls, scopes: list[str]) -> list[str]:
        if "openid" not in scopes:
            raise ValueError("scopes must include openid")
        return scopes

    @property
    def issuer_url(self) -> str:
        """The issuer as configured, without the trailing slash pydantic's URL type may add to a bare host."""
        text = str(self.issuer)
        return text[:-1] if text.endswith("/") and self.issuer.path in ("/", None) else text

    @property
    def cli_client(self) -> str:
        return self.cli_client_id or self.client_id

    @property
    def accepted_audiences(self) -> list[str]:
        return list(self.audiences) or sorted({self.client_id, self.cli_client})


def groups_of(config: OidcConfig, claims: dict[str, Any]) -> list[str]:
    """The user's groups from the configured claim (a list, or one space-separated string); [] when absent."""
    value = claims.get(config.groups_claim)
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [str(group) for group in value]
    return []


def user_of(config: OidcConfig, claims: dict[str, Any]) -> str:
    """Who signed in, for people to read: the username claim, else email, else the subject."""
    for claim in (config.username_claim, "email", "sub"):
        value = claims.get(claim)
        if isinstance(value, str) and value:
            return value
    return "?"


def identity_for_claims(config: OidcConfig, claims: dict[str, Any]) -> str | None:
    """The identity the first rule matching one of the user's groups names; None: no group of the user is mapped
    (the API refuses with 403)."""
    groups = set(groups_of(config, claims))
    for rule in config.groups:
        if rule.group in groups:
            return rule.identity
    return None
