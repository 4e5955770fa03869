"""A bearer JWT from the team's OpenID provider, verified: PyJWT against the keys the provider publishes.

    identity map's oidc section (gpuorch_identity.OidcConfig) -> OidcVerifier
    OidcVerifier.discovery(): {issuer}/.well-known/openid-configuration, fetched once (again after an hour or a
        failure); its issuer must equal the configured one (OpenID Connect Discovery 1.0, section 4.3)
    OidcVerifier.verify(token) -> the token's claims, or
        TokenRefused(why)        signature not by a key of the provider's JWKS (found by the token's kid; an unknown
                                 kid fetches the JWKS again, at most every jwks_refresh_cooldown_s: key
                                 rotation), alg none or symmetric, issuer not
                                 the configured one, aud not one of the accepted audiences, expired, no exp/iat/sub
        ProviderUnavailable(why) the discovery document or the JWKS could not be fetched

Blocking (HTTP to the provider on a cache miss): call it from a worker thread (FastAPI runs the sync ``caller``
dependency in its thread pool). Every check is PyJWT's; nothing here parses or checks a JWT by hand.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import jwt
from gpuorch_identity import OidcConfig

ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
"""Asymmetric algorithms only: never none, never HS* (a public key must not become a shared secret)."""

DISCOVERY_TTL_S = 3600.0
JWKS_TTL_S = 300.0


class TokenRefused(Exception):
    """The token is not a valid token of the provider: the API answers 401 with this reason."""


class ProviderUnavailable(Exception):
    """The provider's discovery document or keys could not be fetched: the API answers 503."""


class OidcVerifier:
    """Verifies the provider's tokens for one ``OidcConfig``; keeps the discovery document and the JWKS cached."""

    def __init__(self, config: OidcConfig, *, timeout_s: float = 5.0) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._discovery: dict[str, Any] | None = None
        self._discovered_at = 0.0
        self._jwks: jwt.PyJWKClient | None = None

    def discovery(self) -> dict[str, Any]:
        """The provider's discovery document (cached for an hour)."""
        with self._lock:
            if self._discovery is not None and time.monotonic() - self._discovered_at < DISCOVERY_TTL_S:
                return self._discovery
            issuer = self.config.issuer_url
            url = f"{issuer}/.well-known/openid-configuration"
            try:
                response = httpx.get(url, timeout=self.timeout_s, follow_redirects=True)
                response.raise_for_status()
                document = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise ProviderUnavailable(f"the OpenID provider's discovery document ({url}): {exc}") from exc
            if not isinstance(document, dict) or document.get("issuer") != issuer or not document.get("jwks_uri"):
                raise ProviderUnavailable(f"{url} does not describe issuer {issuer} (its issuer: "
                                          f"{document.get('issuer') if isinstance(document, dict) else None!r})")
            if self._jwks is None or self._jwks.uri != document["jwks_uri"]:
                self._jwks = jwt.PyJWKClient(document["jwks_uri"], cache_jwk_set=True, lifespan=int(JWKS_TTL_S),
                                             timeout=int(self.timeout_s),
                                             cooldown_duration=self.config.jwks_refresh_cooldown_s)
            self._discovery, self._discovered_at = document, time.monotonic()
            return document

    def verify(self, token: str) -> dict[str, Any]:
        """The claims of ``token`` once its signature, issuer, audience and lifetime are checked."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as exc:
            raise TokenRefused(f"not a JWT: {exc}") from exc
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            raise TokenRefused(f"signing algorithm {algorithm!r} is not accepted (only {', '.join(ALGORITHMS)})")
        self.discovery()
        assert self._jwks is not None
        try:
            key = self._jwks.get_signing_key_from_jwt(token)
        except jwt.PyJWKClientConnectionError as exc:
            raise ProviderUnavailable(f"the OpenID provider's keys: {exc}") from exc
        except (jwt.PyJWKClientError, jwt.InvalidTokenError) as exc:
            raise TokenRefused(f"signed by no key of the provider (kid {header.get('kid')!r})") from exc
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=[algorithm], audience=self.config.accepted_audiences,
                issuer=self.config.issuer_url, leeway=self.config.leeway_s,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]})
        except jwt.ExpiredSignatureError as exc:
            raise TokenRefused("token expired: sign in again") from exc
        except jwt.InvalidAudienceError as exc:
            raise TokenRefused(f"token is for another audience (accepted: "
                               f"{', '.join(self.config.accepted_audiences)})") from exc
        except jwt.InvalidIssuerError as exc:
            raise TokenRefused(f"token is from another issuer (accepted: {self.config.issuer_url})") from exc
        except jwt.InvalidTokenError as exc:
            raise TokenRefused(f"invalid token: {exc}") from exc
        return claims

    def public_config(self) -> dict[str, Any]:
        """What a client needs to sign in (GET /api/v1/auth/config): client ids, scopes and the provider's
        endpoints from its discovery document."""
        document = self.discovery()
        return {
            "issuer": self.config.issuer_url, "provider_name": self.config.provider_name,
            "client_id": self.config.client_id, "cli_client_id": self.config.cli_client,
            "scopes": list(self.config.scopes),
            **{name: document.get(name) for name in (
                "authorization_endpoint", "token_endpoint", "device_authorization_endpoint", "end_session_endpoint",
                "revocation_endpoint")},
        }


def looks_like_jwt(token: str) -> bool:
    """Three dot-separated parts (JWS compact serialisation): worth asking the provider's keys about."""
    return token.count(".") == 2


_VERIFIERS: dict[int, OidcVerifier] = {}


def verifier_for(config: OidcConfig | None) -> OidcVerifier | None:
    """The verifier of ``config`` (one per identity map the process loaded, so its caches are shared by every
    request); None without an ``oidc`` section."""
    if config is None:
        return None
    verifier = _VERIFIERS.get(id(config))
    if verifier is None or verifier.config is not config:
        verifier = _VERIFIERS[id(config)] = OidcVerifier(config)
    return verifier
