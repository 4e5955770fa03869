"""The API verifies the provider's tokens against its JWKS and maps the provider's groups to identities of the
identity map; tokens the provider did not issue, expired ones, and ones for another audience or issuer are
refused with 401 and the RFC 6750 challenge; a user in no mapped group gets 403; static tokens still work."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.oidc_provider import (
    STATIC_TOKEN,
    Provider,
    claims_for,
    new_key,
    sign,
    sign_in_with_pkce,
    unsigned,
)

pytestmark = [pytest.mark.integration]


def whoami(oidc_api_url: str, token: str) -> httpx.Response:
    return httpx.get(f"{oidc_api_url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_a_provider_issued_id_token_signs_in_as_the_identity_of_the_users_group(
        oidc_api_url: str, oidc_provider: Provider) -> None:
    alice = sign_in_with_pkce(oidc_provider, "alice")["id_token"]
    me = whoami(oidc_api_url, alice)
    assert me.status_code == 200, me.text
    assert me.json() | {"user": me.json()["user"]} == {
        "identity": "acme-team", "user": "alice", "role": "submitter", "tenants": ["acme"],
        "default_tenant": "acme", "max_priority": "normal"}
    jobs = httpx.get(f"{oidc_api_url}/api/v1/jobs", headers={"Authorization": f"Bearer {alice}"}, timeout=30)
    assert jobs.status_code == 200 and jobs.json() == []

    olga = whoami(oidc_api_url, sign_in_with_pkce(oidc_provider, "olga")["id_token"]).json()  # staff, gpuorch-operators
    assert (olga["identity"], olga["user"], olga["role"], olga["tenants"]) == ("ops", "olga", "operator", ["*"])


def test_a_user_in_no_mapped_group_is_refused_with_403_saying_why(oidc_api_url: str, oidc_provider: Provider) -> None:
    refused = whoami(oidc_api_url, sign_in_with_pkce(oidc_provider, "mallory")["id_token"])
    assert refused.status_code == 403, refused.text
    assert "mallory" in refused.json()["detail"] and "contractors" in refused.json()["detail"]


def test_static_tokens_stay_for_machines(oidc_api_url: str) -> None:
    me = whoami(oidc_api_url, STATIC_TOKEN)
    assert me.status_code == 200 and me.json()["identity"] == "ops" and me.json()["user"] is None


def test_a_token_signed_with_the_providers_own_key_and_valid_claims_is_accepted(
        oidc_api_url: str, oidc_provider: Provider) -> None:
    """The control for the refusals below: the same forging path with nothing wrong passes."""
    me = whoami(oidc_api_url, sign(claims_for(oidc_provider, "alice"), oidc_provider.key))
    assert me.status_code == 200, me.text
    assert me.json()["identity"] == "acme-team"


@pytest.mark.parametrize(("case", "reason"), [
    ("expired", "expired"),
    ("wrong audience", "audience"),
    ("wrong issuer", "issuer"),
    ("unknown kid", "signed by no key"),
    ("right kid, another key", "invalid token"),
    ("alg none", "'none' is not accepted"),
    ("HS256 with the public key", "'HS256' is not accepted"),
    ("no exp", "exp"),
])
def test_tokens_the_provider_did_not_issue_as_they_are_are_refused(
        oidc_api_url: str, oidc_provider: Provider, case: str, reason: str) -> None:
    valid = claims_for(oidc_provider, "olga")
    past = int(time.time()) - 3600
    stranger = new_key("not-the-providers")
    token = {
        "expired": lambda: sign({**valid, "iat": past - 600, "exp": past}, oidc_provider.key),
        "wrong audience": lambda: sign({**valid, "aud": "another-app"}, oidc_provider.key),
        "wrong issuer": lambda: sign({**valid, "iss": "http://127.0.0.1:9/evil"}, oidc_provider.key),
        "unknown kid": lambda: sign(valid, stranger),
        "right kid, another key": lambda: sign(valid, {**stranger, "kid": oidc_provider.kid}),
        "alg none": lambda: unsigned(valid, oidc_provider.kid),
        "HS256 with the public key": lambda: _hs256_with_public_key(valid, oidc_provider),
        "no exp": lambda: sign({k: v for k, v in valid.items() if k != "exp"}, oidc_provider.key),
    }[case]()
    refused = whoami(oidc_api_url, token)
    assert refused.status_code == 401, f"{case}: {refused.text}"
    assert reason in refused.json()["detail"], refused.json()
    assert refused.headers["www-authenticate"].startswith("Bearer") and 'error="invalid_token"' in \
        refused.headers["www-authenticate"]


def _hs256_with_public_key(claims: dict[str, object], provider: Provider) -> str:
    """The algorithm-confusion attack: HMAC keyed with the provider's public key (which anyone can fetch)."""
    import base64
    import hashlib
    import hmac
    import json

    def part(value: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    public = json.dumps({k: provider.key[k] for k in ("kty", "n", "e")}).encode()
    signing_input = f"{part({'alg': 'HS256', 'kid': provider.kid})}.{part(claims)}"
    mac = base64.urlsafe_b64encode(hmac.new(public, signing_input.encode(), hashlib.sha256).digest()).rstrip(b"=")
    return f"{signing_input}.{mac.decode()}"


def test_the_public_sign_in_config_names_the_providers_endpoints(oidc_api_url: str, oidc_provider: Provider) -> None:
    config = httpx.get(f"{oidc_api_url}/api/v1/auth/config", timeout=30).json()["oidc"]
    issuer = oidc_provider.issuer
    assert config["issuer"] == issuer and config["client_id"] == "gpuorch" and config["provider_name"] == "Test IdP"
    assert config["authorization_endpoint"] == f"{issuer}/auth"
    assert config["token_endpoint"] == f"{issuer}/token"
    assert config["device_authorization_endpoint"] == f"{issuer}/device/auth"
    assert config["end_session_endpoint"] == f"{issuer}/session/end"
    assert "openid" in config["scopes"]
