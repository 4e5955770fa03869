"""Durable per-node state directory: one JSON record per placement, plus what each job's supervisor writes.

Layout (``GPUORCH_EXECUTOR_STATE_DIR``/<node_id>)::

    placements/<placement_id>/record.json    the executor's PlacementRecord (atomic rewrite on every change)
    placements/<placement_id>/launch.json    what the supervisor runs (argv, env, cwd, log path, cgroup)
    placements/<placement_id>/started.json   written by the supervisor when the job runs (job pid)
    placements/<placement_id>/exit.json      written by the supervisor when the job ended (exit code / signal)
    placements/<placement_id>/checkpoint/    the job confirms a checkpoint by creating ``confirmed`` in here
    placements/<placement_id>/home/          the job's HOME, TMPDIR and default working directory
    placements/<placement_id>/supervisor.log the supervisor's own stderr (empty unless it crashed)
    logs/<job_id>/<placement_id>.log         the job's stdout and stderr, interleaved (JobStarted.log_path)
    logs/<job_id>/<placement_id>.log.idx     when the log grew (``log_times``: the watch's index of line times)

Permissions (jobs run as other uids, see ``domain.job_users``): directories are ``0711`` (a job can reach its
own checkpoint and home directories, and list nothing); every file the executor or a supervisor writes is
``0600``; a job's ``checkpoint/`` and ``home/`` are ``0700`` and owned by that job's uid; its log is ``0640``
with the job's gid. So a job reads neither the executor's records, lease and lock, nor another job's files.

Every JSON file is written with ``write_json_atomically`` (temporary file, rename; plus fsyncs of file and
directory for the writes that must survive a power cut: a record becoming known, running or ended, and the
supervisor's ``exit.json``), so a crash leaves either the previous or the new version, never half a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any

from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.supervise import write_json_atomically

CHECKPOINT_FILE_NAME = "confirmed"
TRAVERSE_ONLY = 0o711
"""Directories on the way to a job's own files: others may pass through them, never list them."""


class StateDirectoryInUse(RuntimeError):
    """Another executor process holds this node's state directory."""


class PlacementStore:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.placements_dir = state_dir / "placements"
        self.logs_dir = state_dir / "logs"
        for directory in (self.placements_dir, self.logs_dir):
            directory.mkdir(parents=True, exist_ok=True)
        for directory in (self.state_dir, self.placements_dir, self.logs_dir):
            directory.chmod(TRAVERSE_ONLY)

    def lock(self) -> int:
        """Take this node's state directory for this process (an flock, released even by SIGKILL).

        Two executors adopting and reporting the same placements would break "exactly one outcome"; the second
        one fails here instead. Returns the descriptor to keep open.
        """
        fd = os.open(self.state_dir / "executor.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirectoryInUse(f"another executor holds {self.state_dir}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return fd

    @property
    def lease_path(self) -> Path:
        """The executor's lease as its supervisors read it (see ``supervise``)."""
        return self.state_dir / "lease.json"

    def write_lease(self, renewed_monotonic: float, deadline_s: float, grace_s: float) -> None:
        write_json_atomically(self.lease_path, {"renewed_monotonic": renewed_monotonic,
                                                "fencing_deadline_s": deadline_s, "fencing_grace_s": grace_s},
                              durable=False)

    def read_lease_renewed(self) -> float | None:
        """The monotonic time of the last renewal a previous executor confirmed, if it left one."""
        try:
            return float(json.loads(self.lease_path.read_text())["renewed_monotonic"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def leader_epoch_path(self) -> Path:
        """The newest scheduler leader epoch this node's commands carried (``gpuorch_contracts.leader_epoch``)."""
        return self.state_dir / "leader_epoch.json"

    def write_leader_epoch(self, epoch: int) -> None:
        write_json_atomically(self.leader_epoch_path, {"newest_seen": epoch})

    def read_leader_epoch(self) -> int:
        """The newest epoch an earlier executor of this node saw (0 if none was recorded)."""
        try:
            return int(json.loads(self.leader_epoch_path.read_text())["newest_seen"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def placement_dir(self, placement_id: uuid.UUID) -> Path:
        return self.placements_dir / str(placement_id)

    def log_path(self, job_id: uuid.UUID, placement_id: uuid.UUID) -> Path:
        return self.logs_dir / str(job_id) / f"{placement_id}.log"

    def checkpoint_file(self, placement_id: uuid.UUID) -> Path:
        return self.placement_dir(placement_id) / "checkpoint" / CHECKPOINT_FILE_NAME

    def home_dir(self, placement_id: uuid.UUID) -> Path:
        return self.placement_dir(placement_id) / "home"

    def prepare(self, record: PlacementRecord, owner_uid: int | None = None) -> None:
        """Create the placement's directories (idempotent); ``owner_uid`` (the job's) owns its checkpoint and
        home directories (``0700``); without one they are the executor's own."""
        placement_dir = self.placement_dir(record.placement_id)
        log_dir = self.log_path(record.job_id, record.placement_id).parent
        for directory in (placement_dir, log_dir):
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(TRAVERSE_ONLY)
        for directory in (self.checkpoint_file(record.placement_id).parent, self.home_dir(record.placement_id)):
            directory.mkdir(exist_ok=True)
            directory.chmod(0o700)
            if owner_uid is not None:
                os.chown(directory, owner_uid, owner_uid)

    def save(self, record: PlacementRecord, *, durable: bool = True) -> None:
        """Rewrite the record atomically; ``durable=False`` skips the fsyncs for facts a power cut makes moot
        (pids of processes that a power cut kills anyway, an outbox entry already confirmed: at worst it is
        published again with the same message id)."""
        self.placement_dir(record.placement_id).mkdir(parents=True, exist_ok=True)
        write_json_atomically(self.placement_dir(record.placement_id) / "record.json", record.model_dump(mode="json"),
                              durable=durable)

    def load(self, placement_id: uuid.UUID) -> PlacementRecord | None:
        path = self.placement_dir(placement_id) / "record.json"
        if not path.exists():
            return None
        return PlacementRecord.model_validate_json(path.read_text())

    def load_all(self) -> list[PlacementRecord]:
        records = []
        for path in sorted(self.placements_dir.glob("*/record.json")):
            records.append(PlacementRecord.model_validate_json(path.read_text()))
        return records

    def write_launch(self, placement_id: uuid.UUID, launch: dict[str, Any]) -> Path:
        path = self.placement_dir(placement_id) / "launch.json"
        write_json_atomically(path, launch, durable=False)  # read by the supervisor at once; moot after a power cut
        return path

    def read_launch(self, placement_id: uuid.UUID) -> dict[str, Any] | None:
        """What the placement's supervisor ran (argv, env, cwd, cgroups, user): ``gpuctl exec`` enters the same."""
        return _read_json(self.placement_dir(placement_id) / "launch.json")

    def read_started(self, placement_id: uuid.UUID) -> dict[str, Any] | None:
        return _read_json(self.placement_dir(placement_id) / "started.json")

    def read_exit(self, placement_id: uuid.UUID) -> dict[str, Any] | None:
        return _read_json(self.placement_dir(placement_id) / "exit.json")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


def read_tail(path: Path | str | None, max_bytes: int = 16384) -> str:
    """The last ``max_bytes`` of a log file as text ('' when absent)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
