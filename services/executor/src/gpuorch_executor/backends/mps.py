"""NVIDIA MPS on this node: whether its control daemon runs, so that share jobs can be started as MPS clients.

The operator runs ``nvidia-cuda-mps-control -d`` (with ``CUDA_MPS_PIPE_DIRECTORY`` where it should listen, default
``/tmp/nvidia-mps``) and sets the GPUs to ``EXCLUSIVE_PROCESS`` (docs/sharing.md). The executor never starts, stops
or configures the daemon: it only looks, at every launch, for its ``control`` pipe, and when it is there a share job
gets its limits as MPS client variables (``domain.share_memory.mps_client_environment``). Without it the share
watchdog alone holds shares to their memory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # noqa: S108 - NVIDIA's default, not a temporary file of ours


class MpsControl:
    def __init__(self, pipe_directory: str | None = None) -> None:
        self.directory = pipe_directory or DEFAULT_PIPE_DIRECTORY

    def pipe_directory(self) -> str | None:
        """The daemon's pipe directory while its ``control`` pipe (FIFO or socket) exists, else None."""
        try:
            mode = os.stat(Path(self.directory) / "control").st_mode
        except OSError:
            return None
        return self.directory if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else None
