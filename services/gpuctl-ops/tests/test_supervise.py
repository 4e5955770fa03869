"""``gpuctl up``'s services are supervised (issue 32): a service that crashes is started again, with backoff; a
stop stops it for good. The supervisor alone with a stand-in service, then a real scheduler of a supervised
LocalStack killed with SIGKILL and seen consuming its queue again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode
from gpuorch_gpuctl_ops.supervise import MAX_BACKOFF_S, backoff_s

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _child_other_than(supervisor: psutil.Process, old: int | None, timeout_s: float = 30.0) -> psutil.Process:
    """The supervisor's running child, once it is not ``old`` (waits on the process table, bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = [c for c in supervisor.children() if c.pid != old and c.status() != psutil.STATUS_ZOMBIE]
        if children:
            return children[0]
        time.sleep(0.05)
    raise TimeoutError(f"no new child of {supervisor.pid} within {timeout_s}s")


def test_backoff_doubles_from_one_second_up_to_thirty() -> None:
    assert [backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30] and MAX_BACKOFF_S == 30


def test_a_crashed_service_comes_back_and_a_stop_stops_it_for_good(tmp_path: Path) -> None:
    log = (tmp_path / "sleeper.log").open("wb")
    supervisor = subprocess.Popen([sys.executable, "-m", "gpuorch_gpuctl_ops.supervise", "sleeper", "--", *SLEEPER],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        watched = psutil.Process(supervisor.pid)
        first = _child_other_than(watched, None)
        first.kill()  # a crash
        second = _child_other_than(watched, first.pid)
        assert second.is_running() and second.pid != first.pid
        assert "gpuctl supervise: sleeper exited with -9" in (tmp_path / "sleeper.log").read_text()
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        log.close()


@pytest.mark.integration
@pytest.mark.slow
def test_a_supervised_stacks_scheduler_killed_comes_back_and_consumes_again(tmp_path: Path, amqp_url: str,
                                                                           pg_dsn: str) -> None:
    stack = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[SimNode("node-1", "l4", 1)],
                       supervised=True)
    with stack:
        stack.start_scheduler()
        stack.wait_for_queues(["scheduler"])
        popen = stack.processes["scheduler-1"].popen
        assert popen is not None
        supervisor = psutil.Process(popen.pid)
        first = _child_other_than(supervisor, None)
        assert "gpuorch-scheduler" in " ".join(first.cmdline())
        first.kill()
        second = _child_other_than(supervisor, first.pid)
        asyncio.run(stack.queues_declared(["scheduler"], 60, consumed=True))
        assert second.is_running() and stack.dead() == []
        assert "gpuctl supervise: scheduler-1 exited with -9" in stack.tail("scheduler-1", 400)
