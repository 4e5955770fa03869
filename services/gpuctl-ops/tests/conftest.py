"""gpuctl-ops tests' fixtures: ``fake_systemctl`` (fake_systemctl.py first on PATH as ``systemctl``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FAKE = Path(__file__).with_name("fake_systemctl.py")


@pytest.fixture
def fake_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake ``systemctl`` first on PATH (in this process and its children); yields its state directory."""
    bin_dir, state, runtime = tmp_path / "bin", tmp_path / "systemctl-state", tmp_path / "run"
    bin_dir.mkdir()
    runtime.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("FAKE_SYSTEMCTL_STATE", str(state))
    yield state
    for pid_file in state.glob("*.pid"):  # whatever a failed test left running
        subprocess.run([str(script), "--user", "stop", pid_file.name.removesuffix(".pid")], check=False)
