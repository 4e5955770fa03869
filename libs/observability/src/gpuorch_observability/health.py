"""Readiness: what a service's ``/readyz`` answers (see ``metrics``).

A check is a function of no arguments returning None when it passes, else why it does not. Checks run in the HTTP
server's thread, so they only read state that the service's loop keeps current: a flag set by ``mark``, an
attribute (``broker.is_connected``), or the last result of a probe that ``keep_probing`` runs on the loop (a
database ``SELECT 1``). ``until_up`` runs a start-up step (open a pool, migrate) until the server it needs
answers, marking its check failing meanwhile, so a service waits for a server that is down at start instead of
exiting (docs/decisions.md 43).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gpuorch_observability.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")

Check = Callable[[], str | None]


class Readiness:
    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def add(self, name: str, check: Check) -> None:
        """Register (or replace) the check ``name``."""
        with self._lock:
            self._checks[name] = check

    def mark(self, name: str, failing: str | None) -> None:
        """Set the check ``name`` to a fixed answer: None (passes) or why it fails."""
        self.add(name, lambda: failing)

    def clear(self) -> None:
        with self._lock:
            self._checks.clear()

    def report(self) -> tuple[bool, dict[str, str]]:
        """(ready, {check: "ok" or why not}); not ready while no check is registered (nothing started yet)."""
        with self._lock:
            checks = dict(self._checks)
        answers: dict[str, str] = {}
        for name, check in checks.items():
            try:
                failing = check()
            except Exception as exc:  # noqa: BLE001 - a broken check is a failing one, never a 500
                failing = f"check failed: {exc!r}"
            answers[name] = "ok" if failing is None else failing
        return bool(answers) and all(v == "ok" for v in answers.values()), answers


def connected(broker: object, what: str = "RabbitMQ") -> Check:
    """A check passing while ``broker.is_connected`` (a ``gpuorch_messaging.Broker``)."""
    return lambda: None if getattr(broker, "is_connected", False) else f"not connected to {what}"


READINESS = Readiness()
"""The process's readiness (what ``start_metrics_server`` serves by default)."""


async def keep_probing(name: str, probe: Callable[[], Awaitable[object]], *, failing: str,
                       period_s: float = 5.0, timeout_s: float = 3.0, readiness: Readiness = READINESS) -> None:
    """Run ``probe`` every ``period_s`` on this loop and mark ``name`` by its outcome (``failing``: the reason
    shown while it raises or times out). Runs until cancelled."""
    readiness.mark(name, f"{failing}: not probed yet")
    while True:
        try:
            await asyncio.wait_for(probe(), timeout_s)
            readiness.mark(name, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the probe means not ready
            readiness.mark(name, f"{failing}: {exc!r}"[:300])
        await asyncio.sleep(period_s)


async def until_up(name: str, attempt: Callable[[], Awaitable[T]], *,
                   transient: tuple[type[BaseException], ...], failing: str, first_s: float = 0.5,
                   max_s: float = 10.0, readiness: Readiness = READINESS) -> T:
    """``await attempt()`` until it returns, and return what it returned. While it raises one of ``transient`` (the
    server is down, not there yet, refusing connections) the check ``name`` fails with ``failing`` and the error,
    a warning ``<name>.unreachable`` is logged and the next try follows after a backoff doubling from ``first_s``
    to ``max_s``; anything else propagates at once (a bug or a refusal is not waited out). Passes ``name`` once
    ``attempt`` returned. Never gives up: cancel the task to stop it."""
    backoff = first_s
    while True:
        try:
            result = await attempt()
        except transient as exc:
            readiness.mark(name, f"{failing}: {exc!r}"[:300])
            log.warning(f"{name}.unreachable", error=repr(exc)[:300], retry_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_s)
            continue
        readiness.mark(name, None)
        return result
