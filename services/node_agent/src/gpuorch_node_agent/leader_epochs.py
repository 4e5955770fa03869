"""The newest scheduler leader epoch each node's commands carried, kept across node-agent restarts.

Layout (``GPUORCH_NODE_AGENT_STATE_DIR``, a root; each node of this process uses its own directory)::

    <root>/<node_id>/leader_epoch.json    {"newest_seen": <epoch>}

Contract (``gpuorch_contracts.leader_epoch``, the executor's ``PlacementStore.write_leader_epoch`` idiom):
- ``newest_seen(node_id)`` is the newest epoch any earlier or current node-agent of that node recorded (0 if none,
  or if the file is unreadable: a sender without epochs is admitted either way); read once per node, then cached.
- ``record(node_id, epoch)`` writes the file before it returns (temporary file, fsync, rename, fsync of the
  directory), so a crash or a power cut leaves the previous or the new epoch, never half a file; an ``OSError`` is
  raised to the caller, which must then not act on the command (it is redelivered and judged again).
- Epochs only grow here: recording one that is not newer than the cached one writes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_NAME = "leader_epoch.json"


class LeaderEpochStore:
    def __init__(self, state_root: Path) -> None:
        self.state_root = state_root
        self._newest: dict[str, int] = {}

    def path(self, node_id: str) -> Path:
        return self.state_root / node_id / FILE_NAME

    def newest_seen(self, node_id: str) -> int:
        """The newest epoch recorded for ``node_id`` (see the module)."""
        if node_id not in self._newest:
            try:
                self._newest[node_id] = int(json.loads(self.path(node_id).read_text())["newest_seen"])
            except (OSError, ValueError, KeyError, TypeError):
                self._newest[node_id] = 0
        return self._newest[node_id]

    def record(self, node_id: str, epoch: int) -> None:
        """Make ``epoch`` the newest seen for ``node_id``, durably, if it is newer (see the module)."""
        if epoch <= self.newest_seen(node_id):
            return
        path = self.path(node_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as handle:
            json.dump({"newest_seen": epoch}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._newest[node_id] = epoch
