"""Run the gpuorch services as local processes: for the demo and for end-to-end tests.

``LocalStack`` starts each service from its console script (never by importing it: gpuctl is a client), with
one environment pointing them at one broker vhost and one database, logs each to ``<root>/logs/<name>.log``,
and stops everything it started (SIGTERM, then SIGKILL after a timeout) — also when the caller fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SimNode:
    """A simulated GPU node: ``profile`` names a device profile of the simulated NVML (``h100``, ``a100-80``,
    ``l4``, ``t4``, ``v100``, or an openb model)."""

    node_id: str
    profile: str
    gpus: int
    cpu_milli: int = 64000
    memory_mib: int = 256 * 1024


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


LOCAL_ALLOW_LIST = '{"tenants": {"default": {"commands": ["python", "python3"], "inline_code": true}}}'
"""The allow-list of a local stack (demo, end-to-end tests): the executor's default, plus inline code."""


def _script(name: str) -> str:
    """Path of a console script installed next to this interpreter (the workspace venv)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed; run `uv sync`")
    return found


@dataclass
class LocalStack:
    root: Path
    amqp_url: str
    database_url: str
    nodes: list[SimNode]
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    _namespace: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "GPUORCH_AMQP_URL": self.amqp_url,
            "GPUORCH_DATABASE_URL": self.database_url,
            "GPUORCH_LOG_LEVEL": env.get("GPUORCH_LOG_LEVEL", "INFO"),
            "GPUORCH_METRICS_PORT": "0",  # several stacks may run side by side; a test asks for a port
            "PYTHONUNBUFFERED": "1",
            # every process of a local stack connects as one user (guest): senders cannot be told apart
            "GPUORCH_IDENTITY": env.get("GPUORCH_IDENTITY", "trust_all"),
            # simulated GPUs of this stack differ from those of any other stack on the machine (same node names)
            "GPUORCH_SIM_NAMESPACE": self._namespace,
            # A local stack runs jobs with the interpreter of this checkout (often under a home directory other
            # users cannot enter) and lets them write where the tests read: jobs run as the stack's own user, which
            # the executor reports (gpuctl nodes: job_users executor_uid). Production keeps the uid pool.
            "GPUORCH_EXECUTOR_JOB_UIDS": env.get("GPUORCH_EXECUTOR_JOB_UIDS", "off"),
            # Simulated nodes share this one host and their jobs' host CPU and memory are fictional (chaos jobs ask
            # for 16 MiB): no host limits here, as the executor reports (limits: none).
            "GPUORCH_EXECUTOR_CGROUP_ROOT": env.get("GPUORCH_EXECUTOR_CGROUP_ROOT", "off"),
            # The demo's and tests' jobs are `python -c ...`: inline code is allowed here explicitly, never by the
            # executor's default allow-list.
            "GPUORCH_EXECUTOR_ALLOW": env.get("GPUORCH_EXECUTOR_ALLOW", LOCAL_ALLOW_LIST),
        })
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, script: str, env_overrides: dict[str, str]) -> ServiceProcess:
        existing = self.processes.get(name)
        if existing is not None and existing.running:
            raise RuntimeError(f"{name} already runs")
        log_dir = self.root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = self.base_env()
        env.update(env_overrides)
        process = ServiceProcess(name, [_script(script)], env, log_dir / f"{name}.log")
        log_file = process.log_path.open("ab")
        process.popen = subprocess.Popen(
            process.argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log_file.close()
        self.processes[name] = process
        return process

    # -- services ---------------------------------------------------------------------------------------------

    def start_scheduler(self, instance: str = "scheduler-1", **env: str) -> ServiceProcess:
        return self._spawn(instance, "gpuorch-scheduler", {"GPUORCH_SCHEDULER_ID": instance, **env})

    def start_node_agents(self, **env: str) -> ServiceProcess:
        """One node-agent process simulating every node of ``nodes`` (a node list CSV in the openb format)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fleet_csv = self.root / "fleet.csv"
        fleet_csv.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
            f"{n.node_id},{n.cpu_milli},{n.memory_mib},{n.gpus},{n.profile}\n" for n in self.nodes))
        return self._spawn("node-agent", "gpuorch-node-agent", {
            "GPUORCH_NVML": "sim", "GPUORCH_FLEET_CSV": str(fleet_csv), "GPUORCH_FLEET_NAME": "local",
            "GPUORCH_HEARTBEAT_S": "2", "GPUORCH_USAGE_S": "2", **env,
        })

    def start_executor(self, **env: str) -> ServiceProcess:
        return self._spawn("executor", "gpuorch-executor", {
            "GPUORCH_NODE_IDS": ",".join(n.node_id for n in self.nodes),
            "GPUORCH_EXECUTOR_STATE_DIR": str(self.root / "executor"), **env,
        })

    def start_telemetry(self, **env: str) -> ServiceProcess:
        return self._spawn("telemetry", "gpuorch-telemetry", env)

    def start_all(self, timeout_s: float = 60.0) -> None:
        """Start every service; node-agents last, once the scheduler and telemetry queues exist, so that
        their first registrations have somewhere to go."""
        self.start_scheduler()
        self.start_executor()
        # the scheduler applied the migrations by then, and its queues are bound (heartbeats' comes last)
        self.wait_for_queues(["scheduler", "scheduler.heartbeats"], timeout_s)
        self.start_telemetry()
        self.wait_for_queues(["telemetry.samples"], timeout_s)
        self.start_node_agents()

    def wait_for_queues(self, names: list[str], timeout_s: float = 60.0) -> None:
        """Block until each named queue is declared on the broker (its service is consuming or about to)."""
        import asyncio

        asyncio.run(self.queues_declared(names, timeout_s))

    async def queues_declared(self, names: list[str], timeout_s: float = 60.0) -> None:
        """Return once each named queue is declared on the broker; ``TimeoutError`` otherwise."""
        import asyncio

        import aio_pika

        deadline = time.monotonic() + timeout_s
        connection = await aio_pika.connect(self.amqp_url)
        try:
            for name in names:
                while True:
                    channel = await connection.channel()
                    try:
                        await channel.declare_queue(name, passive=True)
                        await channel.close()
                        break
                    except aio_pika.exceptions.ChannelClosed:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"queue {name} was not declared within {timeout_s:.0f}s; "
                                               f"dead services: {self.dead()}") from None
                        await asyncio.sleep(0.3)
        finally:
            await connection.close()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL a service's whole process group at once (a crash, as far as anyone can tell)."""
        process = self.processes[name]
        if process.popen is not None and process.running:
            os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait(10)

    def stop(self, name: str, timeout_s: float = 15.0) -> None:
        process = self.processes.get(name)
        if process is None or process.popen is None or not process.running:
            return
        process.popen.send_signal(signal.SIGTERM)
        try:
            process.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait(10)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        running = [p for p in self.processes.values() if p.running]
        for process in running:
            assert process.popen is not None
            process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in running:
            assert process.popen is not None
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait(10)

    def kill_jobs(self) -> int:
        """SIGKILL every job this stack's executor started (their supervisors outlive the executor by design)
        and the supervisors; returns how many processes were killed. Used when tearing the stack down."""
        import psutil

        marker = str(self.root / "executor")
        supervisors = []
        for process in psutil.process_iter(["pid", "cmdline"]):
            cmdline = process.info.get("cmdline") or []
            if any(marker in part for part in cmdline) and "gpuorch_executor.supervise" in " ".join(cmdline):
                supervisors.append(process)
        victims = []
        for supervisor in supervisors:
            try:
                victims += supervisor.children(recursive=True)
            except psutil.Error:
                pass
            victims.append(supervisor)
        for victim in victims:
            try:
                victim.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=5)
        return len(victims)

    def dead(self) -> list[str]:
        """Names of services that exited on their own, with their exit codes."""
        return [f"{p.name} (exit {p.popen.returncode})" for p in self.processes.values()
                if p.popen is not None and p.popen.poll() is not None]

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.processes[name].log_path
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_all()
        self.kill_jobs()
