"""The dashboard's files: served by the app, valid JavaScript (node --check where node is installed), and no
HTML built from strings (values from the API reach the page as text only)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from gpuorch_api.entrypoint import _mount_dashboard

STATIC = Path(__file__).resolve().parents[1] / "src" / "gpuorch_api" / "static"


def test_the_pages_are_served_and_build_no_html_from_strings() -> None:
    app = FastAPI()
    _mount_dashboard(app)
    client = TestClient(app)
    assert "API token" in client.get("/").text
    script = client.get("/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "innerHTML" not in script.text and "insertAdjacentHTML" not in script.text
    assert client.get("/style.css").status_code == 200


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (.ci/run installs nodejs)")
def test_the_script_parses() -> None:
    checked = subprocess.run(["node", "--check", str(STATIC / "app.js")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
