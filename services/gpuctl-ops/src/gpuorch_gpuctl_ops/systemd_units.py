"""A stack's services as systemd user units, where systemd runs for this user (``gpuctl up``; decision 68).

    probe(runtime_dir)                  does systemd run for this user, and which version (``SystemdProbe``)
    choose_supervisor(mode, probe)      ``auto`` / ``systemd`` / ``builtin`` -> ``systemd`` or ``builtin``
    StackUnits(root, unit_dir, ...)     one stack's units: names, files, start, stop and removal

Each service becomes ``gpuorch-<tag>-<name>.service`` (``<tag>``: 8 hex digits of the stack's root, so two stacks
of one user never share a unit), ``PartOf=`` the stack's ``gpuorch-<tag>.target``, written to
``$XDG_RUNTIME_DIR/systemd/user`` (a runtime unit: gone at reboot, never enabled) with ``Restart=on-failure``,
``RestartSec=1`` and, from systemd 254, ``RestartSteps``/``RestartMaxDelaySec`` growing the delay to 30 s as the
builtin supervisor does (supervise.py); ``StartLimitIntervalSec=0`` (systemd never gives up restarting, as the builtin
supervisor never does); the service's log appended to ``<root>/logs/<name>.log``; ``WorkingDirectory=<root>``.
The executor has ``KillMode=process``: its jobs' supervisors outlive a restart of the executor by design (they do
under the builtin supervisor too); ``gpuctl down`` kills them (``LocalStack.kill_jobs``).

Environment: the variables a service reads (``GPUORCH_*``, ``OTEL_*``, ``PATH``, locale, ``TMPDIR``, the visible
devices), not the caller's whole environment as for a process started directly. A variable whose name says secret
(TOKEN, SECRET, PASSWORD, KEY) or whose value is a URL with a password (the broker users' URLs) goes to
``<root>/systemd/<name>.env`` (mode 0600, named by ``EnvironmentFile=``), never into the unit, which any process of
the user can read through ``systemctl --user cat``.

Every ``systemctl`` call goes through ``StackUnits.systemctl`` (``systemctl --user ...``, the first ``systemctl``
on PATH): tests put a fake one there.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SUPERVISORS = ("auto", "systemd", "builtin")
MIN_VERSION = 240
"""``StandardOutput=append:`` (the service's log file) needs systemd 240; older ones get the builtin supervisor."""
STEPS_VERSION = 254
"""``RestartSteps=`` and ``RestartMaxDelaySec=`` (a growing restart delay) came with systemd 254."""
LIVE_STATES = ("running", "degraded", "starting", "initializing", "maintenance", "stopping")
"""Answers of ``systemctl --user is-system-running`` from a user manager that runs (``offline``: none does)."""
PASSED_ON = ("PATH", "PYTHONUNBUFFERED", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES",
             "NVIDIA_VISIBLE_DEVICES")
"""Variables handed to a unit besides ``GPUORCH_*`` and ``OTEL_*``."""
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|(^|_)KEY($|_)")
_URL_WITH_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@:]*:[^/@]+@", re.IGNORECASE)


@dataclass(frozen=True)
class SystemdProbe:
    """What ``probe`` found: ``runs`` (a user manager answers, version at least ``MIN_VERSION``), ``version``
    (None: unknown) and ``why`` (a sentence for people, the reason when it does not run)."""

    runs: bool
    version: int | None
    why: str


def _version(systemctl: str) -> int | None:
    try:
        first = subprocess.run([systemctl, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.match(r"systemd (\d+)", first.strip())
    return int(found.group(1)) if found else None


def probe(runtime_dir: str | None) -> SystemdProbe:
    """Whether systemd runs for this user: ``systemctl`` is on PATH, and ``$XDG_RUNTIME_DIR/systemd`` exists or
    ``systemctl --user is-system-running`` answers a live state; and its version has what the units need."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return SystemdProbe(False, None, "no systemctl on PATH")
    if not runtime_dir:
        return SystemdProbe(False, None, "XDG_RUNTIME_DIR is unset (no user session: systemctl --user cannot "
                                         "reach a user manager)")
    live = (Path(runtime_dir) / "systemd").is_dir()
    if not live:
        try:
            state = subprocess.run([systemctl, "--user", "is-system-running"], capture_output=True, text=True,
                                   timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            state = ""
        live = state in LIVE_STATES
    if not live:
        return SystemdProbe(False, None, "no systemd user manager runs for this user")
    version = _version(systemctl)
    if version is None or version < MIN_VERSION:
        return SystemdProbe(False, version, f"systemd {version or '?'} is older than {MIN_VERSION} (no "
                                            "StandardOutput=append:)")
    return SystemdProbe(True, version, f"systemd {version} user manager")


def choose_supervisor(mode: str, found: SystemdProbe) -> str:
    """``systemd`` or ``builtin`` for ``--supervisor MODE``: ``auto`` takes systemd where it runs; ``systemd``
    where it does not raises ``ValueError`` with ``found.why``."""
    if mode not in SUPERVISORS:
        raise ValueError(f"--supervisor is one of {', '.join(SUPERVISORS)}, not {mode!r}")
    if mode == "builtin" or (mode == "auto" and not found.runs):
        return "builtin"
    if not found.runs:
        raise ValueError(f"systemd user units cannot be used: {found.why}")
    return "systemd"


def is_secret(name: str, value: str) -> bool:
    """A variable that must not be written into a unit: its name says secret, or its value is a URL with a
    password."""
    return bool(_SECRET_NAME.search(name.upper()) or _URL_WITH_PASSWORD.match(value))


def unit_environment(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret): the variables of ``env`` a unit gets (see the module doc), split by ``is_secret``."""
    kept = {k: v for k, v in env.items() if k.startswith(("GPUORCH_", "OTEL_")) or k in PASSED_ON}
    secret = {k: v for k, v in kept.items() if is_secret(k, v)}
    return {k: v for k, v in kept.items() if k not in secret}, secret


def _quoted(value: str, *, where: str) -> str:
    """``value`` in double quotes for ``where``: ``exec`` (``ExecStart=``: systemd expands ``%`` specifiers and
    ``$`` variables there, both escaped), ``environment`` (``Environment=``: ``%`` only) or ``file`` (an
    ``EnvironmentFile=``: nothing); no line break may occur in any."""
    if "\n" in value or "\r" in value:
        raise ValueError(f"a unit cannot carry a value with a line break: {value[:40]!r}")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    if where == "exec":
        return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'
    if where == "environment":
        return '"' + escaped.replace("%", "%%") + '"'
    return '"' + escaped + '"'  # an EnvironmentFile expands nothing: $ and ` stay as they are


def render_unit(*, name: str, argv: list[str], env: Mapping[str, str], env_file: Path, log_path: Path,
                working_dir: Path, target: str, version: int, keep_children: bool = False) -> str:
    """The text of one service's unit (see the module doc); ``env`` holds only plain variables (the secret ones
    are in ``env_file``); ``keep_children``: ``KillMode=process``."""
    lines = ["[Unit]", f"Description=gpuorch {name} (gpuctl up, {working_dir})", f"PartOf={target}",
             "StartLimitIntervalSec=0", "", "[Service]", "Type=exec", f"WorkingDirectory={working_dir}"]
    lines += [f"Environment={_quoted(f'{k}={v}', where='environment')}" for k, v in sorted(env.items())]
    lines += [f"EnvironmentFile={env_file}",
              "ExecStart=" + " ".join(_quoted(arg, where="exec") for arg in argv),
              "Restart=on-failure", "RestartSec=1"]
    if version >= STEPS_VERSION:
        lines += ["RestartSteps=5", "RestartMaxDelaySec=30"]
    lines += ["TimeoutStopSec=15", f"StandardOutput=append:{log_path}", "StandardError=inherit"]
    if keep_children:
        lines.append("KillMode=process")
    return "\n".join(lines) + "\n"


def render_target(*, units: list[str], working_dir: Path) -> str:
    """The stack's target: it wants every service unit, each of which is ``PartOf`` it (stopping it stops them)."""
    return "\n".join(["[Unit]", f"Description=gpuorch stack of gpuctl up ({working_dir})",
                      *(f"Wants={unit}" for unit in units)]) + "\n"


def render_env_file(env: Mapping[str, str]) -> str:
    """An ``EnvironmentFile=``'s text: one ``NAME="value"`` a line."""
    return "".join(f"{k}={_quoted(v, where='file')}\n" for k, v in sorted(env.items()))


def stack_tag(root: Path) -> str:
    """8 hex digits naming the stack at ``root`` in its units' names."""
    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:8]


@dataclass
class StackUnits:
    """The units of the stack at ``root``, in ``unit_dir`` (``$XDG_RUNTIME_DIR/systemd/user``)."""

    root: Path
    unit_dir: Path
    version: int
    services: dict[str, str] = field(default_factory=dict)
    """Service name -> its unit, for the units written so far, in start order."""

    @property
    def target(self) -> str:
        return f"gpuorch-{stack_tag(self.root)}.target"

    def unit_name(self, service: str) -> str:
        return f"gpuorch-{stack_tag(self.root)}-{service}.service"

    @staticmethod
    def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``systemctl --user ARGS``; ``RuntimeError`` with its stderr when it fails and ``check``."""
        found = shutil.which("systemctl")
        if found is None:
            raise RuntimeError("systemctl is not on PATH")
        done = subprocess.run([found, "--user", *args], capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"systemctl --user {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-500:]}")
        return done

    def write_service(self, service: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> str:
        """Write ``service``'s unit and its 0600 environment file, and the target naming every unit so far;
        returns the unit's name (not started: ``start``)."""
        plain, secret = unit_environment(env)
        secrets_dir = self.root / "systemd"
        secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        env_file = secrets_dir / f"{service}.env"
        descriptor = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # an older file of looser mode
        with os.fdopen(descriptor, "w") as out:
            out.write(render_env_file(secret))
        name = self.unit_name(service)
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        (self.unit_dir / name).write_text(render_unit(
            name=service, argv=argv, env=plain, env_file=env_file, log_path=log_path, working_dir=self.root,
            target=self.target, version=self.version, keep_children=service == "executor"))
        self.services[service] = name
        (self.unit_dir / self.target).write_text(render_target(units=list(self.services.values()),
                                                               working_dir=self.root))
        return name

    def start(self, unit: str) -> int:
        """Load the unit files and start ``unit``; returns its main pid (0: none yet)."""
        self.systemctl("daemon-reload")
        self.systemctl("start", unit)
        return self.main_pid(unit)

    @classmethod
    def main_pid(cls, unit: str) -> int:
        """The unit's main process (0: not running, or systemctl did not answer)."""
        try:
            answer = cls.systemctl("show", "-p", "MainPID", "--value", unit, check=False).stdout.strip()
        except (RuntimeError, OSError, subprocess.SubprocessError):
            return 0
        return int(answer) if answer.isdigit() else 0

    def record(self) -> dict[str, object]:
        """What ``remove`` (and ``LocalStack.running_recorded``) need later, for the stack's record."""
        return {"unit_dir": str(self.unit_dir), "target": self.target, "services": dict(self.services)}

    @staticmethod
    def remove(recorded: Mapping[str, object]) -> list[str]:
        """Stop a recorded stack's target and units, delete their files and reload; returns the units that were
        active. A systemctl that fails is not fatal here: the caller still stops the stack's processes by pid."""
        services = recorded.get("services") or {}
        units = [str(u) for u in services.values()] if isinstance(services, dict) else []
        target = str(recorded.get("target", ""))
        active = [u for u in units if StackUnits.main_pid(u)]
        for args in (["stop", target, *units], ["reset-failed", target, *units]):
            try:
                StackUnits.systemctl(*args, check=False)
            except (RuntimeError, OSError, subprocess.SubprocessError):
                pass
        unit_dir = Path(str(recorded.get("unit_dir", "")))
        for name in [*units, target]:
            if name.startswith("gpuorch-") and unit_dir.name == "user":  # never a path the record was edited to
                (unit_dir / name).unlink(missing_ok=True)
        try:
            StackUnits.systemctl("daemon-reload", check=False)
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass
        return active
