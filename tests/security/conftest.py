"""The escalation tests (``-m security``, ``make security``); they also run in a plain ``make test``."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "roomy: the in-process API of test_api_limits with the default rate limits")
