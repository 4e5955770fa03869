"""A service's supervisor where systemd does not run (``gpuctl up``; decision 64): it runs the service, and when the
service exits on its own it starts it again after a backoff.

    python -m gpuorch_gpuctl_ops.supervise NAME -- ARGV...

The service inherits the supervisor's environment, stdout and stderr (its log file) and process group, so
``gpuctl down`` (SIGTERM to the group, then SIGKILL) stops both, and the stack's marker (GPUORCH_STACK_ROOT) finds
both. Backoff: 1 s after the first crash, doubled at each crash in a row up to 30 s; a run that lasted 60 s
resets it. SIGTERM or SIGINT: the service is asked to stop (SIGTERM, SIGKILL after 15 s), nothing is restarted,
the supervisor exits 0. Each restart is one line in the log: ``gpuctl supervise: NAME exited with CODE after S s;
restart N in B s``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
STOP_GRACE_S = 15.0


def backoff_s(crashes_in_a_row: int) -> float:
    """Seconds to wait before restart number ``crashes_in_a_row`` (1, 2, 4 ... 30)."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** max(0, crashes_in_a_row - 1))


def supervise(name: str, argv: list[str]) -> int:
    """Run ``argv`` until asked to stop, restarting it when it exits; 0 once stopped."""
    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def stop(*_: object) -> None:
        stopping.set()
        if child and child[0].poll() is None:
            child[0].terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    crashes = 0
    while not stopping.is_set():
        started = time.monotonic()
        child[:] = [subprocess.Popen(argv)]
        code = child[0].wait()
        if stopping.is_set():
            break
        lasted = time.monotonic() - started
        crashes = 1 if lasted >= HEALTHY_AFTER_S else crashes + 1
        pause = backoff_s(crashes)
        print(f"gpuctl supervise: {name} exited with {code} after {lasted:.1f} s; restart {crashes} in {pause:g} s",
              flush=True)
        stopping.wait(pause)
    if child and child[0].poll() is None:
        try:
            child[0].wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child[0].kill()
            child[0].wait()
    return 0


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m gpuorch_gpuctl_ops.supervise NAME -- ARGV...")
    sys.exit(supervise(args[0], args[2:]))


if __name__ == "__main__":
    main()
