"""Scheduler leadership: a lease with an expiry in PostgreSQL, fenced by its epoch (docs/decisions.md 41).

    standby ──every renew_s──> the leader's session lock free (its process or session died)?  ──yes──┐
                               else: the lease expired (database clock: paused, cut off)?     ──yes──┤
                                     terminate the holder of the session lock                        │
                                                                                                     ▼
              terminate the sessions of earlier leaders (application_name ``gpuorch-scheduler-leader ...``):
              their transactions abort, their row locks and the outbox relay's lock go with them
                                      ▼
              UPDATE scheduler_leadership SET epoch = epoch + 1 ... ──> leader of that epoch
    leader  ──every renew_s──> UPDATE ... expires_at WHERE epoch = ours  ──0 rows, or no renewal confirmed for
                                                                           lease_s──> LeadershipLost
            every batch: ``fence(conn)`` in the batch's own transaction: SELECT epoch ... FOR SHARE = ours, else
            LeadershipLost and the transaction rolls back

The lease's own session holds a session advisory lock while leading (the key of the advisory-lock leadership it
replaces): a leader that dies (SIGKILL, its session gone) is replaced as soon as a standby polls, without waiting
for the expiry; one that is alive but does not renew (paused) keeps its session, so the expiry decides.

Guarantees:
- At most one epoch commits at a time: a batch commits only while the row holds its epoch, and the row lock it
  takes (FOR SHARE) makes a takeover wait for that commit (or terminate it) before the epoch moves on. A leader
  that wakes after a pause can finish no batch: its commit finds a newer epoch (or a terminated session).
- A paused or cut-off leader loses leadership within ``lease_s`` plus one ``renew_s`` of polling by a standby.
  Times are the database's (``clock_timestamp()``): the instances' clocks may disagree.
- ``release`` (a clean stop, or stepping down after an error) ends the lease at once, so a standby or this
  instance takes over without waiting for the expiry.
- The epoch stamps every command the leader publishes (``leader_epoch``); executors refuse commands of an epoch
  older than the newest they have seen (``gpuorch_contracts.leader_epoch``).
- ``try_acquire``, ``renew``, ``release`` and ``close`` may be called from several coroutines at once (the keeper
  beside a step-down, a standby's retry): one lock gives the lease's session to one of them at a time. asyncpg runs
  one operation per connection; a second one at once fails with "another operation is in progress", which would
  read as a lost session and drop it, session lock included, so a standby could take a live leader's lease.
  ``fence`` runs on the caller's own connection, never on the lease's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from gpuorch_observability import get_logger

log = get_logger(__name__)

LEADER_APPLICATION_NAME = "gpuorch-scheduler-leader"
"""Prefix of the ``application_name`` of every database session a leader opens (its writes, its outbox relay, its
snapshots): the next leader terminates the sessions that carry it with another epoch."""

LEASE_LOCK_KEY = 0x67707552_5343_4844
"""Session advisory lock the lease's own session holds while leading: the key leadership used before the lease, so
a scheduler of an older release that holds it counts as a leader whose lease expired (its session is ended)."""

CONNECTION_LOST = (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
                   asyncpg.exceptions.OperatorInterventionError)
"""What a lost database session raises (terminated, server gone, network): a pause to wait out, not a bug."""


class LeadershipLost(Exception):
    """This instance is no longer the leader (another epoch holds the lease, or it could not renew in time)."""


FENCE_EPOCH = "(SELECT epoch FROM scheduler_leadership WHERE id = 1 FOR SHARE)"
"""The fence as an expression (a scalar sub-select, so that a batch's first statement can carry it beside its
reads): the lease row's epoch, the row locked FOR SHARE until the transaction ends (a takeover waits for it)."""


def check_fence(epoch: int, current: int | None) -> None:
    """Raise ``LeadershipLost`` unless ``current`` (``FENCE_EPOCH`` read in the write transaction) is ``epoch``."""
    if current != epoch:
        raise LeadershipLost(f"epoch {epoch} was superseded by epoch {current}")


@dataclass
class LeaderLease:
    """One instance's side of the lease. ``acquire`` as a standby, then ``keep`` beside the work and ``fence``
    every commit; ``release`` when leaving. Opens one session of its own for the lease itself."""

    database_url: str
    holder: str
    lease_s: float = 5.0
    renew_s: float = 1.0
    epoch: int = 0
    """The epoch this instance leads in (0: not leading)."""
    _conn: Any = field(default=None, init=False, repr=False)
    _locked: bool = field(default=False, init=False, repr=False)
    """The lease session holds the session lock (``LEASE_LOCK_KEY``)."""
    _renewed_at: float = field(default=0.0, init=False, repr=False)
    """Monotonic time the last renewal (or the acquisition) was confirmed by the database."""
    _session_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    """Held by whichever operation uses the lease's session (``_conn``): one at a time (see the module)."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.lease_s:
            raise ValueError("the lease must be longer than its renewal interval")

    @property
    def application_name(self) -> str:
        """The ``application_name`` of this leader's sessions (the next leader terminates them)."""
        return f"{LEADER_APPLICATION_NAME} epoch={self.epoch} {self.holder}"[:63]

    def session_settings(self) -> dict[str, str]:
        """``server_settings`` for every session the leader opens (``asyncpg.connect``/``create_pool``)."""
        return {"application_name": self.application_name}

    async def _session(self) -> Any:
        if self._conn is None or self._conn.is_closed():
            self._locked = False
            self._conn = await asyncpg.connect(self.database_url, timeout=self.lease_s,
                                               server_settings={"application_name": "gpuorch-scheduler-lease"})
        return self._conn

    async def _lock(self, conn: Any) -> bool:
        if not self._locked:
            self._locked = bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEASE_LOCK_KEY))
        return self._locked

    async def _drop_session(self) -> None:
        """Close the lease's session (the caller holds ``_session_lock``); the next operation opens a new one."""
        conn, self._conn, self._locked = self._conn, None, False
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=1.0)

    # -- standby ----------------------------------------------------------------------------------------------

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait as a standby until the lease is this instance's (True) or ``stop`` is set (False). A database that
        cannot be reached is waited for, with a backoff (at most ``lease_s`` between tries); any other error of a
        try is logged, its session dropped, and the standby tries again after the same backoff: it never raises."""
        backoff = self.renew_s
        while not stop.is_set():
            try:
                if await self.try_acquire():
                    return True
                backoff = self.renew_s
            except CONNECTION_LOST as exc:  # try_acquire dropped the session
                log.warning("scheduler.standby_database_unreachable", error=repr(exc), retry_s=backoff)
                backoff = min(backoff * 2, self.lease_s)
            except asyncpg.LockNotAvailableError:
                log.info("scheduler.takeover_waiting", note="a leader's commit still holds the lease row")
            except Exception as exc:  # noqa: BLE001 - a standby never exits on its own: drop the session, retry
                log.error("scheduler.standby_acquire_failed", error=repr(exc), retry_s=backoff)
                async with self._session_lock:
                    await self._drop_session()
                backoff = min(backoff * 2, self.lease_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff)
        return False

    async def try_acquire(self) -> bool:
        """Take the lease if its leader's session is gone or it expired (see the module), with the next epoch. A lost
        session (``CONNECTION_LOST``) is dropped and the error raised; the next call opens a new one."""
        async with self._session_lock:
            try:
                return await self._take_lease()
            except CONNECTION_LOST:
                await self._drop_session()
                raise

    async def _take_lease(self) -> bool:
        conn = await self._session()
        if not await self._lock(conn):
            if not await conn.fetchval("SELECT expires_at < clock_timestamp() FROM scheduler_leadership "
                                       "WHERE id = 1"):
                return False
            # Alive but not renewing (paused, or cut off from the row): end the session that holds the lock.
            holders = await self._end_sessions(
                conn, "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND ((classid::bigint << 32) | objid::bigint) = $1 AND objsubid = 1 AND pid <> pg_backend_pid()",
                LEASE_LOCK_KEY)
            log.warning("scheduler.lease_expired", note="the leader did not renew its lease: taking over",
                        sessions_terminated=holders)
            for _ in range(int(self.renew_s / 0.05) + 1):  # a terminated backend lets go of its locks at once
                if await self._lock(conn):
                    break
                await asyncio.sleep(0.05)
        terminated = await self._end_sessions(
            conn, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE $1 AND pid <> pg_backend_pid()", LEADER_APPLICATION_NAME + "%")
        started = time.monotonic()
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {int(self.renew_s * 1000)}")
            # Holding the session lock, no other instance leads; without it (the holder could not be ended), only
            # an expired lease is taken, so two standbys never both take one.
            epoch = await conn.fetchval(
                "UPDATE scheduler_leadership SET epoch = epoch + 1, holder = $1, acquired_at = clock_timestamp(), "
                "expires_at = clock_timestamp() + make_interval(secs => $2) "
                "WHERE id = 1 AND ($3 OR expires_at < clock_timestamp()) RETURNING epoch",
                self.holder, self.lease_s, self._locked)
        if epoch is None:
            return False
        self.epoch, self._renewed_at = int(epoch), started
        log.info("scheduler.lease_acquired", epoch=self.epoch, holder=self.holder,
                 earlier_sessions_terminated=terminated, session_lock=self._locked)
        return True

    async def _end_sessions(self, conn: Any, query: str, *args: Any) -> int:
        """Terminate the sessions ``query`` selects (it returns their count); best effort: without the right (the
        old leader logged in as another user, outside ``pg_signal_backend``) the epoch fence alone keeps its writes
        out, and a commit it holds open delays the takeover until it ends."""
        try:
            return int(await conn.fetchval(query, *args) or 0)
        except asyncpg.InsufficientPrivilegeError as exc:
            log.warning("scheduler.old_sessions_not_ended", error=str(exc)[:200])
            return 0

    # -- leader -----------------------------------------------------------------------------------------------

    async def keep(self) -> None:
        """Renew every ``renew_s`` while leading; raises ``LeadershipLost`` once another epoch holds the lease, or
        once no renewal was confirmed for ``lease_s`` (the database unreachable: a standby may lead by now)."""
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                await self.renew()
            except LeadershipLost:
                raise
            except CONNECTION_LOST as exc:  # renew dropped the session
                unrenewed = time.monotonic() - self._renewed_at
                log.warning("scheduler.lease_unrenewed", epoch=self.epoch, error=repr(exc),
                            unrenewed_s=round(unrenewed, 2))
                if unrenewed >= self.lease_s:
                    raise LeadershipLost(f"lease of epoch {self.epoch} not renewed for {unrenewed:.1f} s") from exc

    async def renew(self) -> None:
        """Extend the lease by ``lease_s`` from now; raises ``LeadershipLost`` if another epoch holds it. Takes the
        session lock again after the lease's session was lost and reopened (if another instance took it meanwhile,
        that instance takes the lease too, and the renewal after finds a newer epoch). A lost session
        (``CONNECTION_LOST``) is dropped and the error raised. The epoch renewed is the one held once the session is
        this call's (a ``release`` or ``try_acquire`` running at the same time goes first or after, never between)."""
        async with self._session_lock:
            started = time.monotonic()
            try:
                conn = await self._session()
                await self._lock(conn)
                renewed = await asyncio.wait_for(conn.fetchval(
                    "UPDATE scheduler_leadership SET expires_at = clock_timestamp() + make_interval(secs => $2) "
                    "WHERE id = 1 AND epoch = $1 RETURNING epoch", self.epoch, self.lease_s), timeout=self.lease_s)
            except CONNECTION_LOST:
                await self._drop_session()
                raise
        if renewed is None:
            raise LeadershipLost(f"epoch {self.epoch} was superseded")
        self._renewed_at = started

    async def fence(self, conn: Any) -> None:
        """Inside a write transaction on ``conn``: raise ``LeadershipLost`` unless the lease still holds this
        epoch. The row stays locked (FOR SHARE) until that transaction ends, so no takeover lands in between."""
        check_fence(self.epoch, await conn.fetchval(f"SELECT {FENCE_EPOCH}"))

    async def release(self) -> None:
        """End this epoch's lease now and let go of the session lock (best effort: if the database cannot be
        reached the lease expires by itself and the session lock goes with the session)."""
        async with self._session_lock:
            await self._release()

    async def _release(self) -> None:
        epoch, self.epoch = self.epoch, 0
        try:
            if epoch:
                conn = await self._session()
                released = await asyncio.wait_for(conn.fetchval(
                    "UPDATE scheduler_leadership SET expires_at = '-infinity' WHERE id = 1 AND epoch = $1 "
                    "RETURNING epoch", epoch), timeout=self.lease_s)
                if released is not None:
                    log.info("scheduler.lease_released", epoch=epoch)
            if self._locked:
                await self._conn.execute("SELECT pg_advisory_unlock($1)", LEASE_LOCK_KEY)
                self._locked = False
        except Exception as exc:  # noqa: BLE001 - an unreleased lease expires by itself within lease_s
            log.warning("scheduler.lease_not_released", epoch=epoch, error=repr(exc))
            await self._drop_session()

    async def close(self) -> None:
        async with self._session_lock:
            await self._drop_session()
