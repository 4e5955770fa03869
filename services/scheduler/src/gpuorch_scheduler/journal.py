"""The step journal file (``GPUORCH_STEP_JOURNAL``): what this scheduler was given, one JSON line per entry.

    recovery, heartbeats, each step as it runs ──► entries in memory, in order
    a step's transaction committed            ──► its entry kept; aborted ──► dropped (the state was rebuilt)
    flush                                      ──► every entry before the first unresolved step, appended to the file

``gpuorch_scheduling.journal`` defines the entries and plays them back; this module only writes them. Meant for
debugging and for the equivalence test (a replay through the Harness decides the same events); it costs a JSON
encoding per message while on, nothing when off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuorch_contracts import ExecutorHeartbeat, NodeHeartbeat
from gpuorch_scheduling import journal
from gpuorch_scheduling.step import Input, Known


class _Slot:
    """The place of a step in the journal while its transaction commits (``entry`` None until it did)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: dict[str, Any] | None = None


class JournalFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: list[_Slot] = []
        """Entries not yet written, in order."""

    def _add(self, entry: dict[str, Any]) -> None:
        slot = _Slot()
        slot.entry = entry
        self._entries.append(slot)

    def recovered(self, position: int, lease_now: float) -> None:
        self._add(journal.recovered_entry(position, lease_now))
        self.flush()

    def renewed(self, beat: NodeHeartbeat | ExecutorHeartbeat, lease_now: float) -> None:
        self._add(journal.renewed_entry(beat, lease_now))

    def begin(self) -> _Slot:
        """Hold the place of a step that is about to run."""
        slot = _Slot()
        self._entries.append(slot)
        return slot

    def committed(self, slot: _Slot, inputs: list[Input], now: float, lease_now: float, tick: bool, known: Known,
                  peaks: dict[str, int] | None) -> None:
        slot.entry = journal.step_entry(inputs, now, lease_now, tick, known, peaks)
        self.flush()

    def aborted(self, slot: _Slot) -> None:
        slot.entry = {}
        self.flush()

    def flush(self) -> None:
        ready = 0
        while ready < len(self._entries) and self._entries[ready].entry is not None:
            ready += 1
        if not ready:
            return
        with self.path.open("a", encoding="utf-8") as out:
            for slot in self._entries[:ready]:
                if slot.entry:
                    out.write(json.dumps(slot.entry) + "\n")
        del self._entries[:ready]
