"""Signing in to the dashboard through the OpenID provider in a real browser (selenium), for any browser test:

    oidc_sign_in(driver, base_url, "alice")    "Sign in with ..." -> the provider's login page (any password: the
                                               test provider's devInteractions) -> its consent page -> back on the
                                               dashboard, signed in (the #who line names the user's identity)
    oidc_sign_out(driver)                      "Sign out" -> the provider's "sign me out" page -> back, signed out

They work against tests/oidc_provider's provider (its pages' form fields) and an API whose identity map has its
``oidc`` section (tests.oidc_provider.api_with_sign_in, or an api_stack with one).
"""

from __future__ import annotations

from typing import Any


def wait(driver: Any, condition: Any, timeout_s: float = 60) -> Any:
    """The first truthy value of ``condition(driver)``; a missing or re-rendered element means "ask again"."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(condition)


def oidc_sign_in(driver: Any, base_url: str, user: str, page: str = "#/jobs", identity: str | None = None) -> str:
    """Sign in to the dashboard at ``base_url`` as the provider's ``user`` and land on ``page``; returns the #who
    line (waited for until it names ``identity`` when given)."""
    from selenium.webdriver.common.by import By

    home = f"{base_url}/"  # with its slash: the provider's port may start with the dashboard's digits
    driver.get(f"{home}{page}")
    wait(driver, lambda d: d.find_element(By.ID, "sso")).click()

    def log_in(d: Any) -> bool:  # the provider's login page; filled again if it re-rendered under our hands
        login, password = d.find_element(By.NAME, "login"), d.find_element(By.NAME, "password")
        login.clear()
        login.send_keys(user)
        password.clear()
        password.send_keys("any")
        d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        return True

    wait(driver, log_in)
    while not driver.current_url.startswith(home):                      # consent, as often as the provider asks
        wait(driver, lambda d: d.current_url.startswith(home) or d.find_elements(
            By.CSS_SELECTOR, "input[name=prompt][value=consent]"))
        if not driver.current_url.startswith(home):
            wait(driver, lambda d: d.current_url.startswith(home) or d.find_element(
                By.CSS_SELECTOR, "button[type=submit]").click() or True)
    who = wait(driver, lambda d: d.find_element(By.ID, "who").text)
    if identity is not None:
        who = wait(driver, lambda d: identity in d.find_element(By.ID, "who").text and d.find_element(By.ID, "who").text)
    return str(who)


def oidc_sign_out(driver: Any, base_url: str) -> None:
    """Sign out from the dashboard and end the provider's session; returns once back on the dashboard."""
    from selenium.webdriver.common.by import By

    wait(driver, lambda d: d.find_element(By.ID, "sign-out")).click()
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "button[name=logout]")).click()  # "Yes, sign me out"
    wait(driver, lambda d: d.current_url.startswith(f"{base_url}/") and d.find_element(By.ID, "sso"))
