"""How to sign in, for clients that have no token yet (no authentication on this route).

    GET /api/v1/auth/config -> {"oidc": null}  (static tokens only)
                             | {"oidc": {issuer, provider_name, client_id, cli_client_id, scopes,
                                         authorization_endpoint, token_endpoint, device_authorization_endpoint,
                                         end_session_endpoint, revocation_endpoint}}
        the dashboard's "Sign in with <provider_name>" (authorization code + PKCE) and ``gpuctl login`` (device
        authorization grant) read it; the endpoints come from the provider's discovery document (503 while it
        cannot be fetched). Nothing secret: the clients are public (no client secret), as PKCE and RFC 8628 allow.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gpuorch_api.auth import ApiError
from gpuorch_api.oidc import ProviderUnavailable, verifier_for
from gpuorch_api.routes import backends

router = APIRouter()


@router.get("/api/v1/auth/config", tags=["auth"])
def auth_config(request: Request) -> dict[str, Any]:
    """The public sign-in configuration: ``oidc`` null when single sign-on is off (static tokens only)."""
    verifier = verifier_for(backends(request).identity_map.oidc)
    if verifier is None:
        return {"oidc": None}
    try:
        return {"oidc": verifier.public_config()}
    except ProviderUnavailable as exc:
        raise ApiError(503, str(exc)) from exc
