"""The real executor process against the real RabbitMQ: commands in, events out; SIGKILL and restart; fencing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import psutil
import pytest
from gpuorch_contracts import (
    EVENTS_EXCHANGE,
    JobFailed,
    JobFinished,
    JobLost,
    JobStarted,
    LaunchJob,
    Message,
    StopJob,
    decode,
)
from gpuorch_messaging import Broker, PublishError
from gpuorch_messaging.testing import TcpProxy

from gpuorch_executor.placement_store import PlacementStore

from .conftest import launch_job

pytestmark = pytest.mark.integration
TERMINAL = (JobFinished, JobFailed, JobLost)


class EventTap:
    """A queue bound to every event on ``gpuorch.events``; collects decoded messages."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: list[Message] = []
        self._connection: Any = None

    async def start(self) -> None:
        self._connection = await aio_pika.connect(self.url)
        channel = await self._connection.channel()
        exchange = await channel.get_exchange(EVENTS_EXCHANGE)  # declared by the Broker, with its arguments
        queue = await channel.declare_queue(f"test.events.{uuid.uuid4().hex[:8]}", exclusive=True)
        await queue.bind(exchange, "#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                self.events.append(decode(message.body))

        await queue.consume(on_message)

    async def close(self) -> None:
        await self._connection.close()

    def of(self, cls: type[Message] | tuple[type[Message], ...], placement_id: uuid.UUID) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls) and getattr(e, "placement_id", None) == placement_id]

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        async def loop() -> None:
            while not predicate():
                await asyncio.sleep(0.05)
        await asyncio.wait_for(loop(), timeout_s)


LOCAL_ALLOW_LIST = '{"tenants": {"default": {"commands": ["python", "python3"], "inline_code": true}}}'


class ExecutorProcess:
    """``gpuorch-executor`` as a real child process (what runs on a node)."""

    def __init__(self, url: str, state_root: Path, nodes: str, log: Path, **extra: str) -> None:
        self.env = {**os.environ, "GPUORCH_AMQP_URL": url, "GPUORCH_NODE_IDS": nodes,
                    "GPUORCH_EXECUTOR_STATE_DIR": str(state_root), "GPUORCH_EXECUTOR_POLL_S": "0.05",
                    # jobs are `python -c` with this checkout's interpreter, as the executor's own user
                    "GPUORCH_EXECUTOR_JOB_UIDS": "off", "GPUORCH_EXECUTOR_UNSANDBOXED": "1",
                    "GPUORCH_EXECUTOR_ALLOW": LOCAL_ALLOW_LIST, **extra}
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "gpuorch_executor.entrypoint"], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT)

    def sigkill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def publish_when_routable(broker: Broker, message: Message, timeout_s: float = 30.0) -> None:
    """Publish a command, retrying while the executor has not declared its queue yet."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await broker.publish(message)
            return
        except PublishError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.fixture
async def tap(amqp_url: str, commander: Broker) -> AsyncIterator[EventTap]:
    tap = EventTap(amqp_url)
    await tap.start()
    yield tap
    await tap.close()


@pytest.fixture
async def commander(amqp_url: str) -> AsyncIterator[Broker]:
    broker = Broker(amqp_url, producer="test/scheduler")
    await broker.connect()
    yield broker
    await broker.close()


def for_node(command: LaunchJob, node_id: str) -> LaunchJob:
    return command.model_copy(update={"node_id": node_id})


def kill_leftovers(state_root: Path) -> None:
    """Kill the test's supervisors and jobs if an assertion failed before they ended."""
    for process in psutil.process_iter(["cmdline"]):
        if str(state_root) in " ".join(process.info.get("cmdline") or []):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


async def test_fleet_executor_runs_commands_from_the_broker(
    amqp_url: str, tap: EventTap, commander: Broker, tmp_path: Path
) -> None:
    executor = ExecutorProcess(amqp_url, tmp_path / "state", "node-1,node-2", tmp_path / "executor.log")
    executor.start()
    try:
        commands = [for_node(launch_job(["python", "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                                        gpus=[f"GPU-{node}"]), node) for node in ("node-1", "node-2")]
        for command in commands:
            await publish_when_routable(commander, command)
        await tap.until(lambda: all(tap.of(TERMINAL, c.placement_id) for c in commands))
        for command in commands:
            [started] = tap.of(JobStarted, command.placement_id)
            [finished] = tap.of(TERMINAL, command.placement_id)
            assert isinstance(finished, JobFinished) and finished.exit_code == 0
            assert started.node_id == command.node_id and finished.node_id == command.node_id
            assert started.producer == f"executor/{command.node_id}"
            assert Path(started.log_path).read_text().strip() == f"GPU-{command.node_id}"
            assert (tmp_path / "state" / command.node_id / "placements" / str(command.placement_id)).is_dir()
        refused = for_node(launch_job(["bash", "-c", "echo pwned"]), "node-1")
        await publish_when_routable(commander, refused)
        await tap.until(lambda: bool(tap.of(TERMINAL, refused.placement_id)))
        [failure] = tap.of(TERMINAL, refused.placement_id)
        assert isinstance(failure, JobFailed) and failure.cause == "refused"
        assert executor.process is not None and executor.process.poll() is None  # still serving
    finally:
        executor.terminate()
        kill_leftovers(tmp_path / "state")


async def test_sigkilled_executor_restarts_and_each_job_reports_exactly_one_finish(
    amqp_url: str, tap: EventTap, commander: Broker, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    runs = tmp_path / "runs"
    runs.mkdir()

    def job(seconds: float, code: int) -> LaunchJob:
        script = (f"import os, time; open(os.path.join({str(runs)!r}, os.environ['GPUORCH_PLACEMENT_ID']), 'a')"
                  f".write('run\\n'); time.sleep({seconds}); raise SystemExit({code})")
        return for_node(launch_job(["python", "-c", script]), "node-1")

    ends_while_down = job(0.5, 0)
    outlives_the_restart = job(4.0, 3)
    stopped_after_restart = job(120.0, 0)
    jobs = [ends_while_down, outlives_the_restart, stopped_after_restart]
    executor = ExecutorProcess(amqp_url, state, "node-1", tmp_path / "executor.log")
    executor.start()
    try:
        for command in jobs:
            await publish_when_routable(commander, command)
        await tap.until(lambda: all(tap.of(JobStarted, c.placement_id) for c in jobs))
        executor.sigkill()
        exit_file = state / "node-1" / "placements" / str(ends_while_down.placement_id) / "exit.json"
        await tap.until(exit_file.exists)
        assert not tap.of(TERMINAL, ends_while_down.placement_id)  # it ended while nobody watched
        await publish_when_routable(commander, ends_while_down)  # a redelivery of a known placement
        executor.start()
        await tap.until(lambda: bool(tap.of(TERMINAL, outlives_the_restart.placement_id)))
        await publish_when_routable(commander, StopJob(
            node_id="node-1", job_id=stopped_after_restart.job_id, placement_id=stopped_after_restart.placement_id,
            reason="cancel", grace_s=1.0))
        await tap.until(lambda: all(tap.of(TERMINAL, c.placement_id) for c in jobs))
        await asyncio.sleep(0.5)  # room for a wrongful duplicate to show up
        for command in jobs:
            outcomes = tap.of(TERMINAL, command.placement_id)
            assert len({o.message_id for o in outcomes}) == 1, outcomes
            assert (runs / str(command.placement_id)).read_text() == "run\n"  # never started twice
            assert len({s.message_id for s in tap.of(JobStarted, command.placement_id)}) == 1
        [first] = {o.message_id: o for o in tap.of(TERMINAL, ends_while_down.placement_id)}.values()
        [second] = {o.message_id: o for o in tap.of(TERMINAL, outlives_the_restart.placement_id)}.values()
        [third] = {o.message_id: o for o in tap.of(TERMINAL, stopped_after_restart.placement_id)}.values()
        assert isinstance(first, JobFinished) and first.exit_code == 0
        assert isinstance(second, JobFailed) and second.cause == "nonzero_exit" and second.exit_code == 3
        assert isinstance(third, JobFailed) and third.cause == "killed" and third.stop_reason == "cancel"
    finally:
        executor.terminate()
        kill_leftovers(state)


async def test_executor_cut_off_from_the_broker_fences_its_jobs(
    amqp_url: str, amqp_vhost: str, tap: EventTap, commander: Broker, tmp_path: Path
) -> None:
    proxy = TcpProxy("127.0.0.1", int(amqp_url.split(":")[-1].split("/")[0]))
    await proxy.start()
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}"
    state = tmp_path / "state"
    executor = ExecutorProcess(url, state, "node-1", tmp_path / "executor.log",
                               GPUORCH_FENCING_DEADLINE_S="2", GPUORCH_FENCING_GRACE_S="1")
    executor.start()
    try:
        command = for_node(launch_job(["python", "-c", "import time; time.sleep(120)"]), "node-1")
        await publish_when_routable(commander, command)
        await tap.until(lambda: bool(tap.of(JobStarted, command.placement_id)))
        [started] = tap.of(JobStarted, command.placement_id)
        job = psutil.Process(started.pid)
        proxy.refuse = True
        await proxy.cut()
        await asyncio.wait_for(asyncio.to_thread(job.wait), 30)  # the executor stopped it without the broker
        assert not tap.of(TERMINAL, command.placement_id)  # nothing could be reported yet
        proxy.refuse = False
        await tap.until(lambda: bool(tap.of(TERMINAL, command.placement_id)))
        [outcome] = {o.message_id: o for o in tap.of(TERMINAL, command.placement_id)}.values()
        assert isinstance(outcome, JobFailed) and outcome.cause == "lost" and "fenced" in outcome.reason
        log = (tmp_path / "executor.log").read_text()
        assert "executor.fencing" in log
    finally:
        executor.terminate()
        await proxy.stop()
        kill_leftovers(state)


def test_help_lists_the_environment() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuorch_executor.entrypoint", "--help"], capture_output=True,
                            text=True, check=True)
    for name in ("GPUORCH_AMQP_URL", "GPUORCH_NODE_IDS", "GPUORCH_EXECUTOR_STATE_DIR", "GPUORCH_EXECUTOR_BACKEND",
                 "GPUORCH_FENCING_DEADLINE_S", "GPUORCH_LOG_LEVEL", "GPUORCH_OTLP_ENDPOINT"):
        assert name in result.stdout


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "gpuorch-executor"
    assert script.exists()
    assert json.dumps(str(script))


def test_a_second_executor_on_the_same_state_directory_refuses_to_start(amqp_url: str, tmp_path: Path) -> None:
    holder = PlacementStore(tmp_path / "state" / "node-1")  # as a running executor would hold it
    fd = holder.lock()
    try:
        second = ExecutorProcess(amqp_url, tmp_path / "state", "node-1", tmp_path / "second.log")
        second.start()
        assert second.process is not None
        assert second.process.wait(30) == 3
        assert "executor.state_dir_in_use" in (tmp_path / "second.log").read_text()
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs root (job uids) and /usr/bin/python3 (an interpreter any uid may run)")
async def test_the_real_executor_runs_each_job_as_a_uid_of_its_own(
    amqp_url: str, tap: EventTap, commander: Broker
) -> None:
    """``gpuorch-executor`` as on a node run as root: its default-style pool lends each job a uid, the job cannot
    read the executor's environment (the broker URL and its password), and the heartbeat says so."""
    import random
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gpuorch-executor-uids-", dir="/tmp"))
    root.chmod(0o711)
    first = random.randrange(200_000, 2_000_000, 64)
    allow = json.dumps({"tenants": {"default": {"commands": ["/usr/bin/python3"], "inline_code": True}}})
    executor = ExecutorProcess(amqp_url, root / "state", "node-1", root / "executor.log",
                               GPUORCH_EXECUTOR_JOB_UIDS=f"{first}-{first + 3}", GPUORCH_EXECUTOR_ALLOW=allow)
    executor.start()
    try:
        assert executor.process is not None
        probe = ("import json, os\n"
                 "try:\n    open(f'/proc/{os.getppid()}/environ').read(); environ = 'read'\n"
                 "except PermissionError:\n    environ = 'denied'\n"
                 f"try:\n    open('/proc/{executor.process.pid}/environ').read(); executor = 'read'\n"
                 "except PermissionError:\n    executor = 'denied'\n"
                 "print(json.dumps({'uid': os.getuid(), 'groups': os.getgroups(), 'supervisor': environ, "
                 "'executor': executor}))")
        command = for_node(launch_job(["/usr/bin/python3", "-c", probe]), "node-1")
        await publish_when_routable(commander, command)
        await tap.until(lambda: bool(tap.of(TERMINAL, command.placement_id)))
        [started] = tap.of(JobStarted, command.placement_id)
        [finished] = tap.of(TERMINAL, command.placement_id)
        assert isinstance(finished, JobFinished), finished
        seen = json.loads(Path(started.log_path).read_text().strip().splitlines()[-1])
        assert first <= seen["uid"] <= first + 3 and seen["groups"] == []
        assert (seen["supervisor"], seen["executor"]) == ("denied", "denied")
    finally:
        executor.terminate()
        kill_leftovers(root / "state")
        shutil.rmtree(root, ignore_errors=True)


async def test_an_executor_started_while_the_broker_is_down_waits_and_then_serves(
    amqp_url: str, amqp_vhost: str, tap: EventTap, tmp_path: Path
) -> None:
    """The broker refuses every connection when the executor starts (a proxy): it retries instead of exiting
    (before: 30 s, then exit 1) and renews its node's lease once the broker answers (decision 43)."""
    from gpuorch_contracts import ExecutorHeartbeat

    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    proxy.refuse = True
    executor = ExecutorProcess(f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}", tmp_path / "state",
                               "late-node", tmp_path / "executor.log", GPUORCH_EXECUTOR_HEARTBEAT_S="0.2")
    executor.start()
    assert executor.process is not None
    try:
        await tap.until(lambda: proxy.refused >= 2, timeout_s=30)
        assert executor.process.poll() is None  # still waiting, not exited
        assert "broker.unreachable" in (tmp_path / "executor.log").read_text()  # the unbounded wait, not a 30 s one
        proxy.refuse = False
        await tap.until(lambda: any(isinstance(e, ExecutorHeartbeat) and e.node_id == "late-node"
                                    for e in tap.events), timeout_s=30)
    finally:
        executor.terminate()
        await proxy.stop()
