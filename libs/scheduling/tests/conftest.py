"""The openb trace, for the replays through the Harness (pure logic: no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACE_DIRS = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "openb",
    Path(__file__).resolve().parents[4] / "shared" / "traces" / "openb",
)


@pytest.fixture(scope="session")
def openb_dir() -> Path:
    for d in TRACE_DIRS:
        if (d / "openb_node_list_gpu_node.csv").is_file():
            return d
    pytest.skip("openb trace not present in this checkout")
