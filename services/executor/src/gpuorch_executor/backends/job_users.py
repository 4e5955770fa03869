"""What a job uid needs from the host: nothing left running under it when it goes back to the pool."""

from __future__ import annotations

import grp
import os
import signal

import psutil

PRIVILEGED_GROUPS: tuple[str, ...] = ("docker", "root", "sudo", "wheel", "adm", "disk", "kvm")


def end_processes_of(uid: int) -> int:
    """SIGKILL every process whose real or effective uid is ``uid`` (a job's leftovers); returns how many."""
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}")
    killed = 0
    for process in psutil.process_iter(["uids"]):
        uids = process.info.get("uids")
        if uids is None or uid not in (uids.real, uids.effective):
            continue
        try:
            os.kill(process.pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def privileged_gids() -> frozenset[int]:
    """The gids of groups a job must never hold (``docker`` first: its socket is root on the host)."""
    gids = set()
    for name in PRIVILEGED_GROUPS:
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            pass
    return frozenset(gids)


def can_switch_users() -> bool:
    """Whether this process may run children as other uids (root, or CAP_SETUID and CAP_SETGID)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return bool(caps & (1 << 7)) and bool(caps & (1 << 6))  # CAP_SETUID, CAP_SETGID
    except OSError:
        pass
    return False
