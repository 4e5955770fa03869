"""The database half of one step, inside the batch's transaction: what the database already holds of the batch, read
first under the leader's fence, and the step made durable. Few round trips: under load each one is a wait on
PostgreSQL's share of the cores, and every message of the batch (and of the batch behind it) waits for all of them.

    read_known(conn, inputs, state, fence_epoch)     ONE statement: the lease row's epoch FOR SHARE (the fence),
                                                     which logged messages the log holds, which submissions the
                                                     jobs read model holds
    StepWriter.write(conn, step, decided, ...)       log + outbox in ONE statement (``append_with_outbox``), then the
                                                     read models (``readmodels``; the same transaction, so a read
                                                     model never shows a decision the log does not hold)
"""

from __future__ import annotations

from typing import Any

from gpuorch_contracts import ChangeSession, Message, SubmitJob, encode
from gpuorch_scheduling import SchedulerState
from gpuorch_scheduling.scheduler import LOGGED_INCOMING, Scheduler
from gpuorch_scheduling.sessions import OverCap
from gpuorch_scheduling.step import Input, Known, Step
from gpuorch_store import NewEvent, append_with_outbox

from gpuorch_scheduler import readmodels, tracing
from gpuorch_scheduler.leadership import FENCE_EPOCH, check_fence

STREAM = "scheduler"

_KNOWN = """
SELECT {fence} AS epoch,
       ARRAY(SELECT message_id FROM events WHERE message_id = ANY($1::uuid[])) AS logged,
       ARRAY(SELECT job_id FROM jobs WHERE job_id = ANY($2::uuid[])) AS known_jobs
"""
_KNOWN_FENCED, _KNOWN_UNFENCED = _KNOWN.format(fence=FENCE_EPOCH), _KNOWN.format(fence="NULL::bigint")


async def read_known(conn: Any, inputs: list[Input], state: SchedulerState, fence_epoch: int | None) -> Known:
    """The first statement of a batch's transaction. With ``fence_epoch``: raises ``LeadershipLost`` unless the
    lease row still holds that epoch, and keeps the row locked (FOR SHARE) until the transaction ends, so no
    takeover lands in between (``leadership.LeaderLease.fence``). Returns which of the batch's logged messages the
    log already holds and which of its new submissions the jobs read model holds (accepted or rejected before).
    Without a fence and with nothing to look up, no statement at all."""
    known = Known()
    logged = [i.message.message_id for i in inputs if isinstance(i.message, LOGGED_INCOMING)]
    submitted = [i.message.job_id for i in inputs
                 if isinstance(i.message, SubmitJob) and i.message.job_id not in state.jobs]
    if fence_epoch is None and not logged and not submitted:
        return known
    row = await conn.fetchrow(_KNOWN_UNFENCED if fence_epoch is None else _KNOWN_FENCED, logged, submitted)
    if fence_epoch is not None:
        check_fence(fence_epoch, row["epoch"])
    known.logged_ids.update(row["logged"])
    known.known_jobs = set(row["known_jobs"])
    return known


class StepWriter:
    """Writes steps (inside the open transaction) for one ``Scheduler``; remembers when the fair-share row was
    last written. Commands carry ``leader_epoch`` (executors refuse older ones)."""

    def __init__(self, scheduler: Scheduler, leader_epoch: int = 0) -> None:
        self.scheduler = scheduler
        self.leader_epoch = leader_epoch
        self.fair_share_written_at = -float("inf")

    async def write(self, conn: Any, step: Step, decided: dict[Any, str], *, isolation: dict[str, str],
                    unwritten: set[str], resume_refused: dict[Any, str]) -> list[int]:
        """The step, durable: log and outbox (one statement), read models; ``isolation``: per node, its isolation
        JSON, of which the nodes in ``unwritten`` are written (and removed from it); ``resume_refused`` as
        ``SchedulerService.resume_refused`` (updated here from the step). Returns the new events' positions;
        raises if an event applied in memory was already in the log (the caller reloads)."""
        scheduler, state = self.scheduler, self.scheduler.state
        logged_headers = {id(e): tracing.headers_of(e, h, decided) for e, h in step.events}
        events = [NewEvent.from_message(STREAM, e, headers=logged_headers[id(e)]) for e, _ in step.events]
        logged_json = {id(e): new.payload for (e, _), new in zip(step.events, events, strict=True)}
        outgoing = step.outgoing
        positions = await append_with_outbox(
            conn, events, outgoing,
            headers=[logged_headers.get(id(m)) or tracing.headers_of(m, scheduler.trace_of(m), decided)
                     for m in outgoing],
            bodies=[_encoded(logged_json.get(id(m)), self._stamped(m)) for m in outgoing])
        if any(p is None for p in positions):
            raise RuntimeError("an event applied in memory was already in the log; reloading")
        note_resume_refusals(step, state, resume_refused)
        await readmodels.write_jobs_and_nodes(conn, state, scheduler.pending, step.touched_jobs,
                                              step.touched_nodes, step.rejected, step.submitted, resume_refused)
        rows = {n: isolation[n] for n in unwritten if n in state.nodes}
        if rows:
            await readmodels.write_isolation(conn, rows)
            unwritten -= set(rows)
        if step.mig_changed:
            await readmodels.write_mig_plan(conn, scheduler.config.mig.mode, scheduler.mig.read_model(), state)
        if any(e.TYPE.startswith("reservation.") for e in step.decided):
            await readmodels.write_reservations(conn, step.decided)
        if step.now - self.fair_share_written_at >= readmodels.FAIR_SHARE_EVERY_S:
            await readmodels.write_fair_share(conn, state, scheduler.config.queues.fair_share, step.now)
            self.fair_share_written_at = step.now
        return [p for p in positions if p is not None]

    def writes_nothing(self, step: Step, *, unwritten: set[str], resume_refused: dict[Any, str]) -> bool:
        """Whether ``write`` would write nothing for ``step`` (checked in the same terms as ``write``, kept beside
        it): no event, nothing to publish, no read-model row, no isolation row of a known node in ``unwritten``, no
        fair-share row due. Notes the step's refused resumes first (``note_resume_refusals``; they touch rows)."""
        state = self.scheduler.state
        note_resume_refusals(step, state, resume_refused)
        return not (step.events or step.outgoing or step.touched_jobs or step.touched_nodes or step.rejected
                    or step.submitted or step.mig_changed or unwritten & state.nodes.keys()
                    or any(e.TYPE.startswith("reservation.") for e in step.decided)
                    or step.now - self.fair_share_written_at >= readmodels.FAIR_SHARE_EVERY_S)

    def _stamped(self, message: Message) -> Message:
        """A command carries the epoch of the leader that decided it; other messages go as they are."""
        if self.leader_epoch and "leader_epoch" in type(message).model_fields:
            return message.model_copy(update={"leader_epoch": self.leader_epoch})
        return message


def note_resume_refusals(step: Step, state: SchedulerState, resume_refused: dict[Any, str]) -> None:
    """Remember this step's resumes refused by their owner's caps (their rows are rewritten with it); forget those
    of sessions no longer parked."""
    for message, why in step.ignored:
        if isinstance(message, ChangeSession) and isinstance(why, OverCap):
            resume_refused[message.job_id] = f"resume refused: {why}"[:1000]
            step.touched_jobs.add(message.job_id)
    for job_id in [j for j in resume_refused if getattr(state.jobs.get(j), "state", None) != "parked"]:
        del resume_refused[job_id]


def _encoded(logged: object, message: Message) -> bytes:
    """The body of ``message``: the JSON it was logged with, if it was logged in this step."""
    return logged.encode() if isinstance(logged, str) else encode(message)

