"""The dashboard in a real browser (headless Chromium from Debian's packages, driven by selenium through
/usr/bin/chromedriver: nothing is downloaded): with a team's token the pages load with live data from a running
stack, a job submitted through the page reaches succeeded, another team's jobs are not shown, and the weekly
report's charts draw the team's job (and nothing of the other team's)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import TEAM_TOKENS, api_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("headless Chromium is not installed (apt-get install -y chromium chromium-driver; .ci/run does)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev dependency: run uv sync")


@pytest.fixture(scope="module")
def stack_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with api_stack(tmp_path_factory.mktemp("dashboard")) as stack:
        assert stack.api_url is not None
        yield stack.api_url


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(browser: Any, condition: Any, timeout_s: float = 60) -> Any:
    """The first truthy value of ``condition(browser)``. A page that re-renders (live data) replaces its elements
    between two calls: a stale or not-yet-present element means "ask again", never a failure."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(condition)


def now(browser: Any, read: Any) -> Any:
    """``read(browser)`` as the page shows it now, read again if the page re-rendered mid-read (falsy allowed)."""
    return until(browser, lambda b: (read(b),))[0]


def research_job(url: str) -> str:
    """Another team's job, finished before the browser opens."""
    headers = {"Authorization": f"Bearer {TEAM_TOKENS['research-team']}"}
    spec = {"name": "research-secret-job", "resources": {"gpus": 1},  # runs long enough to be sampled
            "run": {"runtime": "process", "argv": ["python", "-c", "import time; time.sleep(5); print('research')"]}}
    job_id: str = httpx.post(f"{url}/api/v1/jobs", json={"spec": spec}, headers=headers).json()["job_id"]
    deadline = time.monotonic() + 90
    while True:
        job = httpx.get(f"{url}/api/v1/jobs/{job_id}", headers=headers).json()
        if job.get("state") in ("succeeded", "failed", "rejected", "cancelled"):
            break
        assert time.monotonic() < deadline, f"the research job did not end: {job}"
        time.sleep(0.3)
    assert job["state"] == "succeeded", job
    return job_id


def test_a_team_member_sees_the_fleet_submits_from_the_page_and_sees_only_its_jobs(
        stack_url: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    hidden = research_job(stack_url)
    browser.get(f"{stack_url}/#/fleet")
    browser.find_element(By.ID, "token").send_keys("not-a-token")
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    until(browser, lambda b: "unknown token" in b.find_element(By.ID, "login-error").text)

    token = browser.find_element(By.ID, "token")
    token.clear()
    token.send_keys(TEAM_TOKENS["acme-team"])
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    until(browser, lambda b: "acme-team" in b.find_element(By.ID, "who").text)
    nodes = until(browser, lambda b: {n.get_attribute("data-node"): n.text
                                      for n in b.find_elements(By.CSS_SELECTOR, "[data-node]")})
    assert sorted(nodes) == ["node-1", "node-2"]
    assert all("GPUs free" in text for text in nodes.values())
    # the scheduler's MIG planner below the nodes: its mode, and its proposals once there are any
    until(browser, lambda b: "MIG planner: mode advise" in b.find_element(By.ID, "mig-plan").text)

    browser.get(f"{stack_url}/#/submit")
    until(browser, lambda b: b.find_elements(By.ID, "submit-form"))
    browser.find_element(By.ID, "name").clear()
    browser.find_element(By.ID, "name").send_keys("from-the-page")
    browser.find_element(By.ID, "command").send_keys('["python", "-c", "import time; time.sleep(5); print(42)"]')
    browser.find_element(By.CSS_SELECTOR, "#submit-form button").click()
    until(browser, lambda b: b.find_element(By.ID, "submitted-link").click() or True)
    # the job page follows the job live (events refresh it) until it succeeded
    until(browser, lambda b: b.find_element(By.ID, "job").get_attribute("data-state") == "succeeded", 90)
    page = now(browser, lambda b: b.find_element(By.ID, "job").text)
    assert "job.accepted" in page and "job.finished" in page and "node-" in page  # timeline and placement

    browser.get(f"{stack_url}/#/jobs")
    links = until(browser, lambda b: {link.text for link in b.find_elements(By.CSS_SELECTOR, "a.job-link")})
    assert hidden[:8] not in links
    jobs = now(browser, lambda b: b.find_element(By.ID, "jobs").text)
    assert "research-secret-job" not in jobs and "from-the-page" in jobs

    browser.get(f"{stack_url}/#/queues")
    until(browser, lambda b: "training" in b.find_element(By.ID, "queues").text)
    browser.get(f"{stack_url}/#/tenants")
    until(browser, lambda b: "acme" in b.find_element(By.ID, "tenants").text)
    tenants = now(browser, lambda b: b.find_element(By.ID, "tenants").text)
    assert "acme" in tenants and "research" not in tenants
    browser.get(f"{stack_url}/#/week")  # the weekly view: GPU-hours per day, drawn from telemetry's samples
    assert until(browser, lambda b: b.find_element(By.ID, "usage-chart").is_displayed())
    assert "research" not in now(browser, lambda b: b.find_element(By.ID, "week").text)

    # the weekly report: its charts drawn from the team's own job once telemetry has its samples
    deadline = time.monotonic() + 90
    while True:
        browser.get(f"{stack_url}/#/report/1h")
        browser.refresh()
        section = until(browser, lambda b: b.find_element(By.ID, "report").text)
        kinds = now(browser, lambda b: {bar.get_attribute("data-kind") for bar in b.find_elements(
            By.CSS_SELECTOR, '#report-allocation rect[data-tenant="acme"]')})
        if kinds:
            break
        assert time.monotonic() < deadline, f"no bar for acme in the report: {section[:2000]}"
    assert kinds == {"allocated", "used"}
    assert now(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#report-utilisation circle[data-point]"))
    assert now(browser, lambda b: b.find_element(By.ID, "report-queue-wait").is_displayed())
    assert now(browser, lambda b: b.find_element(By.ID, "report-conclusions").text)
    report = now(browser, lambda b: b.find_element(By.ID, "report").text)
    assert "from-the-page" in now(browser, lambda b: b.find_element(By.ID, "report-jobs").text)
    assert "research" not in report and hidden[:8] not in report  # another team's job is not listed
    assert not now(browser, lambda b: b.find_elements(By.CSS_SELECTOR, '#report [data-tenant="research"]'))


SESSION_ARGV = ["python", "-c", "import http.server, os, pathlib; p = pathlib.Path('starts.txt'); "
                "p.write_text(str(int(p.read_text()) + 1 if p.exists() else 1)); "
                "http.server.HTTPServer(('127.0.0.1', int(os.environ['GPUORCH_PORT'])), "
                "http.server.SimpleHTTPRequestHandler).serve_forever()"]
"""A session that counts its starts in its work directory (2 after a park and a resume: the directory was kept)."""


def test_the_sessions_page_lists_parks_resumes_and_opens_a_session(stack_url: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    headers = {"Authorization": f"Bearer {TEAM_TOKENS['acme-team']}"}
    spec = {"name": "notebook", "tier": "interactive", "resources": {"gpus": 1},
            "run": {"runtime": "process", "argv": SESSION_ARGV}}
    session = httpx.post(f"{stack_url}/api/v1/jobs", json={"spec": spec}, headers=headers).json()["job_id"]
    browser.get(f"{stack_url}/#/sessions")
    browser.find_element(By.ID, "token").send_keys(TEAM_TOKENS["acme-team"])
    browser.find_element(By.CSS_SELECTOR, "#login button").click()

    def row(b: Any) -> Any:
        return b.find_element(By.CSS_SELECTOR, f'#sessions a[data-job="{session}"]').find_element(
            By.XPATH, "./ancestor::tr")

    def state_is(wanted: str) -> Any:
        return lambda b: wanted in row(b).text.split()

    until(browser, state_is("running"), 90)
    until(browser, lambda b: row(b).find_element(By.CSS_SELECTOR, "button.park-session").click() or True)
    until(browser, state_is("parked"), 90)
    hours = until(browser, lambda b: float(row(b).find_element(By.CSS_SELECTOR, ".parked-hours")
                                           .get_attribute("data-hours") or 0) > 0 and row(b))
    assert hours.find_element(By.CSS_SELECTOR, ".parked-hours").text not in ("", "-", "0")
    assert "GPU-hours" in now(browser, lambda b: b.find_element(By.CSS_SELECTOR, "#sessions .hint").text)
    until(browser, lambda b: row(b).find_element(By.CSS_SELECTOR, "button.resume-session").click() or True)
    until(browser, state_is("running"), 90)

    # open: signed in with ?token= once, then the session itself (its work directory's file kept across the park)
    opened = now(browser, lambda b: row(b).find_element(By.CSS_SELECTOR, "a.open-session").get_attribute("href"))
    browser.get(opened.replace("?", "starts.txt?", 1))
    until(browser, lambda b: b.find_element(By.TAG_NAME, "body").text == "2", 60)
    assert "token=" not in browser.current_url
    browser.get(f"{stack_url}/#/sessions")
    until(browser, lambda b: row(b).find_element(By.CSS_SELECTOR, "button.stop-session").click() or True)
    until(browser, state_is("cancelled"), 90)
