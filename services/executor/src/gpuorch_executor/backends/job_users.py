"""What a job uid needs from the host before it is lent again: nothing of the last job left under it.

A uid goes back to the pool only after ``reclaim``: every process still running under it is killed (a daemonised
child escapes its job's process group), its files at the top of the shared temporary directories are removed, its
private home is deleted, and its checkpoint directory and log are handed to the executor's user, so the next job
lent the same uid can read nothing the previous one left (Slurm's epilog cleans up the same way).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import signal
from pathlib import Path

import psutil

SHARED_TMP_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")
KILL_PASSES = 5

PRIVILEGED_GROUPS: tuple[str, ...] = ("docker", "root", "sudo", "wheel", "adm", "disk", "kvm")


def end_processes_of(uid: int) -> int:
    """SIGKILL every process whose real or effective uid is ``uid`` (a job's leftovers); returns how many.

    Passes repeat until one finds nothing (a process forking during a pass is caught by the next)."""
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}")
    killed = 0
    for _ in range(KILL_PASSES):
        found = 0
        for process in psutil.process_iter(["uids"]):
            uids = process.info.get("uids")
            if uids is None or uid not in (uids.real, uids.effective):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
                found += 1
        killed += found
        if not found:
            break
    return killed


def reclaim(uid: int, *, home: Path, checkpoint_dir: Path, log_path: Path | None,
            shared_tmp: tuple[str, ...] = SHARED_TMP_DIRS) -> int:
    """Make ``uid`` fit to lend again (see the module docstring); returns how many processes were killed."""
    killed = end_processes_of(uid)
    for directory in shared_tmp:
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
    shutil.rmtree(home, ignore_errors=True)
    owner = os.getuid(), os.getgid()
    with contextlib.suppress(OSError):
        os.chown(checkpoint_dir, *owner)
    if log_path is not None:
        with contextlib.suppress(OSError):
            os.chown(log_path, *owner)
            os.chmod(log_path, 0o600)
    return killed


def named_uids(uids: range) -> list[int]:
    """The uids of ``uids`` that a host user (``/etc/passwd``, NSS) already has: a pool must own its uids."""
    return sorted(entry.pw_uid for entry in pwd.getpwall() if entry.pw_uid in uids)


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
