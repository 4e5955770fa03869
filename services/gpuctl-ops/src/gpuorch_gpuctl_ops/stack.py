"""Run the gpuorch services as local processes: for the demo and for end-to-end tests.

``LocalStack`` starts each service from its console script (never by importing it: gpuctl is a client), with
one environment pointing them at one broker vhost and one database, logs each to ``<root>/logs/<name>.log``,
and stops everything it started (SIGTERM, then SIGKILL after a timeout) — also when the caller fails, unless
``keep`` recorded it in ``<root>/stack.json`` first (``gpuctl demo --keep``); ``stop_recorded`` stops such a
stack later (``gpuctl down``).

With ``identity_map`` (a document like deploy/identity.json, tokens included) every service reads it from
``<root>/identity.json`` (``GPUORCH_IDENTITY_MAP``): the scheduler judges submissions by it and the API
(``start_api``) authenticates tokens by it. Executors serve their jobs' logs on a free port of 127.0.0.1, each with
its own credential derived from this stack's ``logs_secret`` and its broker user (``gpuorch_identity.
log_credential``), which the API derives the same way from the identity that announced the endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuorch_identity import log_credential
from gpuorch_messaging.connection import user_of

from gpuorch_gpuctl_ops.systemd_units import StackUnits


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
    unit: str | None = None
    """The systemd user unit it runs as (``LocalStack.units``), instead of a child process (``popen``)."""

    @property
    def running(self) -> bool:
        if self.unit is not None:
            return StackUnits.main_pid(self.unit) != 0
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
    identity_map: dict[str, object] | None = None
    logs_secret: str = field(default_factory=lambda: secrets.token_hex(16))
    api_url: str | None = None
    supervised: bool = False
    """Each service runs under a supervisor that restarts it when it crashes (supervise.py; ``gpuctl up``)."""
    units: StackUnits | None = None
    """Each service runs as a systemd user unit instead (systemd_units.py; ``gpuctl up --supervisor systemd``):
    ``_spawn`` writes and starts it, ``keep`` records it, ``stop_recorded`` (or leaving ``with`` unkept) stops and
    removes it."""
    _namespace: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _kept: bool = False

    def base_env(self) -> dict[str, str]:
        """The services' environment: this process's whole environment handed on (the services read it through
        their own settings classes), with this stack's addresses. Not a configuration read of gpuctl's (that is
        settings.py): the ``env.get`` calls below only let a variable the caller set win over a local default."""
        env = dict(os.environ)
        env.update({
            "GPUORCH_AMQP_URL": self.amqp_url,
            "GPUORCH_DATABASE_URL": self.database_url,
            "GPUORCH_LOG_LEVEL": env.get("GPUORCH_LOG_LEVEL", "INFO"),
            "GPUORCH_METRICS_PORT": "0",  # several stacks may run side by side; a test asks for a port
            "PYTHONUNBUFFERED": "1",
            # every process of a local stack connects as one user (guest): senders cannot be told apart
            "GPUORCH_IDENTITY": env.get("GPUORCH_IDENTITY", "trust_all"),
            # ... with every right, so each service declares the queues it consumes (no setup step needed here)
            "GPUORCH_BROKER_TOPOLOGY": env.get("GPUORCH_BROKER_TOPOLOGY", "declare"),
            # simulated GPUs of this stack differ from those of any other stack on the machine (same node names)
            "GPUORCH_SIM_NAMESPACE": self._namespace,
            # A local stack runs jobs with the interpreter of this checkout (often under a home directory other
            # users cannot enter) and lets them write where the tests read: jobs run as the stack's own user, which
            # the executor reports (gpuctl nodes: job_users executor_uid). Production keeps the uid pool.
            "GPUORCH_EXECUTOR_JOB_UIDS": env.get("GPUORCH_EXECUTOR_JOB_UIDS", "off"),
            "GPUORCH_EXECUTOR_UNSANDBOXED": env.get("GPUORCH_EXECUTOR_UNSANDBOXED", "1"),  # the opt-out, logged
            # Simulated nodes share this one host and their jobs' host CPU and memory are fictional (chaos jobs ask
            # for 16 MiB): no host limits here, as the executor reports (limits: none).
            "GPUORCH_EXECUTOR_CGROUP_ROOT": env.get("GPUORCH_EXECUTOR_CGROUP_ROOT", "off"),
            # The demo's and tests' jobs are `python -c ...`: inline code is allowed here explicitly, never by the
            # executor's default allow-list.
            "GPUORCH_EXECUTOR_ALLOW": env.get("GPUORCH_EXECUTOR_ALLOW", LOCAL_ALLOW_LIST),
            # the executor serves its jobs' logs (any free port here) to its own credential (``_spawn``)
            "GPUORCH_LOGS_PORT": "0", "GPUORCH_LOGS_HOST": "127.0.0.1",
            # every process of this stack, and every job it starts, carries its root: ``gpuctl down`` finds them
            # by it even when the record is gone or stale (``marked_processes``)
            STACK_MARKER: str(self.root.resolve()),
        })
        if self.identity_map is not None:
            path = self.root / "identity.json"
            self.root.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.identity_map))
            env["GPUORCH_IDENTITY_MAP"] = str(path)
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
        if script == "gpuorch-executor":  # its own log credential; only the API holds the issuing secret
            env.setdefault("GPUORCH_LOGS_TOKEN", log_credential(self.logs_secret, user_of(env["GPUORCH_AMQP_URL"])))
        elif script == "gpuorch-api":
            env.setdefault("GPUORCH_LOGS_SECRET", self.logs_secret)
        process = ServiceProcess(name, [_script(script)], env, log_dir / f"{name}.log")
        if self.units is not None:
            process.unit = self.units.write_service(name, process.argv, env, process.log_path)
            self.processes[name] = process
            self.units.start(process.unit)
            return process
        argv = [sys.executable, "-m", "gpuorch_gpuctl_ops.supervise", name, "--", *process.argv] if self.supervised \
            else process.argv
        log_file = process.log_path.open("ab")
        process.popen = subprocess.Popen(
            argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
            "GPUORCH_HEARTBEAT_S": "2", "GPUORCH_USAGE_S": "2",
            "GPUORCH_NODE_AGENT_STATE_DIR": str(self.root / "node-agent"), **env,
        })

    def start_node_agent(self, node_id: str, **env: str) -> ServiceProcess:
        """One node-agent for one node of this host (``GPUORCH_NVML`` real by default: ``gpuctl up``)."""
        return self._spawn("node-agent", "gpuorch-node-agent", {
            "GPUORCH_NODE_ID": node_id, "GPUORCH_NODE_AGENT_STATE_DIR": str(self.root / "node-agent"), **env,
        })

    def start_executor(self, **env: str) -> ServiceProcess:
        return self._spawn("executor", "gpuorch-executor", {
            "GPUORCH_NODE_IDS": ",".join(n.node_id for n in self.nodes),
            "GPUORCH_EXECUTOR_STATE_DIR": str(self.root / "executor"), **env,
        })

    def start_telemetry(self, **env: str) -> ServiceProcess:
        return self._spawn("telemetry", "gpuorch-telemetry", env)

    def start_api(self, port: int = 0, timeout_s: float = 60.0, **env: str) -> str:
        """Start the API on 127.0.0.1 (``port`` 0: a free one) and return its URL once ``/readyz`` answers 200.
        Start it after the scheduler: it looks the exchanges up, it does not declare them."""
        import httpx

        port = port or free_port()
        self._spawn("api", "gpuorch-api", {"GPUORCH_API_HOST": "127.0.0.1", "GPUORCH_API_PORT": str(port), **env})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not self.processes["api"].running:
                raise TimeoutError(f"the API did not become ready at {url}: {self.tail('api', 20)}")
            time.sleep(0.2)
        self.api_url = url
        return url

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

    async def queues_declared(self, names: list[str], timeout_s: float = 60.0, *, consumed: bool = False) -> None:
        """Return once each named queue is declared on the broker (``consumed``: and has a consumer, what tells a
        service started where the setup step declared its queues); ``TimeoutError`` otherwise."""
        import asyncio

        import aio_pika

        deadline = time.monotonic() + timeout_s
        connection = await aio_pika.connect(self.amqp_url)
        try:
            for name in names:
                while True:
                    channel = await connection.channel()
                    try:
                        queue = await channel.declare_queue(name, passive=True)
                        await channel.close()
                        if not consumed or (queue.declaration_result.consumer_count or 0) > 0:
                            break
                    except aio_pika.exceptions.ChannelClosed:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"queue {name} was not {'consumed' if consumed else 'declared'} within "
                                           f"{timeout_s:.0f}s; dead services: {self.dead()}") from None
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
        if process is not None and process.unit is not None:
            StackUnits.systemctl("stop", process.unit, check=False)
            return
        if process is None or process.popen is None or not process.running:
            return
        process.popen.send_signal(signal.SIGTERM)
        try:
            process.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait(10)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        if self.units is not None:
            StackUnits.remove(self.units.record())
            shutil.rmtree(self.root / "systemd", ignore_errors=True)
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
        return [f"{p.name} (exit {p.popen.returncode})" if p.popen is not None else f"{p.name} (unit {p.unit})"
                for p in self.processes.values()
                if (p.popen is not None and p.popen.poll() is not None) or (p.unit is not None and not p.running)]

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.processes[name].log_path
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def keep(self, **extra: Any) -> Path:
        """Leave the stack running past ``with``: record its processes (pid and start time, so that a pid reused
        by a stranger is never taken for one of them) in ``<root>/stack.json`` for ``stop_recorded``, with
        ``extra`` fields (the broker URL and vhost other systems use); returns that path."""
        import psutil

        processes = {}
        for p in self.processes.values():
            pid = p.popen.pid if p.popen is not None and p.running else StackUnits.main_pid(p.unit) if p.unit else 0
            if pid:
                with contextlib.suppress(psutil.Error):
                    processes[p.name] = {"pid": pid, "started": psutil.Process(pid).create_time()}
        if self.units is not None:
            extra = {**extra, "systemd": self.units.record()}
        record = self.root / "stack.json"
        record.write_text(json.dumps({"root": str(self.root.resolve()), "api_url": self.api_url,
                                      "amqp_url": self.amqp_url, "processes": processes, **extra}))
        self._kept = True
        return record

    @staticmethod
    def running_recorded(record: Path) -> dict[str, Any]:
        """The processes of the stack recorded at ``record`` that still run (name -> psutil.Process): a pid
        counts only with its recorded start time, or, without one (an older record), carrying the stack's
        marker. A stack of systemd units (``systemd`` in the record): each unit's main process now (systemd may have
        restarted it since). Empty when there is no record."""
        import psutil

        try:
            document = json.loads(record.read_text())
        except (OSError, ValueError):
            return {}
        root = str(document.get("root", record.parent))
        running = {}
        for name, unit in (document.get("systemd") or {}).get("services", {}).items():
            with contextlib.suppress(psutil.Error, ValueError):
                if pid := StackUnits.main_pid(unit):
                    running[name] = psutil.Process(pid)
        if document.get("systemd"):
            return running
        for name, entry in document.get("processes", {}).items():
            pid, started = (entry, None) if isinstance(entry, int) else (entry.get("pid"), entry.get("started"))
            try:
                process = psutil.Process(pid)
                same = abs(process.create_time() - started) < 0.01 if started is not None else \
                    _marked(process, root) or "gpuorch" in " ".join(process.cmdline())  # a record before the marker
            except (psutil.Error, TypeError, ValueError):
                continue
            if same:
                running[name] = process
        return running

    @staticmethod
    def stop_recorded(record: Path, timeout_s: float = 15.0) -> list[str]:
        """Stop a stack ``keep`` recorded (its process groups: SIGTERM, then SIGKILL), every other process that
        carries its marker (an orphan of an earlier run, a service restarted by hand) and its jobs; returns the
        names of the recorded services that were still running, then ``pid N (marked)`` for each other process
        stopped by its marker. A stack of systemd units: its units are stopped and their files removed first. The
        record is removed."""
        import psutil

        document: dict[str, Any] = json.loads(record.read_text()) if record.exists() else {"root": str(record.parent)}
        root = str(document.get("root", record.parent))
        running = LocalStack.running_recorded(record)
        if document.get("systemd"):
            StackUnits.remove(document["systemd"])
            shutil.rmtree(Path(root) / "systemd", ignore_errors=True)
        ours = {r.pid for r in running.values()}
        for process in running.values():
            with contextlib.suppress(psutil.Error):
                ours.update(child.pid for child in process.children(recursive=True))
        for process in running.values():
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGTERM)
        orphans = [p for p in marked_processes(root) if p.pid not in ours]
        for process in orphans:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs([*running.values(), *orphans], timeout=timeout_s)
        for process in alive:
            with contextlib.suppress(OSError, psutil.Error):
                process.kill()
        LocalStack(root=Path(root), amqp_url="", database_url="", nodes=[]).kill_jobs()
        record.unlink(missing_ok=True)
        return [*sorted(running), *(f"pid {p.pid} (marked)" for p in orphans)]

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *_: object) -> None:
        if self._kept:
            return
        self.stop_all()
        self.kill_jobs()


STACK_MARKER = "GPUORCH_STACK_ROOT"
"""The environment variable every process of a LocalStack carries: the stack's root directory."""


def _marked(process: Any, root: str) -> bool:
    import psutil

    try:
        return bool(process.environ().get(STACK_MARKER) == root)
    except psutil.Error:  # another user's process, or gone
        return False


def marked_processes(root: str | Path) -> list[Any]:
    """This user's processes that carry the marker of the stack at ``root`` (its services and their jobs),
    whatever became of the record."""
    import psutil

    wanted = str(Path(root).resolve())
    return [p for p in psutil.process_iter() if p.pid != os.getpid() and _marked(p, wanted)]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])

