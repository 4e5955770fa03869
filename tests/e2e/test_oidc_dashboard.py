"""The dashboard's single sign-on in a real browser (headless Chromium, as test_dashboard.py): "Sign in with Test
IdP" goes through the real provider's login page (authorization code + PKCE), the jobs page shows the signed-in
user's identity, and sign-out clears the page's token and ends the provider's session (signing in again asks for
the login again)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.oidc import oidc_sign_in, oidc_sign_out, wait
from tests.e2e.test_dashboard import browser  # headless Chromium (skips this module where it is not installed)
from tests.oidc_provider import STATIC_TOKEN, oidc_api_url, oidc_provider

__all__ = ["browser", "oidc_api_url", "oidc_provider"]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sign_in_through_the_provider_see_the_jobs_page_and_sign_out(oidc_api_url: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    who = oidc_sign_in(browser, oidc_api_url, "alice", "#/jobs", identity="acme-team")
    assert "acme-team" in who and "acme" in who
    assert "code=" not in browser.current_url and browser.current_url.endswith("#/jobs")
    wait(browser, lambda b: b.find_element(By.ID, "jobs"))  # the jobs page, read with alice's ID token
    token = browser.execute_script("return localStorage.getItem('gpuorch-token')")
    me = httpx.get(f"{oidc_api_url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()
    assert (me["identity"], me["user"]) == ("acme-team", "alice")

    oidc_sign_out(browser, oidc_api_url)
    assert browser.execute_script("return localStorage.getItem('gpuorch-token')") is None
    assert browser.find_element(By.ID, "who").text == ""
    # the provider's session ended: signing in again shows its login page instead of coming straight back
    browser.find_element(By.ID, "sso").click()
    wait(browser, lambda b: b.find_element(By.NAME, "login"))

    # the token form stays for static tokens
    browser.get(f"{oidc_api_url}/#/jobs")
    wait(browser, lambda b: b.find_element(By.ID, "token")).send_keys(STATIC_TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    wait(browser, lambda b: "ops" in b.find_element(By.ID, "who").text)
