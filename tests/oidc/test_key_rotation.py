"""Key rotation: the provider starts signing with a new key (published next to the old one). The API, which has
the old key set cached, fetches the JWKS again when a token names a kid it does not know, and accepts the new
tokens; tokens of the old key stay valid while the provider still publishes it. (The map's refresh cooldown, 30 s
by default against forged kids, is 0 here: the rotation follows the first fetch within seconds.)"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.oidc_provider import (
    NODE,
    NPM,
    api_with_sign_in,
    claims_for,
    new_key,
    running_provider,
    sign,
    sign_in_with_pkce,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def whoami(url: str, token: str) -> httpx.Response:
    return httpx.get(f"{url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.skipif(NODE is None or NPM is None, reason="node and npm run the OpenID provider")
def test_a_rotated_signing_key_is_found_by_its_kid(tmp_path: Path) -> None:
    old, new = new_key("2026-old"), new_key("2026-new")
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    with running_provider(tmp_path / "before", keys=[old]) as before, \
            api_with_sign_in(tmp_path / "api", before, jwks_refresh_cooldown_s=0) as api:  # rotate at once
        old_token = sign_in_with_pkce(before, "alice")["id_token"]
        assert whoami(api, old_token).status_code == 200  # the API now holds the old key set
        before.process.terminate()
        before.process.wait(timeout=10)
        port = urlparse(before.issuer).port
        assert port is not None
        with running_provider(tmp_path / "after", keys=[new, old], port=port) as after:
            assert after.issuer == before.issuer
            rotated = sign_in_with_pkce(after, "alice")["id_token"]
            me = whoami(api, rotated)
            assert me.status_code == 200, me.text
            assert me.json()["user"] == "alice"
            assert whoami(api, old_token).status_code == 200
            assert whoami(api, sign(claims_for(after, "alice"), new_key("2026-never"))).status_code == 401
