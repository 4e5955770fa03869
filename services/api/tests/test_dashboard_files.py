"""The dashboard's files: served by the app, valid JavaScript (node --check where node is installed), no HTML built
from strings (values from the API reach the page as text only), and nothing loaded from another site: the chart
library (``/charts/``) and Swagger UI's assets (``/docs``) are served by the app itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gpuorch_api.entrypoint import create_app
from gpuorch_report.charts import WEB_ASSETS

STATIC = Path(__file__).resolve().parents[1] / "src" / "gpuorch_api" / "static"
OUR_SCRIPTS = ("/app.js", "/jobs.js", "/charts/charts.js")


def test_the_pages_are_served_and_build_no_html_from_strings() -> None:
    client = TestClient(create_app(backends=object()))  # type: ignore[arg-type]  # no route here reads them
    page = client.get("/").text
    assert "API token" in page
    for path in OUR_SCRIPTS:
        script = client.get(path)
        assert script.status_code == 200 and "javascript" in script.headers["content-type"], path
        assert "innerHTML" not in script.text and "insertAdjacentHTML" not in script.text, path
    assert client.get("/style.css").status_code == 200
    for linked in re.findall(r'(?:src|href)="([^"#]+)"', page):  # every script and stylesheet, from this app
        assert linked.startswith("/") and client.get(linked).status_code == 200, linked


def test_swagger_ui_loads_its_assets_from_the_app_not_a_cdn() -> None:
    client = TestClient(create_app(backends=object()))  # type: ignore[arg-type]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: ['"]([^'"]+)['"]""", docs.text)
    urls = [a or b for a, b in assets]
    assert urls and not [u for u in urls if "//" in u], urls  # no http(s):// nor protocol-relative URL
    for url in urls:
        assert client.get(url).status_code == 200, url
    assert client.get("/redoc").status_code == 404  # ReDoc's page loads from a CDN: not offered


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (.ci/run installs nodejs)")
def test_the_scripts_parse() -> None:
    for script in (STATIC / "app.js", STATIC / "jobs.js", WEB_ASSETS / "charts.js"):
        checked = subprocess.run(["node", "--check", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{script}: {checked.stderr}"
