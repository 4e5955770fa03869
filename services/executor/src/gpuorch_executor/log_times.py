"""When each part of a job's log was written: a sidecar index next to the log, the raw log left as the job wrote it.

    <job_id>/<placement_id>.log       the job's stdout and stderr, written by the job itself (``supervise``)
    <job_id>/<placement_id>.log.idx   ``<size> <unix time>`` lines, appended by the executor's watch: the log had
                                      grown to ``size`` bytes by ``time`` (sizes and times only increase)

The job writes its log through an inherited descriptor, so nobody sees its lines as they are written; the watch
(``watch.PlacementWatch.tick``, every ``GPUORCH_EXECUTOR_POLL_S``) stats each active placement's log and appends
an entry when it grew and ``RESOLUTION_S`` passed since the last one (and once more when the placement ends). So a
byte's time is the first entry that covers it: at most ``RESOLUTION_S`` + one poll after it was written, never
before. Bytes written while no executor ran get the time the next one saw them (later, never earlier).

Readers (``logs_http``): ``start_offset(entries, since)`` is the start of the first line that may have been written
at or after ``since`` (a line is never cut; a line of doubtful time is included), ``time_at(entries, end)`` the time
of a line ending at ``end``. A log without an index (written before it existed) has no times: everything is
"unknown", so ``since`` serves it whole.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from pathlib import Path

SUFFIX = ".idx"
RESOLUTION_S = 1.0
"""At most one entry per log per this many seconds (about 2 MB a day for a log that never stops growing)."""
LINE_SEARCH = 64 * 1024
"""How far back ``start_offset`` looks for the start of a line."""


def index_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + SUFFIX)


class LogTimes:
    """The writer: ``note(log_path, now)`` per watch tick of an active placement (idempotent, cheap: one stat)."""

    def __init__(self) -> None:
        self._last: dict[Path, tuple[int, float]] = {}  # log -> (size, time) of its last entry

    def note(self, log_path: Path, now: float, *, final: bool = False) -> None:
        """Append ``<size> <now>`` when the log grew (and ``RESOLUTION_S`` passed, unless ``final``)."""
        try:
            size = log_path.stat().st_size
        except OSError:
            return
        last = self._last.get(log_path)
        if last is None:
            entries = read_index(log_path)
            last = entries[-1] if entries else (0, 0.0)
        if size > last[0] and (final or now - last[1] >= RESOLUTION_S):
            with contextlib.suppress(OSError), open(
                    os.open(index_path(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as handle:
                handle.write(f"{size} {now:.3f}\n")
            last = (size, now)
        if final:
            self._last.pop(log_path, None)
        else:
            self._last[log_path] = last


def read_index(log_path: Path) -> list[tuple[int, float]]:
    """The entries of the log's index, oldest first ([] when it has none; a torn last line is skipped)."""
    try:
        text = index_path(log_path).read_text()
    except OSError:
        return []
    entries = []
    for line in text.splitlines():
        size, _, when = line.partition(" ")
        with contextlib.suppress(ValueError):
            entries.append((int(size), float(when)))
    return entries


def time_at(entries: list[tuple[int, float]], end: int) -> float | None:
    """When the log first held ``end`` bytes (the time of a line ending there); None: not indexed yet."""
    found = bisect.bisect_left(entries, end, key=lambda entry: entry[0])
    return entries[found][1] if found < len(entries) else None


def start_offset(log_path: Path, entries: list[tuple[int, float]], since: float) -> int:
    """Where to start so that every line written at or after ``since`` is served: the start of the line holding
    the first byte the log did not hold before ``since``."""
    before = [size for size, when in entries if when < since]
    offset = before[-1] if before else 0
    if offset == 0:
        return 0
    with log_path.open("rb") as handle:
        floor = max(0, offset - LINE_SEARCH)
        handle.seek(floor)
        head = handle.read(offset - floor)
    newline = head.rfind(b"\n")
    return floor + newline + 1 if newline >= 0 else floor
