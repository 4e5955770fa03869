"""The journal: exactly what a running scheduler was given, so that a replay decides exactly what it decided.

    service (GPUORCH_STEP_JOURNAL)                         replay (``play``, the Harness's playback mode)
    ───────────────────────────────                        ─────────────────────────────────────────────
    recovered(position, lease_now)   ──► entry "recovered" ──► Scheduler.recovered(state, lease_now)
    a node's or executor's heartbeat ──► entry "renewed"   ──► Scheduler.node_heartbeat / executor_heartbeat
    a committed step (inputs, senders, traces, now,        ──► Scheduler.step(same inputs, same times, same known)
      lease_now, tick, what the log already held, the        (the MIG peaks given first)
      MIG peaks it planned with)

Entries are JSON-safe dicts, one per line in the service's file, in the order things happened to the scheduler (a
step is placed where it ran, even when a heartbeat was handled while its transaction committed). Only committed
steps are entries: a step whose transaction failed was rolled back, and the live scheduler rebuilt its state from
the log. Pure: encoding and playing; the service writes the file.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import MESSAGE_TYPES, ExecutorHeartbeat, GpuLive, Message, NodeHeartbeat

from gpuorch_scheduling.scheduler import Scheduler
from gpuorch_scheduling.step import Input, Known, Step

Entry = dict[str, Any]


def recovered_entry(position: int, lease_now: float) -> Entry:
    return {"kind": "recovered", "position": position, "lease_now": lease_now}


def renewed_entry(beat: NodeHeartbeat | ExecutorHeartbeat, lease_now: float) -> Entry:
    if isinstance(beat, NodeHeartbeat):
        entry: Entry = {"kind": "renewed", "node_id": beat.node_id, "lease_now": lease_now}
        if any(g.utilization_pct is not None for g in beat.gpus):  # idle sessions are judged by it (``sessions``)
            entry["utilization"] = [[g.index, g.utilization_pct] for g in beat.gpus]
        return entry
    return {"kind": "renewed", "executor": beat.model_dump(mode="json"), "lease_now": lease_now}


def step_entry(inputs: Sequence[Input], now: float, lease_now: float, tick: bool, known: Known,
               peaks: dict[str, int] | None) -> Entry:
    entry: Entry = {
        "kind": "step", "now": now, "lease_now": lease_now, "tick": tick,
        "inputs": [{"message": i.message.model_dump(mode="json"), "sender": i.sender,
                    "trace": dict(i.trace) if i.trace else None} for i in inputs],
    }
    if known.logged_ids or known.known_jobs:
        entry["known"] = {"logged_ids": sorted(map(str, known.logged_ids)),
                          "known_jobs": sorted(map(str, known.known_jobs))}
    if peaks:
        entry["peaks"] = dict(peaks)
    return entry


@dataclass
class Played:
    """What a replay decided: every step, in order."""

    steps: list[Step] = field(default_factory=list)

    @property
    def logged(self) -> list[Message]:
        """Every event the replay logged, in order (incoming facts and decisions)."""
        return [event for step in self.steps for event, _ in step.events]

    @property
    def published(self) -> list[Message]:
        return [message for step in self.steps for message in step.outgoing]


def play(scheduler: Scheduler, entries: Iterable[Entry]) -> Played:
    """Feed ``entries`` to ``scheduler`` (fresh, or as the journal began) and collect what it decides."""
    played = Played()
    for entry in entries:
        kind = entry["kind"]
        if kind == "recovered":
            scheduler.recovered(scheduler.state, entry["lease_now"])
        elif kind == "renewed":
            if "executor" in entry:
                scheduler.executor_heartbeat(ExecutorHeartbeat.model_validate(entry["executor"]), entry["lease_now"])
            else:
                scheduler.node_heartbeat(entry["node_id"], entry["lease_now"], [
                    GpuLive(index=i, utilization_pct=u) for i, u in entry.get("utilization", [])])
        elif kind == "step":
            if "peaks" in entry:
                scheduler.mig.peaks = dict(entry["peaks"])
            played.steps.append(scheduler.step(list(_inputs(entry)), entry["now"], lease_now=entry["lease_now"],
                                               tick=entry["tick"], known=_known(entry)))
        else:
            raise ValueError(f"a journal holds no {kind!r} entries")
    return played


def _inputs(entry: Entry) -> Iterator[Input]:
    for raw in entry["inputs"]:
        message = raw["message"]
        yield Input(MESSAGE_TYPES[message["type"]].model_validate(message), raw.get("sender"), raw.get("trace"))


def _known(entry: Entry) -> Known:
    raw = entry.get("known") or {}
    return Known({uuid.UUID(v) for v in raw.get("logged_ids", [])}, {uuid.UUID(v) for v in raw.get("known_jobs", [])})
