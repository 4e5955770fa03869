"""A stand-in for ``systemctl --user`` on a machine without systemd (test_systemd_units.py puts it on PATH as
``systemctl``). It records each call as a JSON line in ``$FAKE_SYSTEMCTL_STATE/calls.jsonl`` and does what the
user manager would for the units gpuctl up writes, read from ``$XDG_RUNTIME_DIR/systemd/user``:

    --version                     systemd 255
    --user is-system-running      running
    --user start UNIT             a .service: runs its ExecStart with its Environment= and EnvironmentFile= only
                                  (what a user manager hands a unit, plus HOME), in WorkingDirectory, appending to
                                  its StandardOutput=append: file, in a session of its own; a .target: nothing
    --user stop UNIT...           a .service: SIGTERM to its process group, SIGKILL after 15 s; a .target: every
                                  unit ``PartOf=`` it
    --user show -p MainPID --value UNIT    its pid while it runs, else 0
    --user daemon-reload | reset-failed    nothing
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_SYSTEMCTL_STATE"])
UNITS = Path(os.environ.get("XDG_RUNTIME_DIR", "/nonexistent")) / "systemd" / "user"


def _settings(unit: str) -> list[tuple[str, str]]:
    pairs = []
    for line in (UNITS / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("[", "#")):
            key, value = line.split("=", 1)
            pairs.append((key, value))
    return pairs


def _unescape(value: str, *, dollars: bool) -> list[str]:
    value = value.replace("%%", "%")
    return shlex.split(value.replace("$$", "$") if dollars else value)


def _pid(unit: str) -> int:
    path = STATE / f"{unit}.pid"
    if not path.exists():
        return 0
    pid = int(path.read_text())
    try:
        os.kill(pid, 0)
    except OSError:
        return 0
    return pid


def start(unit: str) -> None:
    if unit.endswith(".target") or _pid(unit):
        return
    env = {"HOME": os.environ.get("HOME", "/"), "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}
    argv: list[str] = []
    cwd, log = None, None
    for key, value in _settings(unit):
        if key == "Environment":
            for pair in _unescape(value, dollars=False):
                env.update([pair.split("=", 1)])
        elif key == "EnvironmentFile":
            for line in Path(value).read_text().splitlines():
                env.update([shlex.split(line)[0].split("=", 1)])
        elif key == "ExecStart":
            argv = _unescape(value, dollars=True)
        elif key == "WorkingDirectory":
            cwd = value
        elif key == "StandardOutput" and value.startswith("append:"):
            log = value.removeprefix("append:")
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    (STATE / f"{unit}.pid").write_text(str(process.pid))


def stop(unit: str) -> None:
    if unit.endswith(".target"):
        for path in UNITS.glob("*.service"):
            if ("PartOf", unit) in _settings(path.name):
                stop(path.name)
        return
    pid = _pid(unit)
    if pid:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _pid(unit) and time.monotonic() < deadline:
            time.sleep(0.1)  # the fake's own wait on a process that is not its child (systemd waits too)
        if _pid(unit):
            os.killpg(pid, signal.SIGKILL)
    (STATE / f"{unit}.pid").unlink(missing_ok=True)


def main(args: list[str]) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    with (STATE / "calls.jsonl").open("a") as calls:
        calls.write(json.dumps(args) + "\n")
    if args == ["--version"]:
        print("systemd 255 (255.4-1ubuntu8)\n+PAM +AUDIT")
        return 0
    if args[:1] != ["--user"]:
        return 1
    verb, rest = args[1], args[2:]
    if verb == "is-system-running":
        print("running")
    elif verb == "start":
        for unit in rest:
            start(unit)
    elif verb == "stop":
        for unit in rest:
            stop(unit)
    elif verb == "show":
        print(_pid(rest[-1]))
    elif verb not in ("daemon-reload", "reset-failed"):
        print(f"fake systemctl: {verb} is not faked", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
