"""Which commands and images each tenant may run on this node.

Format (``GPUORCH_EXECUTOR_ALLOW``: inline JSON, or the path of a JSON file)::

    {"tenants": {
        "default":  {"commands": ["python", "python3"]},
        "research": {"commands": ["python3", "/opt/train/bin/train"],
                     "images": ["ghcr.io/acme/trainer", "registry.local:5000/team/"],
                     "mounts": [{"source": "/data/datasets", "target": "/datasets", "read_only": true}]},
        "ops":      {"commands": ["bash"], "inline_code": true},
        "web":      {"images": ["ghcr.io/acme/web"], "network": "bridge", "container_user": "1000:1000"},
        "*":        {"commands": []}
    }}

Rules:
- ``commands``: an entry without ``/`` allows that bare name only when ``argv[0]`` is the same bare name; it is
  resolved on the *executor's* PATH (never the job's ``PATH``, which the tenant controls). An entry with ``/``
  allows exactly that absolute path (after resolving symlinks on both sides).
- ``argv`` is an array and runs without a shell. Inline code is refused unless the tenant has
  ``"inline_code": true`` (``"allow_shell"`` is the older name of the same switch): a shell given a command string
  (``sh -c``, ``bash -lc`` ... any shell with a short option containing ``c``, or ``--command``), and interpreters
  given code on the command line (``python -c`` / ``-Bc``, ``node -e``/``-p``/``--eval``, ``perl -e``/``-E``,
  ``ruby -e``, ``php -r``, ``Rscript -e``, ``julia -e``, ``lua -e``). ``argv[0]`` containing whitespace is refused
  as a shell string in disguise.
- ``images``: an entry ending in ``/`` allows every repository under that prefix; otherwise the repository must be
  equal (the image itself must be pinned ``repo@sha256:<digest>``, which the contract enforces; a tag next to the
  digest is ignored for matching).
- ``network`` (containers): ``"none"`` unless said otherwise; ``"bridge"`` or a named network the tenant may use
  (never ``host``, ``container:...``). ``container_user``: ``"uid:gid"`` for its containers, never root (default:
  the placement's job uid from the pool, or ``65534:65534``).
- ``mounts``: the only host paths a tenant's containers get (read-only unless said otherwise); a few host paths are
  never allowed (``/``, ``/etc``, ``/proc``, ``/sys``, ``/dev``, ``/root``, ``/var/run/docker.sock`` ...).
- A tenant not listed falls back to ``"*"``; without ``"*"`` it is refused.
- Default when the variable is unset: tenant ``default`` may run ``python`` and ``python3`` scripts (no inline
  code); nothing else.
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
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*$")
_PYTHON_CODE_FLAG = re.compile(r"^-[bBdEhiIOqsSuvVxRP]*c")
_PYTHON_VALUE_OPTIONS = frozenset({"-W", "-X"})
INLINE_CODE_FLAGS: dict[str, re.Pattern[str]] = {
    "node": re.compile(r"^(-[A-Za-z]*[ep][A-Za-z]*|--eval(=.*)?|--print(=.*)?)$"),
    "nodejs": re.compile(r"^(-[A-Za-z]*[ep][A-Za-z]*|--eval(=.*)?|--print(=.*)?)$"),
    "deno": re.compile(r"^eval$"),
    "bun": re.compile(r"^(-e|--eval(=.*)?|-p|--print(=.*)?)$"),
    "perl": re.compile(r"^-[A-Za-z]*[eE]"),
    "ruby": re.compile(r"^-[A-Za-z]*e"),
    "php": re.compile(r"^-[A-Za-z]*r"),
    "Rscript": re.compile(r"^(-e|--expr(=.*)?)$"),
    "julia": re.compile(r"^(-[A-Za-z]*[eE]|--eval(=.*)?|--print(=.*)?)$"),
    "lua": re.compile(r"^-[A-Za-z]*e"),
    "luajit": re.compile(r"^-[A-Za-z]*e"),
}
FORBIDDEN_NETWORKS: frozenset[str] = frozenset({"host"})
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
    inline_code: bool = False
    """Whether shells with a command string and interpreters with code on the command line may run."""
    mounts: tuple[Mount, ...] = ()
    network: str = "none"
    """Containers' ``--network``: ``none`` unless the tenant's entry allows one."""
    container_user: str | None = None
    """Containers' ``--user`` (``uid:gid``, never 0); ``None``: the job's pool uid, else ``65534:65534``."""


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
        if not policy.inline_code:
            inline = inline_code_flag(run.argv)
            if inline is not None:
                return Refusal(f"{name} {inline} runs inline code, which tenant {tenant!r} may not run "
                               '(its allow-list entry has no "inline_code": true); give a script or module')
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


def inline_code_flag(argv: list[str] | tuple[str, ...]) -> str | None:
    """The option of ``argv`` that makes its program run code given on the command line, or ``None``.

    Shells: a short option containing ``c`` or ``--command`` anywhere. Python: ``-c`` (alone or ending a cluster of
    flags, ``-Bc``) among the options before the script or ``-m``. Other interpreters: ``INLINE_CODE_FLAGS``.
    """
    name = os.path.basename(argv[0]) if argv else ""
    args = list(argv[1:])
    if name in SHELLS:
        return next((a for a in args if _SHELL_COMMAND_FLAG.match(a) or a == "--command"), None)
    if _PYTHON.match(name):
        skip = False
        for arg in args:
            if skip:
                skip = False
                continue
            if arg in _PYTHON_VALUE_OPTIONS:
                skip = True
                continue
            if arg == "--" or arg == "-m" or not arg.startswith("-") or arg.startswith("-m"):
                return None
            if _PYTHON_CODE_FLAG.match(arg):
                return arg
        return None
    pattern = INLINE_CODE_FLAGS.get(name)
    if pattern is None:
        return None
    return next((a for a in args if pattern.match(a)), None)


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
        unknown = set(raw) - {"commands", "images", "allow_shell", "inline_code", "mounts", "network",
                              "container_user"}
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
        network = raw.get("network", "none")
        if not isinstance(network, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", network) or \
                network in FORBIDDEN_NETWORKS:
            raise AllowListError(f"tenant {tenant!r}: network {network!r} is not allowed (none, bridge or a "
                                 "named network; never host or another container's)")
        container_user = raw.get("container_user")
        if container_user is not None:
            match = re.fullmatch(r"([0-9]+):([0-9]+)", str(container_user))
            if match is None or int(match.group(1)) == 0 or int(match.group(2)) == 0:
                raise AllowListError(f"tenant {tenant!r}: container_user must be 'uid:gid', numeric, never root")
        tenants[str(tenant)] = TenantPolicy(
            commands=frozenset(commands), images=tuple(images),
            inline_code=bool(raw.get("inline_code", False) or raw.get("allow_shell", False)),
            mounts=mounts, network=network, container_user=container_user,
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
