"""The executor's log endpoint before and after it moved onto Starlette/uvicorn (issue 32), side by side: a large log
read whole, and small requests through the session proxy (one at a time, and 16 at once), on this machine.

    uv run python bench/bench_executor_logs.py                  # against main's logs_http, 5 rounds
    uv run python bench/bench_executor_logs.py --base cd40b11 --runs 9 --log-mib 512   # the hand-written server

The base's ``logs_http.py`` is read from git (``git show <base>:...``) and imported beside this checkout's; both
serve the same log directory and the same stand-in session (an HTTP/1.1 keep-alive server on loopback). Rounds
alternate between the two so that a busy machine slows both alike. Each proxied request carries ``Connection:
close``, as the API's proxy sends it. Reports medians, and the CPU time per proxied request of this whole process
(client included: compare the two, not the absolute value). Writes bench/results/executor_logs.md (printed too).
A benchmark, not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
from gpuorch_executor import logs_http

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODULE = "services/executor/src/gpuorch_executor/logs_http.py"
TOKEN = "bench-token"


def base_module(ref: str, directory: Path) -> ModuleType:
    """``logs_http`` as it is at ``ref``, imported as its own module."""
    source = subprocess.run(["git", "show", f"{ref}:{MODULE}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    path = directory / "base_logs_http.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_logs_http", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def stand_in_session() -> tuple[asyncio.Server, int]:
    """An HTTP/1.1 server answering ``ok`` to every request, keeping the connection unless asked to close it."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline():
                close = False
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    close = close or header.lower().startswith(b"connection: close")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if close:
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def one_round(module: Any, logs: Path, job_id: uuid.UUID, port: int, requests: int) -> dict[str, float]:
    server = module.LogServer(TOKEN, [logs], lambda _: False,
                              session=lambda _: logs_http.SessionTarget(port, True))
    url = await server.start("127.0.0.1", 0)
    headers = {"Authorization": f"Bearer {TOKEN}", "Connection": "close"}
    out: dict[str, float] = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            started, size = time.perf_counter(), 0
            async with http.stream("GET", f"/jobs/{job_id}/logs", headers=headers) as response:
                async for chunk in response.aiter_raw():
                    size += len(chunk)
            out["log MiB/s"] = size / (time.perf_counter() - started) / 2**20

            async def get() -> None:
                answer = await http.get(f"/jobs/{job_id}/proxy/x", headers=headers)
                assert answer.text == "ok", answer.text

            started, cpu = time.perf_counter(), time.process_time()
            for _ in range(requests):
                await get()
            out["proxy req/s (1 at a time)"] = requests / (time.perf_counter() - started)
            out["CPU ms per proxied request"] = 1000 * (time.process_time() - cpu) / requests

            async def worker() -> None:
                for _ in range(requests // 16):
                    await get()
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(16)))
            out["proxy req/s (16 at once)"] = 16 * (requests // 16) / (time.perf_counter() - started)
    finally:
        await server.close()
    return out


async def run(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as directory:
        base = base_module(args.base, Path(directory))
        logs, job_id = Path(directory) / "logs", uuid.uuid4()
        (logs / str(job_id)).mkdir(parents=True)
        line = b"x" * 99 + b"\n"
        (logs / str(job_id) / f"{uuid.uuid4()}.log").write_bytes(line * (args.log_mib * 2**20 // len(line)))
        session, port = await stand_in_session()
        results: dict[str, list[dict[str, float]]] = {args.base: [], "this checkout": []}
        try:
            for _ in range(args.runs):
                for label, module in ((args.base, base), ("this checkout", logs_http)):
                    results[label].append(await one_round(module, logs, job_id, port, args.requests))
        finally:
            session.close()
    metrics = list(results["this checkout"][0])
    load = os.getloadavg()
    rows = [f"| metric | {args.base} | this checkout |", "|---|---:|---:|"]
    for metric in metrics:
        rows.append(f"| {metric} | " + " | ".join(
            f"{statistics.median(r[metric] for r in results[label]):.1f}" for label in results) + " |")
    return "\n".join([
        "# The executor's log endpoint: hand-written server vs Starlette/uvicorn", "",
        f"`uv run python bench/bench_executor_logs.py --base {args.base} --runs {args.runs} --log-mib {args.log_mib} "
        f"--requests {args.requests}`; medians of {args.runs} alternating rounds; {os.cpu_count()} CPUs, load "
        f"average {load[0]:.1f} at the end; Python {sys.version.split()[0]}.", "", *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git ref of the logs_http to compare with")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--log-mib", type=int, default=256)
    parser.add_argument("--requests", type=int, default=320)
    report = asyncio.run(run(parser.parse_args()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "executor_logs.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
