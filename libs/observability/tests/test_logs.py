"""Logging keeps working when the process's stderr is swapped and the old stream closed (CLI test runners)."""

from __future__ import annotations

import io
import json
import sys

import pytest
from gpuorch_observability import configure_logging, get_logger


def test_logging_writes_to_the_current_stderr_not_the_one_at_configure_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    swapped = io.StringIO()
    real, sys.stderr = sys.stderr, swapped
    try:
        configure_logging("test-logs", "INFO")
    finally:
        sys.stderr = real
    swapped.close()  # what a CLI runner does with its capture buffer
    get_logger("x").info("still.logging", job_id="j1")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "still.logging" and line["job_id"] == "j1" and line["service"] == "test-logs"
