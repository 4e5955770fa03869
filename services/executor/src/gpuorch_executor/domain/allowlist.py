"""Which commands and images each tenant may run on this node.

Format (``GPUORCH_EXECUTOR_ALLOW``: inline JSON, or the path of a JSON file)::

    {"tenants": {
        "default":  {"commands": ["python", "python3"]},
        "research": {"commands": ["python3", "/opt/train/bin/train"], "modules": ["train", "mylab.*"],
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
- ``argv`` is an array and runs without a shell. The whole argv is judged (``domain.command_line``): unless the
  tenant has ``"inline_code": true`` (``"allow_shell"`` is the older name of the same switch), an interpreter must
  run a script file or an allowed module, with only options known to run no code: a command string or code
  option (``sh -c``, ``python -c``, ``node -e``, ``perl -e``/``-M``, ``php -r`` ...), a prompt (``-i``), a program
  read from standard input (``python`` alone, ``python -``, ``bash -s``, ``/dev/stdin``, ``/dev/fd/N``,
  ``/proc/self/fd/N``), an option not on the interpreter's known-harmless list, and programs that run another
  program named in their argv (``env``, ``timeout``, ``xargs``, ``busybox`` ...) are refused. ``argv[0]``
  containing whitespace is refused as a shell string in disguise.
- ``modules``: what ``python -m`` may run (``"pkg"`` exactly, ``"pkg.*"``: the package and everything under it);
  none unless listed. Modules that take code on their own command line (``timeit``, ``pdb``, ``code``,
  ``cProfile``, ``pip`` ... ``CODE_RUNNING_MODULES``) only with ``"inline_code": true``.
- ``images``: an entry ending in ``/`` allows every repository under that prefix; otherwise the repository must be
  equal (the image itself must be pinned ``repo@sha256:<digest>``, which the contract enforces; a tag next to the
  digest is ignored for matching).
- ``network`` (containers): ``"none"`` unless said otherwise; ``"bridge"`` or a named network the tenant may use
  (never ``host``, ``container:...``). ``container_user``: ``"uid:gid"`` for its containers, never root (default:
  the placement's job uid from the pool, or ``65534:65534``).
- ``mounts``: the only host paths a tenant's containers get (read-only unless said otherwise); a few host paths are
  never allowed (``/``, ``/etc``, ``/proc``, ``/sys``, ``/dev``, ``/root``, ``/var/run/docker.sock`` ...).
- A tenant not listed falls back to ``"*"``; without ``"*"`` it is refused.
- Default when the variable is unset: tenant ``default`` may run ``python`` and ``python3`` script files (no
  modules, no inline code); nothing else.
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

from gpuorch_executor.domain.command_line import CommandLine, read_command_line

CODE_RUNNING_MODULES: frozenset[str] = frozenset({
    "timeit", "pdb", "code", "codeop", "runpy", "cProfile", "profile", "trace", "pip", "ensurepip", "IPython",
    "ipykernel", "jupyter", "jupyter_core", "asyncio", "idlelib", "pydoc", "doctest", "unittest", "pickle", "site",
    "venv", "zipapp", "pytest", "_pytest", "ptpython", "bpython", "pudb", "ipdb", "debugpy", "torch.distributed.run",
})
"""Modules whose command line takes code (``-m timeit -s CODE``, ``-m pdb -c CMD``), a prompt or another program to
run: a tenant's ``modules`` may name them only together with ``"inline_code": true``."""
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\.\*)?$")
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
    """Whether interpreters may run code that is not a script file on the node (``domain.command_line``)."""
    modules: frozenset[str] = frozenset()
    """Modules an interpreter may run with ``-m`` (``pkg`` exactly; ``pkg.*``: ``pkg`` and everything under it)."""
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
        if "/" not in argv0:
            allowed = argv0 in policy.commands
        else:
            allowed_paths = {os.path.realpath(entry) for entry in policy.commands if "/" in entry}
            allowed = resolved_executable is not None and os.path.realpath(resolved_executable) in allowed_paths
        if not allowed:
            return Refusal(f"command {argv0!r} is not allowed for tenant {tenant!r}")
        if policy.inline_code:
            return None
        executable = os.path.realpath(resolved_executable) if resolved_executable is not None else None
        return _inline_refusal(tenant, policy, read_command_line(run.argv, run.workdir, executable))

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


def _inline_refusal(tenant: str, policy: TenantPolicy, command: CommandLine) -> Refusal | None:
    """Why ``command`` may not run for a tenant without ``inline_code``: code that is not a script file on the
    node, or a module its entry does not list."""
    if command.inline is not None:
        return Refusal(f"{command.inline}: that is inline code, which tenant {tenant!r} may not run (its allow-list "
                       'entry has no "inline_code": true); give a script file or an allowed module')
    if command.module is not None and _runs_code(command.module):
        return Refusal(f"{command.program} -m {command.module}: that module runs code given on its command line, "
                       f"which tenant {tenant!r} may not run (its allow-list entry has no \"inline_code\": true)")
    if command.module is not None and not module_allowed(policy.modules, command.module):
        listed = ", ".join(sorted(policy.modules)) or "none"
        return Refusal(f"{command.program} -m {command.module}: module {command.module!r} is not in tenant "
                       f"{tenant!r}'s allow-list (modules: {listed}); give a script file")
    return None


def _runs_code(module: str) -> bool:
    return module in CODE_RUNNING_MODULES or module.split(".")[0] in CODE_RUNNING_MODULES


def module_allowed(entries: frozenset[str], module: str) -> bool:
    """``module`` is an entry, or under an entry ``pkg.*`` (``pkg`` itself included)."""
    if module in entries:
        return True
    return any(e.endswith(".*") and (module == e[:-2] or module.startswith(e[:-1])) for e in entries)


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
        unknown = set(raw) - {"commands", "images", "allow_shell", "inline_code", "modules", "mounts", "network",
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
        inline_code = bool(raw.get("inline_code", False) or raw.get("allow_shell", False))
        tenants[str(tenant)] = TenantPolicy(
            commands=frozenset(commands), images=tuple(images), inline_code=inline_code,
            modules=_parse_modules(tenant, raw.get("modules", []), inline_code),
            mounts=mounts, network=network, container_user=container_user,
        )
    return AllowList(tenants)


def _parse_modules(tenant: str, raw: Any, inline_code: bool) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(m, str) and _MODULE_NAME.match(m) for m in raw):
        raise AllowListError(f"tenant {tenant!r}: modules must be a list of module names ('pkg', 'pkg.sub', 'pkg.*')")
    if not inline_code:
        runners = sorted(m for m in raw if _runs_code(m.removesuffix(".*")))
        if runners:
            raise AllowListError(f"tenant {tenant!r}: module {runners[0]!r} runs code given on its command line; "
                                 'list it only with "inline_code": true')
    return frozenset(raw)


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
