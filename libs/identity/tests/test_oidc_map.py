"""The identity map's ``oidc`` section: group rules name identities of the map (never a service or gateway), the
first rule a user's groups match wins, and a user in no mapped group maps to nothing."""

from __future__ import annotations

import pytest
from gpuorch_identity import IdentityMap, identity_for_claims, user_of

IDENTITIES = {
    "acme-team": {"role": "submitter", "tenants": ["acme"], "default_tenant": "acme"},
    "ops": {"role": "operator", "tenants": ["*"]},
    "executor": {"role": "service"},
}
OIDC = {"issuer": "https://idp.example.com/realms/gpu", "client_id": "gpuorch-dashboard", "cli_client_id": "gpuctl",
        "groups": [{"group": "/gpu/operators", "identity": "ops"}, {"group": "/gpu/acme", "identity": "acme-team"}]}


def test_first_matching_group_rule_wins_and_unmapped_users_map_to_nothing() -> None:
    config = IdentityMap.model_validate({"identities": IDENTITIES, "oidc": OIDC}).oidc
    assert config is not None
    assert identity_for_claims(config, {"groups": ["/gpu/acme", "/gpu/operators"]}) == "ops"
    assert identity_for_claims(config, {"groups": ["/gpu/acme"]}) == "acme-team"
    assert identity_for_claims(config, {"groups": "/gpu/acme other"}) == "acme-team"  # a space-separated claim
    assert identity_for_claims(config, {"groups": ["contractors"]}) is None
    assert identity_for_claims(config, {}) is None
    assert config.accepted_audiences == ["gpuctl", "gpuorch-dashboard"]
    assert config.issuer_url == "https://idp.example.com/realms/gpu"
    assert user_of(config, {"sub": "123", "email": "a@example.com"}) == "a@example.com"


@pytest.mark.parametrize(("rules", "message"), [
    ([{"group": "g", "identity": "nobody"}], "do not exist: nobody"),
    ([{"group": "g", "identity": "executor"}], "service or gateway"),
])
def test_group_rules_must_name_identities_that_use_the_api(rules: list[dict[str, str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IdentityMap.model_validate({"identities": IDENTITIES, "oidc": {**OIDC, "groups": rules}})


def test_scopes_must_include_openid() -> None:
    with pytest.raises(ValueError, match="openid"):
        IdentityMap.model_validate({"identities": IDENTITIES, "oidc": {**OIDC, "scopes": ["profile"]}})
