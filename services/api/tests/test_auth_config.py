"""Without an ``oidc`` section single sign-on is off: the public sign-in config says so, and a JWT-looking token
that matches no static token is just an unknown token (no provider is asked)."""

from __future__ import annotations

import httpx

from .conftest import RunningApi


async def test_without_oidc_the_sign_in_config_is_null_and_tokens_are_static(api: RunningApi) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        config = await http.get("/api/v1/auth/config")
        assert config.status_code == 200 and config.json() == {"oidc": None}
        refused = await http.get("/api/v1/whoami", headers={"Authorization": "Bearer aaa.bbb.ccc"})
        assert refused.status_code == 401 and refused.json()["detail"] == "unknown token"
