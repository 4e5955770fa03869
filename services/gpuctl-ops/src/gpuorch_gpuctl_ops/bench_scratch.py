"""Where a benchmark runs: a scratch RabbitMQ vhost and PostgreSQL database, progress on stderr, and the CPU and
memory of the processes it measures.

Every ``gpuctl bench`` command makes its own vhost and database here and removes them when it ends (also on failure
or Ctrl-C); figures carry the machine's load average, because the machine is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672"
DEFAULT_AMQP_ADMIN = "http://guest:guest@127.0.0.1:15672"
DEFAULT_PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def progress(text: str) -> None:
    """One progress line on stderr (stdout is for results)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    """The machine's cores and its 1-minute load average now."""
    return {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}


@dataclass(frozen=True)
class ScratchServers:
    """Where the scratch vhost and database are made: the same servers and defaults as the test fixtures."""

    amqp: str = DEFAULT_AMQP
    amqp_admin: str = DEFAULT_AMQP_ADMIN
    pg_admin: str = DEFAULT_PG_ADMIN

    def _mgmt(self, method: str, path: str, body: dict[str, str] | None = None) -> None:
        import httpx

        url = httpx.URL(self.amqp_admin)
        response = httpx.request(method, f"{url.scheme}://{url.host}:{url.port}{path}",
                                 auth=(url.username or "guest", url.password or "guest"), timeout=30,
                                 json=body if body is not None else ({} if method == "PUT" else None))
        response.raise_for_status()

    @contextlib.contextmanager
    def vhost(self) -> Iterator[str]:
        """A fresh vhost (guest may do anything in it); yields its AMQP URL; deleted afterwards."""
        name = f"gpuorch-bench-{uuid.uuid4().hex[:10]}"
        self._mgmt("PUT", f"/api/vhosts/{name}")
        try:
            self._mgmt("PUT", f"/api/permissions/{name}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
            yield f"{self.amqp.rstrip('/')}/{name}"
        finally:
            with contextlib.suppress(Exception):
                self._mgmt("DELETE", f"/api/vhosts/{name}")

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh empty database; yields its DSN; dropped afterwards (WITH FORCE)."""
        name = f"gpuorch_bench_{uuid.uuid4().hex[:10]}"
        asyncio.run(self._admin(f'CREATE DATABASE "{name}"'))
        try:
            yield f"{self.pg_admin.rsplit('/', 1)[0]}/{name}"
        finally:
            with contextlib.suppress(Exception):
                asyncio.run(self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    async def _admin(self, sql: str) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.pg_admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()


@dataclass(frozen=True)
class MachineCpu:
    """CPU seconds of the whole machine (busy: neither idle nor waiting on I/O) and of each process of the local
    broker (``beam.smp``) and database (``postgres``) at one instant; ``since`` turns two into percentages. A
    process that ends between the two instants is not counted (a database backend that closed), one that started
    counts whole."""

    at: float
    busy_s: float
    processes: dict[tuple[str, int], float]
    """(name, pid) -> user + system CPU seconds."""

    WATCHED: ClassVar[dict[str, str]] = {"beam.smp": "broker", "postgres": "database"}

    @classmethod
    def now(cls) -> MachineCpu:
        import psutil

        times = psutil.cpu_times()
        processes: dict[tuple[str, int], float] = {}
        for process in psutil.process_iter(["name", "cpu_times"]):
            name, cpu = process.info["name"], process.info["cpu_times"]
            if name in cls.WATCHED and cpu is not None:
                processes[(name, process.pid)] = cpu.user + cpu.system
        return cls(time.monotonic(), sum(times) - times.idle - getattr(times, "iowait", 0.0), processes)

    def since(self, earlier: MachineCpu, prefix: str) -> dict[str, float | None]:
        """``<prefix>machine_busy_pct`` (% of all cores), ``<prefix>broker_cpu_pct`` and
        ``<prefix>database_cpu_pct`` (% of one core; None when no such process runs here) between ``earlier`` and
        this instant."""
        elapsed = max(self.at - earlier.at, 1e-9)
        figures: dict[str, float | None] = {
            f"{prefix}machine_busy_pct": round(min(100.0, 100 * (self.busy_s - earlier.busy_s) / elapsed
                                                   / (os.cpu_count() or 1)), 1)}
        for name, role in self.WATCHED.items():
            spent = [cpu - earlier.processes.get(key, 0.0) for key, cpu in self.processes.items() if key[0] == name]
            figures[f"{prefix}{role}_cpu_pct"] = round(100 * sum(spent) / elapsed, 1) if spent else None
        return figures


@dataclass
class ProcessMeter:
    """CPU seconds and resident memory of one process and its children (the scheduler's outbox relay runs in a
    child process), read from /proc (through psutil)."""

    pid: int
    peak_rss: int = 0
    _sampler: asyncio.Task[None] | None = field(default=None, repr=False)

    def _tree(self) -> list[Any]:
        import psutil

        process = psutil.Process(self.pid)
        return [process, *process.children(recursive=True)]

    def cpu_s(self, *, children: bool = True) -> float:
        """User + system CPU seconds of the process, and of its children unless ``children=False``."""
        import psutil

        total = 0.0
        for each in self._tree() if children else self._tree()[:1]:
            with contextlib.suppress(psutil.Error):
                times = each.cpu_times()
                total += times.user + times.system
        return total

    def rss(self) -> int:
        import psutil

        total = 0
        for each in self._tree():
            with contextlib.suppress(psutil.Error):
                total += each.memory_info().rss
        return total

    def high_water_rss(self) -> int | None:
        """VmHWM: the peak resident set since the process started (Linux only)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start_sampling(self, every_s: float = 0.25) -> None:
        async def sample() -> None:
            while True:
                with contextlib.suppress(Exception):
                    self.peak_rss = max(self.peak_rss, self.rss())
                await asyncio.sleep(every_s)

        self.peak_rss = 0
        self._sampler = asyncio.create_task(sample())

    async def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        with contextlib.suppress(Exception):
            self.peak_rss = max(self.peak_rss, self.rss())
