"""Which commands and images each tenant may run on this node.

Format (``GPUORCH_EXECUTOR_ALLOW``: inline JSON, or the path of a JSON file)::

    {"tenants": {
        "default":  {"commands": ["python", "python3"]},
        "research": {"commands": ["python3", "/opt/train/bin/train"],
                     "images": ["ghcr.io/acme/trainer", "registry.local:5000/team/"],
                     "mounts": [{"source": "/data/datasets", "target": "/datasets", "read_only": true}]},
        "ops":      {"commands": ["bash"], "allow_shell": true},
        "*":        {"commands": []}
    }}

Rules:
- ``commands``: an entry without ``/`` allows that bare name only when ``argv[0]`` is the same bare name; it is
  resolved on the *executor's* PATH (never the job's ``PATH``, which the tenant controls). An entry with ``/``
  allows exactly that absolute path (after resolving symlinks on both sides).
- ``argv`` is an array and runs without a shell. A shell given a command string (``sh -c``, ``bash -lc`` ... any
  shell with a short option containing ``c``, or ``--command``) is refused unless the tenant has
  ``"allow_shell": true``; ``argv[0]`` containing whitespace is refused as a shell string in disguise.
- ``images``: an entry ending in ``/`` allows every repository under that prefix; otherwise the repository must be
  equal (the image itself must be pinned ``repo@sha256:<digest>``, which the contract enforces; a tag next to the
  digest is ignored for matching).
- ``mounts``: the only host paths a tenant's containers get (read-only unless said otherwise); a few host paths are
  never allowed (``/``, ``/etc``, ``/proc``, ``/sys``, ``/dev``, ``/root``, ``/var/run/docker.sock`` ...).
- A tenant not listed falls back to ``"*"``; without ``"*"`` it is refused.
- Default when the variable is unset: tenant ``default`` may run ``python`` and ``python3``; nothing else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuorch_contracts import ContainerRun, ProcessRun

SHELLS: frozenset[str] = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "csh", "tcsh", "ash",
                                    "busybox"})
_SHELL_COMMAND_FLAG = re.compile(r"^-[A-Za-z]*c[A-Za-z]*$")
FORBIDDEN_MOUNT_SOURCES: frozenset[str] = frozenset({
    "/", "/etc", "/proc", "/sys", "/dev", "/root", "/boot", "/var/run", "/run", "/var/run/docker.sock",
    "/run/docker.sock", "/var/lib/docker", "/usr", "/bin", "/sbin", "/lib", "/home",
})


class AllowListError(ValueError):
    """The allow-list configuration itself is malformed."""


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class TenantPolicy:
    commands: frozenset[str] = frozenset()
    images: tuple[str, ...] = ()
    allow_shell: bool = False
    mounts: tuple[Mount, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why a launch is not allowed, in words meant for the job's owner."""

    reason: str


@dataclass(frozen=True)
class AllowList:
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)

    def policy_for(self, tenant: str) -> TenantPolicy | None:
        return self.tenants.get(tenant) or self.tenants.get("*")

    def check_process(self, tenant: str, run: ProcessRun, resolved_executable: str | None) -> Refusal | None:
        """Refusal for ``run`` by ``tenant``, or ``None`` when it may run.

        ``resolved_executable`` is ``argv[0]`` resolved on the executor's PATH (``None`` if it was not found);
        the caller resolves it so this stays free of I/O.
        """
        policy = self.policy_for(tenant)
        if policy is None:
            return Refusal(f"tenant {tenant!r} may not run anything on this node")
        argv0 = run.argv[0]
        if not argv0 or any(ch.isspace() for ch in argv0):
            return Refusal(f"argv[0] {argv0!r} looks like a shell string; give an argv array")
        name = os.path.basename(argv0)
        if name in SHELLS and not policy.allow_shell and any(
            _SHELL_COMMAND_FLAG.match(arg) or arg == "--command" for arg in run.argv[1:]
        ):
            return Refusal(f"{name} with a command string is a shell string; give an argv array instead")
        if "/" not in argv0:
            if argv0 in policy.commands:
                return None
        elif resolved_executable is not None:
            allowed_paths = {os.path.realpath(entry) for entry in policy.commands if "/" in entry}
            if os.path.realpath(resolved_executable) in allowed_paths:
                return None
        return Refusal(f"command {argv0!r} is not allowed for tenant {tenant!r}")

    def check_container(self, tenant: str, run: ContainerRun) -> Refusal | None:
        """Refusal for ``run`` by ``tenant``, or ``None`` when its image repository is allowed."""
        policy = self.policy_for(tenant)
        if policy is None:
            return Refusal(f"tenant {tenant!r} may not run anything on this node")
        repository = image_repository(run.image)
        for entry in policy.images:
            if repository == entry or (entry.endswith("/") and repository.startswith(entry)):
                return None
        return Refusal(f"image repository {repository!r} is not allowed for tenant {tenant!r}")

    def mounts_for(self, tenant: str) -> tuple[Mount, ...]:
        policy = self.policy_for(tenant)
        return policy.mounts if policy is not None else ()


def image_repository(image: str) -> str:
    """``registry:5000/team/app:tag@sha256:...`` -> ``registry:5000/team/app``."""
    name = image.split("@", 1)[0]
    last_slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > last_slash:
        name = name[:colon]
    return name


DEFAULT_ALLOW_LIST = AllowList({"default": TenantPolicy(commands=frozenset({"python", "python3"}))})


def parse_allow_list(document: Mapping[str, Any]) -> AllowList:
    """Build an ``AllowList`` from the JSON document described in this module's docstring."""
    tenants_raw = document.get("tenants")
    if not isinstance(tenants_raw, Mapping):
        raise AllowListError('the allow-list needs an object "tenants": {tenant: {...}}')
    tenants: dict[str, TenantPolicy] = {}
    for tenant, raw in tenants_raw.items():
        if not isinstance(raw, Mapping):
            raise AllowListError(f"tenant {tenant!r}: expected an object")
        unknown = set(raw) - {"commands", "images", "allow_shell", "mounts"}
        if unknown:
            raise AllowListError(f"tenant {tenant!r}: unknown keys {sorted(unknown)}")
        commands = raw.get("commands", [])
        images = raw.get("images", [])
        if not all(isinstance(c, str) and c for c in commands) or not all(isinstance(i, str) and i for i in images):
            raise AllowListError(f"tenant {tenant!r}: commands and images must be lists of non-empty strings")
        for command in commands:
            if "/" in command and not command.startswith("/"):
                raise AllowListError(f"tenant {tenant!r}: command {command!r} must be a bare name or absolute")
        mounts = tuple(_parse_mount(tenant, m) for m in raw.get("mounts", []))
        tenants[str(tenant)] = TenantPolicy(
            commands=frozenset(commands), images=tuple(images), allow_shell=bool(raw.get("allow_shell", False)),
            mounts=mounts,
        )
    return AllowList(tenants)


def _parse_mount(tenant: str, raw: Any) -> Mount:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("source"), str) or not isinstance(
        raw.get("target"), str
    ):
        raise AllowListError(f"tenant {tenant!r}: a mount needs string 'source' and 'target'")
    source = os.path.normpath(raw["source"])
    target = os.path.normpath(raw["target"])
    for path in (source, target):
        if not path.startswith("/") or ".." in Path(path).parts or "," in path or ":" in path:
            raise AllowListError(f"tenant {tenant!r}: mount path {path!r} must be absolute, plain and normalised")
    if source in FORBIDDEN_MOUNT_SOURCES:
        raise AllowListError(f"tenant {tenant!r}: host path {source!r} may never be mounted")
    return Mount(source=source, target=target, read_only=bool(raw.get("read_only", True)))


def load_allow_list(value: str | None) -> AllowList:
    """``GPUORCH_EXECUTOR_ALLOW``: unset -> the default; ``{...}`` -> inline JSON; anything else -> a JSON file."""
    if value is None or not value.strip():
        return DEFAULT_ALLOW_LIST
    text = value if value.lstrip().startswith("{") else Path(value).read_text()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AllowListError(f"the allow-list is not valid JSON: {exc}") from exc
    if not isinstance(document, Mapping):
        raise AllowListError("the allow-list must be a JSON object")
    return parse_allow_list(document)
