"""The dashboard in a real browser (headless Chromium from Debian's packages, driven by selenium through
/usr/bin/chromedriver: nothing is downloaded): with a team's token the pages load with live data from a running
stack, a job submitted through the page reaches succeeded, another team's jobs are not shown, and the weekly
report's charts draw the team's job (and nothing of the other team's). The workbench: signed in through a real
OpenID provider (tests/oidc_provider, where node and npm run it, as in CI; else with the team's token), a running
job's log is followed, the job is cancelled through the confirmation and its state changes, the job list pages and
filters, and the utilisation charts hold telemetry's points. A session's start that the scheduler commits after its
event reached the page still shows. Signing in is one call (``sign_in``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.e2e.harness import TEAM_TOKENS, api_stack

if TYPE_CHECKING:
    from gpuorch_gpuctl_ops.stack import LocalStack
from tests.e2e.oidc import oidc_sign_in
from tests.oidc_provider import Provider, oidc_provider

__all__ = ["oidc_provider"]

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("headless Chromium is not installed (apt-get install -y chromium chromium-driver; .ci/run does)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev dependency: run uv sync")


@pytest.fixture(scope="module")
def sso_provider(request: pytest.FixtureRequest) -> Provider | None:
    """The real OpenID provider where node and npm run it (CI installs both), else None (token sign-in only)."""
    try:
        provider: Provider = request.getfixturevalue("oidc_provider")
    except pytest.skip.Exception:
        return None
    return provider


@pytest.fixture(scope="module")
def dashboard_stack(tmp_path_factory: pytest.TempPathFactory, sso_provider: Provider | None) -> Iterator[LocalStack]:
    oidc = None if sso_provider is None else {
        "issuer": sso_provider.issuer, "client_id": sso_provider.client_id, "provider_name": "Test IdP",
        "groups": [{"group": "gpuorch-operators", "identity": "ops"}, {"group": "acme-devs", "identity": "acme-team"}]}
    with api_stack(tmp_path_factory.mktemp("dashboard"), oidc) as stack:
        assert stack.api_url is not None
        yield stack


@pytest.fixture(scope="module")
def stack_url(dashboard_stack: LocalStack) -> str:
    assert dashboard_stack.api_url is not None
    return dashboard_stack.api_url


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


def sign_in(browser: Any, url: str, who: str = "acme-team", page: str = "#/fleet") -> None:
    """Open ``page`` of the dashboard signed in as ``who`` (one of ``TEAM_TOKENS``), once the page says so. The
    one place a test signs in: today by pasting the team's token into the header's form."""
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/{page}")
    token = until(browser, lambda b: b.find_element(By.ID, "token"))
    token.clear()
    token.send_keys(TEAM_TOKENS[who])
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    until(browser, lambda b: who in b.find_element(By.ID, "who").text)


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
        labels = now(browser, lambda b: json.loads(b.find_element(By.ID, "report-allocation")
                                                   .get_attribute("data-labels") or "[]"))
        if "acme" in labels:
            break
        assert time.monotonic() < deadline, f"no bar for acme in the report: {section[:2000]}"
    assert labels == ["acme"]  # the team's own tenant only
    assert int(now(browser, lambda b: b.find_element(By.ID, "report-allocation").get_attribute("data-points"))) == 2
    assert int(now(browser, lambda b: b.find_element(By.ID, "report-utilisation").get_attribute("data-points"))) > 0
    assert now(browser, lambda b: b.find_element(By.ID, "report-queue-wait").is_displayed())
    assert now(browser, lambda b: b.find_element(By.ID, "report-conclusions").text)
    report = now(browser, lambda b: b.find_element(By.ID, "report").text)
    assert "from-the-page" in now(browser, lambda b: b.find_element(By.ID, "report-jobs").text)
    assert "research" not in report and hidden[:8] not in report  # another team's job is not listed
    assert "research" not in now(browser, lambda b: " ".join(
        c.get_attribute("data-labels") or "" for c in b.find_elements(By.CSS_SELECTOR, "#report .chart")))


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
    sign_in(browser, stack_url, page="#/sessions")

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


def test_the_sessions_page_shows_a_start_the_scheduler_commits_after_its_event_reached_the_page(
        dashboard_stack: LocalStack, browser: Any) -> None:
    """An executor's job.started reaches the page's live stream as the scheduler receives it; the read model the page
    re-reads shows it only once the scheduler has committed it. Here the scheduler is held (SIGSTOP) until the page
    re-read after the event: the page must still come to show the session running, with no later event."""
    from selenium.webdriver.common.by import By

    url = dashboard_stack.api_url
    assert url is not None
    executor, scheduler = (dashboard_stack.processes[name].popen for name in ("executor", "scheduler-1"))
    assert executor is not None and scheduler is not None
    headers = {"Authorization": f"Bearer {TEAM_TOKENS['acme-team']}"}
    spec = {"name": "held-start", "tier": "interactive", "resources": {"gpus": 1},
            "run": {"runtime": "process", "argv": SESSION_ARGV}}
    sign_in(browser, url, page="#/sessions")
    executor_log = Path(dashboard_stack.processes["executor"].log_path)

    def row(b: Any) -> Any:
        return b.find_element(By.CSS_SELECTOR, f'#sessions a[data-job="{session}"]').find_element(
            By.XPATH, "./ancestor::tr")

    os.killpg(executor.pid, signal.SIGSTOP)  # the launch waits in its queue
    try:
        session = httpx.post(f"{url}/api/v1/jobs", json={"spec": spec}, headers=headers).json()["job_id"]
        shown = until(browser, lambda b: "placed" in row(b).text.split() and row(b), 90)
        os.killpg(scheduler.pid, signal.SIGSTOP)  # (and its outbox relay: one process group)
        os.killpg(executor.pid, signal.SIGCONT)
        until(browser, lambda b: f'"job_id": "{session}"' in "".join(
            line for line in executor_log.read_text(errors="replace").splitlines() if '"job.started"' in line), 60)
        until(browser, lambda b: not _attached(shown))  # the page re-read the read model after the event...
        assert "placed" in now(browser, lambda b: row(b).text).split()  # ...which the scheduler has not updated
    finally:
        os.killpg(scheduler.pid, signal.SIGCONT)
        os.killpg(executor.pid, signal.SIGCONT)
    until(browser, lambda b: "running" in row(b).text.split(), 60)
    httpx.post(f"{url}/api/v1/jobs/{session}/cancel", json={"reason": "test over"}, headers=headers)


def _attached(element: Any) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        element.is_enabled()
        return True
    except StaleElementReferenceException:
        return False


LOGGING_ARGV = ["python", "-c", "import time\nfor i in range(100000):\n    print(f'line {i}', flush=True)\n"
                "    time.sleep(0.2)"]
"""A job that writes a line five times a second until it is cancelled."""


def submit(url: str, name: str, argv: list[str], tier: str = "batch", who: str = "acme-team") -> str:
    headers = {"Authorization": f"Bearer {TEAM_TOKENS[who]}"}
    spec = {"name": name, "tier": tier, "resources": {"gpus": 1}, "run": {"runtime": "process", "argv": argv}}
    answer = httpx.post(f"{url}/api/v1/jobs", json={"spec": spec}, headers=headers)
    assert answer.status_code == 202, answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def listed(url: str, job_ids: list[str], who: str = "acme-team") -> None:
    """Wait until the scheduler accepted every job (each in the API's listing)."""
    headers = {"Authorization": f"Bearer {TEAM_TOKENS[who]}"}
    deadline = time.monotonic() + 60
    while not set(job_ids) <= {j["id"] for j in httpx.get(f"{url}/api/v1/jobs", params={"limit": 500},
                                                          headers=headers).json()}:
        assert time.monotonic() < deadline, f"not all of {job_ids} were accepted"
        time.sleep(0.2)


def test_a_team_member_follows_a_jobs_log_cancels_it_pages_the_jobs_and_reads_its_utilisation(
        stack_url: str, browser: Any, sso_provider: Provider | None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    short = [submit(stack_url, f"pager-{i}", ["python", "-c", "print(1)"], tier="training" if i == 2 else "batch")
             for i in range(3)]
    running = submit(stack_url, "follow-me", LOGGING_ARGV)
    listed(stack_url, [*short, running])
    if sso_provider is not None:  # through the provider's login page: alice (group acme-devs) is acme-team
        oidc_sign_in(browser, stack_url, "alice", "#/jobs?q=pager-&limit=2", identity="acme-team")
    else:
        sign_in(browser, stack_url, page="#/jobs?q=pager-&limit=2")

    # paging: two of three, then the third, then back; a filter narrows the list
    def rows(b: Any) -> list[str]:
        return [a.get_attribute("data-job") for a in b.find_elements(By.CSS_SELECTOR, "#jobs a.job-link")]

    newest = [j["id"] for j in httpx.get(f"{stack_url}/api/v1/jobs", params={"q": "pager-"}, headers={
        "Authorization": f"Bearer {TEAM_TOKENS['acme-team']}"}).json()]  # the order the scheduler accepted them in
    assert sorted(newest) == sorted(short)
    until(browser, lambda b: rows(b) == newest[:2])
    assert "1–2 of 3" in now(browser, lambda b: b.find_element(By.ID, "jobs-pager").text)
    until(browser, lambda b: b.find_element(By.ID, "jobs-next").click() or True)  # the page re-renders on events
    until(browser, lambda b: rows(b) == newest[2:])
    assert "3–3 of 3" in now(browser, lambda b: b.find_element(By.ID, "jobs-pager").text)
    assert not now(browser, lambda b: b.find_element(By.ID, "jobs-next").is_enabled())
    until(browser, lambda b: b.find_element(By.ID, "jobs-prev").click() or True)
    until(browser, lambda b: rows(b) == newest[:2])
    until(browser, lambda b: Select(b.find_element(By.ID, "jobs-tier")).select_by_value("training") or True)
    until(browser, lambda b: rows(b) == [short[2]])

    # the running job's log, followed as it grows
    browser.get(f"{stack_url}/#/job/{running}")
    until(browser, lambda b: b.find_element(By.ID, "job").get_attribute("data-state") == "running", 90)
    until(browser, lambda b: "line 3" in b.find_element(By.ID, "job-log").text, 60)
    assert now(browser, lambda b: b.find_element(By.ID, "job-log").get_attribute("data-following")) == "true"
    until(browser, lambda b: "line 12" in b.find_element(By.ID, "job-log").text, 60)  # more came, unasked

    # cancel: the confirmation first (Back leaves the job alone), then confirmed: the state changes
    until(browser, lambda b: b.find_element(By.ID, "cancel-job").click() or True)
    until(browser, lambda b: b.find_element(By.ID, "confirm-back").click() or True)
    assert not browser.find_elements(By.CSS_SELECTOR, "dialog[open]")
    assert httpx.get(f"{stack_url}/api/v1/jobs/{running}", headers={
        "Authorization": f"Bearer {TEAM_TOKENS['acme-team']}"}).json()["state"] == "running"
    until(browser, lambda b: b.find_element(By.ID, "cancel-job").click() or True)
    assert "Cancel this job?" in until(browser, lambda b: b.find_element(By.CSS_SELECTOR, "dialog[open]").text)
    browser.find_element(By.ID, "confirm-yes").click()
    until(browser, lambda b: b.find_element(By.ID, "job").get_attribute("data-state") == "cancelled", 90)
    until(browser, lambda b: "end of log" in b.find_element(By.ID, "log-status").text, 60)  # following stopped
    assert not now(browser, lambda b: b.find_elements(By.ID, "cancel-job"))  # an ended job offers requeue only
    assert now(browser, lambda b: b.find_element(By.ID, "requeue-job").is_displayed())

    # its utilisation over its life, from telemetry's samples; and the GPUs of its node
    def points(chart: str) -> int:
        return int(now(browser, lambda b: b.find_element(By.ID, chart).get_attribute("data-points")) or 0)

    deadline = time.monotonic() + 60
    while points("job-util") == 0:
        assert time.monotonic() < deadline, "no telemetry point in the job's utilisation chart"
        browser.refresh()
        until(browser, lambda b: b.find_element(By.ID, "job-util"))
    assert points("job-memory") > 0
    values = now(browser, lambda b: b.execute_script(
        "return document.getElementById('job-util').chart.data[1].filter((v) => v !== null).length"))
    assert values == points("job-util")  # drawn from the same series the chart counts
    node = now(browser, lambda b: b.find_element(By.CSS_SELECTOR, '[data-field="nodes"]').text).split(",")[0]
    browser.get(f"{stack_url}/#/node/{node}")
    until(browser, lambda b: int(b.find_element(By.ID, "node-util").get_attribute("data-points") or 0) > 0)


def test_an_operator_changes_a_jobs_priority_and_a_team_member_is_not_offered_it(
        stack_url: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    job = submit(stack_url, "reprioritise-me", LOGGING_ARGV)
    listed(stack_url, [job])
    sign_in(browser, stack_url, who="acme-team", page=f"#/job/{job}")
    until(browser, lambda b: b.find_element(By.ID, "cancel-job"))
    assert not browser.find_elements(By.ID, "change-priority")  # submitters: no such control

    sign_in(browser, stack_url, who="ops", page=f"#/job/{job}")
    until(browser, lambda b: Select(b.find_element(By.ID, "priority-class")).select_by_value("low") or True)
    until(browser, lambda b: b.find_element(By.ID, "change-priority").click() or True)
    assert "normal to low" in until(browser, lambda b: b.find_element(By.CSS_SELECTOR, "dialog[open]").text)
    browser.find_element(By.ID, "confirm-yes").click()
    # the scheduler logged the change and its read model shows it: the page follows live
    until(browser, lambda b: b.find_element(By.CSS_SELECTOR, '[data-field="priority"]').text == "low", 60)
    headers = {"Authorization": f"Bearer {TEAM_TOKENS['acme-team']}"}
    timeline = httpx.get(f"{stack_url}/api/v1/jobs/{job}", headers=headers).json()["timeline"]
    assert "job.priority_changed" in [e["type"] for e in timeline]
    httpx.post(f"{stack_url}/api/v1/jobs/{job}/cancel", headers=headers)
