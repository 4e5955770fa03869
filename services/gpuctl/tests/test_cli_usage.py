"""gpuctl's command line refuses what it cannot read before it does anything: no server is needed (every address
here is one where nothing listens), so a command that got past parsing would fail differently (exit 1, "cannot
reach")."""

from __future__ import annotations

import pytest

from .conftest import Gpuctl

NOWHERE = "http://127.0.0.1:9"


@pytest.mark.parametrize(("typed", "nearest"), [("--gpu", "--gpus"), ("--gpu-mem", "--gpu-memory"),
                                                 ("--nme", "--name")])
def test_a_misspelt_submit_option_is_refused_naming_the_nearest(gpuctl: Gpuctl, typed: str, nearest: str) -> None:
    done = gpuctl("--server", NOWHERE, "submit", typed, "1", "--", "python", "train.py")
    assert (done.exit_code, done.stdout) == (2, ""), done.output
    assert f"No such option: {typed}" in done.stderr and nearest in done.stderr
    assert "cannot reach" not in done.stderr  # refused before anything was sent


def test_options_after_the_double_dash_are_the_jobs(gpuctl: Gpuctl) -> None:
    done = gpuctl("--server", NOWHERE, "submit", "--gpus", "1", "--", "python", "train.py", "--gpu", "1")
    assert done.exit_code == 1 and "cannot reach the gpuorch API" in done.stderr  # parsed; then the API is away


@pytest.mark.parametrize(("args", "says"), [
    (["--gpus", "1"], "no command to run: gpuctl submit [OPTIONS] -- COMMAND"),
    (["--gpu-milli", "5000", "--", "python", "x.py"], "invalid job: resources.gpu_milli: Input should be less than"),
    (["--nodes", "2", "--topology", "rack", "--", "python", "x.py"], "invalid --topology 'rack': required:LEVEL"),
])
def test_a_job_that_does_not_validate_is_one_clear_line(gpuctl: Gpuctl, args: list[str], says: str) -> None:
    done = gpuctl("--server", NOWHERE, "submit", *args)
    assert (done.exit_code, done.stdout) == (2, ""), done.output
    assert done.stderr.splitlines() == [done.stderr.strip()] and says in done.stderr
    assert "pydantic" not in done.stderr and "validation error for" not in done.stderr and "input_value" not in done.stderr


BOX_DRAWING = {chr(c) for c in range(0x2500, 0x2580)}


@pytest.mark.parametrize(("args", "code", "says"), [
    (["submit", "--gpu", "1", "--", "python", "x.py"], 2, "No such option: --gpu"),
    (["--help"], 0, "  GPUCTL_SERVER   "),  # the environment's lines kept whole
    (["jobs", "--help"], 0, " jobs [OPTIONS]"),
    (["db", "--help"], 0, " db [OPTIONS] COMMAND"),  # a command module loaded when asked
])
def test_the_script_piped_prints_no_box_drawing_characters(args: list[str], code: int, says: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "GPUCTL_CONFIG": "/nonexistent.yaml"})
    assert done.returncode == code, done.stderr
    assert says in " ".join(done.stdout.split(" " * 20)) + done.stderr  # (runs of padding shortened)
    assert not BOX_DRAWING & set(done.stdout + done.stderr)
