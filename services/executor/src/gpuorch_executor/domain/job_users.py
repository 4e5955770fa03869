"""The unprivileged users process jobs run as: a pool of numeric uids, one per running job (gid = uid).

Why: a job that runs as the executor's uid can read ``/proc/<executor>/environ`` (the broker URL and its password),
the executor's state directory and credentials, every other job's logs and status files, and signal every other
job. Each job instead gets a uid of its own from ``GPUORCH_EXECUTOR_JOB_UIDS`` (``first-last``, e.g.
``61000-61063``): no two running jobs of this executor share one, the uids need no ``/etc/passwd`` entry, and the
supervisor drops every supplementary group before the job runs (so no job user is ever in the ``docker`` group,
whatever ``/etc/group`` says). The same uid is the container job's ``--user``.

A uid goes back to the pool only when its placement ended, and only after every process still running under it
was killed (``backends.job_users.end_processes_of``): a job's daemonised leftovers never meet the next job.

Pure: no I/O. One pool is shared by all the ``NodeExecutor`` of one process (fleet mode).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIN_JOB_UID = 1000
"""The lowest uid a pool may use: below are system users."""
JOB_UIDS_PATTERN = re.compile(r"^\s*([0-9]+)\s*-\s*([0-9]+)\s*$")


class JobUidsError(ValueError):
    """``GPUORCH_EXECUTOR_JOB_UIDS`` is malformed or unsafe."""


@dataclass
class JobUserPool:
    first: int
    last: int
    in_use: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.first < MIN_JOB_UID or self.last < self.first or self.last >= 2**31 - 1:
            raise JobUidsError(f"job uids {self.first}-{self.last}: need {MIN_JOB_UID} <= first <= last < 2^31-1")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def take(self) -> int | None:
        """The lowest free uid, now in use; ``None`` when every uid of the pool runs a job."""
        for uid in range(self.first, self.last + 1):
            if uid not in self.in_use:
                self.in_use.add(uid)
                return uid
        return None

    def hold(self, uid: int) -> None:
        """Mark ``uid`` in use (an adopted placement's, after a restart)."""
        if uid in self:
            self.in_use.add(uid)

    def give_back(self, uid: int) -> None:
        self.in_use.discard(uid)


def parse_job_uids(value: str, *, forbidden_gids: frozenset[int] = frozenset()) -> JobUserPool | None:
    """``first-last`` -> a pool; ``off`` -> ``None``. ``forbidden_gids`` (the docker group's) may not be in it."""
    if value.strip().lower() == "off":
        return None
    match = JOB_UIDS_PATTERN.match(value)
    if match is None:
        raise JobUidsError(f"GPUORCH_EXECUTOR_JOB_UIDS must be 'first-last' or 'off', got {value!r}")
    pool = JobUserPool(int(match.group(1)), int(match.group(2)))
    clash = sorted(g for g in forbidden_gids if g in pool)
    if clash:
        raise JobUidsError(f"job uids {pool.first}-{pool.last} include gid {clash[0]} of a privileged group "
                           "(docker): each job's gid equals its uid, so pick another range")
    return pool
