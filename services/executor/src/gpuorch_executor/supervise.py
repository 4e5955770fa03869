"""Per-job supervisor: ``python -m gpuorch_executor.supervise <placement_dir>``.

Why it exists: the exit status of a process can only be collected by its parent. If the executor were the parent
and got SIGKILLed, a job ending while it is down would leave no exit code anywhere. So the executor starts this
small supervisor in its own session; the supervisor is the job's parent, outlives any executor crash, and writes
what happened to files that the executor (the current one, or the next one after a restart) reads:

- ``launch.json`` (input, written by the executor): ``argv``, ``executable``, ``env``, ``cwd``, ``log_path``,
  ``cgroup`` (the job's main cgroup: v2, or v1 ``memory``; or null), ``joined_cgroups`` (more cgroups to join: the
  v1 ``cpu`` one), ``device_cgroup`` (its device-confining cgroup, or null), ``user`` (``{"uid", "gid"}``: the job's own unprivileged user, or null: the supervisor's),
  and ``fence`` (or null): ``lease_path``, ``signal`` (the job's checkpoint signal), ``container``
  (``{"docker", "name"}`` for the container runtime);
- ``started.json``: ``{"job_pid", "supervisor_pid", "started_at", "started_monotonic"}`` once the job runs
  (``started_monotonic`` is ``time.monotonic()``, the host-wide clock deadlines are measured on);
- ``exit.json``: ``{"exit_code", "signal", "launch_error", "started_at", "finished_at", "duration_s",
  "oom_kills", "fenced"}`` once the job ended (or could not start).

The supervisor's own fence: the executor writes its lease (``lease.json``: the monotonic time of its last confirmed
renewal, its fencing deadline and grace) after every confirmed renewal. While the job runs, the supervisor reads it
every ``LEASE_CHECK_S``; once the lease has gone unrenewed for ``deadline - grace`` it sends the job its checkpoint
signal, and at ``renewed + deadline`` SIGKILL (``fenced: true`` in ``exit.json``). So the job stops by the deadline
even when the executor itself is dead (SIGKILLed, crash-looping), and the scheduler may requeue it after the
deadline without the job running twice. A missing or unreadable lease file changes nothing (an older executor).

The job's user: with ``user`` set, the child joins its cgroups while still privileged, then drops every
supplementary group, sets its gid and uid (in that order: after ``setuid`` it could not change groups) and a
``077`` umask, and only then enters ``cwd``: a directory the job's user cannot reach is refused, never entered
with the supervisor's rights. The log file is opened by the supervisor (owner: the executor's user, group: the
job's gid, mode 0640), so the job writes it through the inherited descriptor, may read its own log, and no
other job can read it.

Both output files are written atomically (temporary file, fsync, rename, fsync of the directory): a reader sees a
whole file or none. The job runs in its own process group (``pgid == job pid``) so the executor can signal the
job and its children without touching the supervisor. Standard library only, to start fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, data: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part.

    ``durable`` also fsyncs the file and its directory, so that this holds after a power cut too; without it the
    write survives any process crash (the page cache outlives processes) but maybe not a power cut.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as handle:
        json.dump(data, handle)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _oom_kills(cgroup: str | None) -> int:
    """``oom_kill`` of the job's cgroup: ``memory.events`` (v2) or ``memory.oom_control`` (v1)."""
    if not cgroup:
        return 0
    for name in ("memory.events", "memory.oom_control"):
        try:
            for line in Path(cgroup, name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return 0


def _release_cgroup(cgroup: str | None) -> None:
    if not cgroup or not os.path.isdir(cgroup):
        return
    try:
        Path(cgroup, "cgroup.kill").write_text("1")  # leftovers of the job that escaped its process group
    except OSError:
        pass
    for _ in range(25):  # the kernel frees a cgroup once its last process is reaped
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            time.sleep(0.02)


LEASE_CHECK_S = 0.5


class LeaseWatch:
    """The supervisor's view of the executor's lease (see the module docstring). ``check`` returns the signal to
    send the job now (the fence's checkpoint signal once, then SIGKILL once), or None."""

    def __init__(self, fence: dict[str, Any] | None) -> None:
        self.fence = fence or {}
        self.signalled = False
        self.killed = False
        self.acted = False
        """Whether the fence signalled the job at all (``fenced`` in ``exit.json``)."""

    def _lease(self) -> tuple[float, float, float] | None:
        path = self.fence.get("lease_path")
        if not path:
            return None
        try:
            lease = json.loads(Path(path).read_text())
            return float(lease["renewed_monotonic"]), float(lease["fencing_deadline_s"]), \
                float(lease["fencing_grace_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def check(self, now_monotonic: float) -> int | None:
        lease = self._lease()
        if lease is None or self.killed:
            return None
        renewed, deadline, grace = lease
        if now_monotonic >= renewed + deadline:
            self.killed = self.acted = True
            return signal.SIGKILL
        if now_monotonic >= renewed + deadline - grace and not self.signalled:
            self.signalled = self.acted = True
            return signal.Signals[self.fence.get("signal") or "SIGTERM"]
        if now_monotonic < renewed + deadline - grace:
            self.signalled = False  # renewed again: a later lapse signals again
        return None

    def send(self, job_pid: int, signum: int) -> None:
        container = self.fence.get("container")
        if container:
            try:
                subprocess.run([container["docker"], "kill", f"--signal={signal.Signals(signum).name}",
                                container["name"]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10, check=False)
            except (OSError, subprocess.SubprocessError):
                pass
            if signum != signal.SIGKILL:
                return
        try:
            os.killpg(job_pid, signum)
        except ProcessLookupError:
            pass


def enter_sandbox(launch: dict[str, Any]) -> None:
    """In a child before it execs, with the executor's rights: join the job's cgroups (``cgroup``,
    ``joined_cgroups``, ``device_cgroup`` of its ``launch.json``), then become its user (no supplementary group,
    its gid, its uid, umask 077) and enter its ``cwd``. The job's own process and ``gpuctl exec`` of it both."""
    for directory in dict.fromkeys((launch.get("cgroup"), *(launch.get("joined_cgroups") or []),
                                    launch.get("device_cgroup"))):
        if directory:
            with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
    user = launch.get("user")
    if user is not None:
        os.setgroups([])
        os.setgid(int(user["gid"]))
        os.setuid(int(user["uid"]))
        os.umask(0o077)
        if launch.get("cwd"):
            os.chdir(launch["cwd"])


def supervise(placement_dir: Path) -> int:
    launch = json.loads((placement_dir / "launch.json").read_text())
    cgroup: str | None = launch.get("cgroup")
    device_cgroup: str | None = launch.get("device_cgroup")
    joined: list[str] = list(launch.get("joined_cgroups") or [])
    user: dict[str, int] | None = launch.get("user")
    cwd: str | None = launch.get("cwd")
    started_at = time.time()
    started_mono = time.monotonic()

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    # The supervisor lives as long as its job: a stray SIGTERM/SIGINT/SIGHUP (a service manager stopping the
    # executor's whole group, a closed terminal) must not orphan the job and lose its exit status. The job itself
    # gets default dispositions back before exec.
    for stray in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stray, signal.SIG_IGN)

    def prepare_child() -> None:
        for stray in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stray, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        enter_sandbox(launch)

    log_fd = os.open(launch["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640 if user else 0o600)
    try:
        if user is not None:
            os.fchown(log_fd, -1, int(user["gid"]))
            os.fchmod(log_fd, 0o640)
        child = subprocess.Popen(
            launch["argv"], executable=launch.get("executable"), env=launch["env"],
            cwd=None if user is not None else cwd,
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT, process_group=0,
            preexec_fn=prepare_child, close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        now = time.time()
        write_json_atomically(placement_dir / "exit.json", {
            "exit_code": None, "signal": None, "launch_error": f"{type(exc).__name__}: {exc}"[:900],
            "started_at": started_at, "finished_at": now, "duration_s": 0.0, "oom_kills": 0,
        })
        for directory in (cgroup, *joined, device_cgroup):
            _release_cgroup(directory)
        return 0
    finally:
        os.close(log_fd)

    lease = LeaseWatch(launch.get("fence"))
    write_json_atomically(placement_dir / "started.json", {
        "job_pid": child.pid, "supervisor_pid": os.getpid(), "started_at": started_at,
        "started_monotonic": started_mono,
    })
    while True:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid == child.pid:
            break
        fence_signal = lease.check(time.monotonic())
        if fence_signal is not None:
            lease.send(child.pid, fence_signal)
        signal.sigtimedwait({signal.SIGCHLD}, LEASE_CHECK_S if lease.fence else 5.0)
    code = os.waitstatus_to_exitcode(status)
    oom_kills = _oom_kills(cgroup)
    write_json_atomically(placement_dir / "exit.json", {
        "exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None, "launch_error": None,
        "started_at": started_at, "finished_at": time.time(), "duration_s": time.monotonic() - started_mono,
        "oom_kills": oom_kills, "fenced": lease.acted,
    })
    for directory in (cgroup, *joined, device_cgroup):
        _release_cgroup(directory)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpuorch_executor.supervise <placement_dir>", file=sys.stderr)
        return 2
    return supervise(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
