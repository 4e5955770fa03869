"""The executor's half of each node's lease: an ``ExecutorHeartbeat`` per node, and the fence when renewals stop.

Contract:
- ``LeaseRenewer.renew`` publishes one ``ExecutorHeartbeat`` per node served (its active placements, its fencing
  deadline, its interval) and, when the broker confirmed them all, moves ``renewed_at`` to the monotonic time the
  round was *sent* (never the time the confirm came back: a renewal delayed in a blocked connection must not
  extend the lease). A refusal (``PublishRefused``: a nack from a full queue, or no route on an exchange
  without an alternate) also renews: the broker answered, so it is reachable; it is logged once per streak.
- after each renewal the lease is written to ``<state dir>/lease.json`` of every node with active placements (and
  before each launch): each job's supervisor stops its job by the same deadline if this process is dead
  (``supervise.LeaseWatch``).
- ``LeaseRenewer.check`` feeds ``renewed_at`` to ``domain.fencing.LeaseFence``; when the lease has gone unrenewed
  for ``deadline - grace`` it fences every node's executor (all jobs dead by ``renewed_at + deadline``), and says
  so once when a renewal succeeds again. Every time here is ``time.monotonic()``: a wall-clock step (NTP, a VM
  resumed) neither fences early nor late.
- a renewal sent ``deadline - grace`` or more after the previous one (a fence, a pause that outlived it, a restart
  that long after the last ``lease.json``), or a start after a reboot, is a *recovery*: every node's executor gets
  ``recovered_at`` and refuses LaunchJobs decided before it (``domain.fencing.predates_recovery``).
- ``run`` renews every ``interval_s`` and checks every ``check_interval_s`` until cancelled; a publish that hangs
  is abandoned after ``interval_s`` at the most per attempt (the lease simply is not renewed by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from gpuorch_contracts import ExecutorHeartbeat, JobIsolation, RunningPlacement
from gpuorch_messaging.abc import Publisher, PublishError
from gpuorch_observability import get_logger

from gpuorch_executor.domain.fencing import FenceDecision, LeaseFence
from gpuorch_executor.handlers import NodeExecutor

log = get_logger(__name__)
MAX_LISTED_PLACEMENTS = 4096


class LeaseRenewer:
    def __init__(self, publisher: Publisher, executors: Sequence[NodeExecutor], *, interval_s: float,
                 fencing_deadline_s: float, fencing_grace_s: float, check_interval_s: float = 0.5,
                 monotonic: Callable[[], float] = time.monotonic, isolation: JobIsolation | None = None,
                 logs_url: str | None = None) -> None:
        """``isolation`` (what this node enforces, found at start) and ``logs_url`` (where its jobs' logs are
        served, ``logs_http``) ride on every heartbeat."""
        if interval_s <= 0 or interval_s * 2 > fencing_deadline_s - min(fencing_grace_s, fencing_deadline_s):
            raise ValueError("the heartbeat interval must be positive and at most half of deadline - grace, "
                             "so that one lost heartbeat does not fence")
        self.publisher = publisher
        self.executors = list(executors)
        self.interval_s = interval_s
        self.check_interval_s = check_interval_s
        self.fence = LeaseFence(fencing_deadline_s, fencing_grace_s)
        self.monotonic = monotonic
        self.isolation = isolation
        self.logs_url = logs_url
        now = monotonic()
        written = [r for r in (e.store.read_lease_renewed() for e in self.executors) if r is not None]
        previous = [r for r in written if r <= now]
        self.renewed_at = min(previous) if previous else now
        if len(previous) < len(written):  # a lease renewed "later" than now: the host rebooted (monotonic reset)
            for executor in self.executors:
                executor.recovered_at = executor.clock()
        """Monotonic send time of the newest confirmed round. Before the first: the last renewal a previous executor
        confirmed (its adopted jobs' lease runs on from there, as the scheduler's count does), else the start."""
        self.sequence = 0
        self._refusal_logged = False

    def heartbeats(self) -> list[ExecutorHeartbeat]:
        beats = []
        for executor in self.executors:
            active = [RunningPlacement(placement_id=r.placement_id, job_id=r.job_id, idle_s=executor.session_idle_s(r))
                      for r in executor.active_placements()]
            beats.append(ExecutorHeartbeat(
                node_id=executor.node_id, sequence=self.sequence, fencing_deadline_s=self.fence.deadline_s,
                interval_s=self.interval_s, running=active[:MAX_LISTED_PLACEMENTS],
                running_truncated=len(active) > MAX_LISTED_PLACEMENTS, producer=executor.settings.producer,
                isolation=self.isolation, logs_url=self.logs_url,
            ))
        return beats

    async def renew(self) -> bool:
        """Publish one round of heartbeats; True when it renewed the lease."""
        sent_at = self.monotonic()
        beats = self.heartbeats()
        self.sequence += 1
        try:
            await asyncio.wait_for(asyncio.gather(*(self.publisher.publish(b) for b in beats)), self.interval_s)
        except PublishError as exc:
            if not exc.refused:
                log.warning("lease.not_renewed", error=str(exc)[:300])
                return False
            if not self._refusal_logged:
                log.warning("lease.heartbeat_refused", error=str(exc)[:300],
                            effect="the broker answered (lease renewed); no scheduler reads executor heartbeats")
                self._refusal_logged = True
        except TimeoutError:
            log.warning("lease.not_renewed", error=f"not confirmed within {self.interval_s}s")
            return False
        else:
            self._refusal_logged = False
        if sent_at - self.renewed_at >= self.fence.stop_after_s:  # renewed after a lapse: a recovery
            log.warning("lease.recovered", unrenewed_for_s=round(sent_at - self.renewed_at, 1),
                        effect="LaunchJobs decided before now are refused and reported lost")
            for executor in self.executors:
                executor.recovered_at = executor.clock()
        self.renewed_at = max(self.renewed_at, sent_at)
        lease = (self.renewed_at, self.fence.deadline_s, self.fence.grace_s)
        for executor in self.executors:
            executor.lease = lease
            if executor.active_placements():  # their supervisors fence on it if this process dies
                executor.store.write_lease(*lease)
        return True

    async def check(self) -> FenceDecision:
        """Fence every node's jobs once the lease lapsed (see the module docstring)."""
        decision = self.fence.observe(self.renewed_at, self.monotonic())
        if decision.action == "fence" and decision.kill_by is not None:
            log.error("executor.fencing", unrenewed_for_s=round(decision.unrenewed_for_s, 1),
                      deadline_s=self.fence.deadline_s)
            for executor in self.executors:
                await executor.fence(decision.kill_by)
        elif decision.action == "recovered":
            log.warning("executor.unfenced", note="lease renewed again; stopped jobs are reported as lost")
        return decision

    async def run(self) -> None:
        checker = asyncio.create_task(self._check_loop())
        try:
            while True:
                started = self.monotonic()
                await self.renew()
                await asyncio.sleep(max(0.0, self.interval_s - (self.monotonic() - started)))
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker

    async def _check_loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.check_interval_s)
