"""Sign-in tests: a real OpenID provider (tests/oidc_provider: node's oidc-provider) for the session, and the API
as a process signing in through it for each module."""

from tests.oidc_provider import oidc_api_url, oidc_provider

__all__ = ["oidc_api_url", "oidc_provider"]
