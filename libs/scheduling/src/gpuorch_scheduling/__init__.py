"""gpuorch_scheduling: the scheduler without I/O (see README.md for the pipeline).

The state and its fold (``SchedulerState``; job arrays: ``ArrayRecord``), the scheduling cycle (``schedule``), the
decisions around it (admission, cancel, requeue, dependencies, liveness, runtime limits, MIG layouts) and the plan
applier. No broker, no database, no
clock: time is passed in.
"""

from gpuorch_scheduling.arrays import ArrayRecord
from gpuorch_scheduling.cycle import CycleLimits, CycleResult, Waiting, schedule
from gpuorch_scheduling.decisions import (
    Decision,
    admit,
    after_lost,
    after_stop_confirmed,
    cancel,
    decision_id,
    preemption_timeouts,
    requeue_or_fail,
)
from gpuorch_scheduling.liveness import ExecutorLease, Leases, LivenessPolicy, liveness, overdue
from gpuorch_scheduling.queueing import QueuePolicy, Quota, SubmissionRates, TenantUsage, fair_order
from gpuorch_scheduling.state import DEFAULT_RETENTION_S, JobRecord, NodeRecord, SchedulerState

__all__ = [
    "DEFAULT_RETENTION_S",
    "ArrayRecord",
    "CycleLimits",
    "CycleResult",
    "Decision",
    "ExecutorLease",
    "JobRecord",
    "Leases",
    "LivenessPolicy",
    "NodeRecord",
    "QueuePolicy",
    "Quota",
    "SchedulerState",
    "SubmissionRates",
    "TenantUsage",
    "Waiting",
    "admit",
    "after_lost",
    "after_stop_confirmed",
    "cancel",
    "decision_id",
    "fair_order",
    "liveness",
    "overdue",
    "preemption_timeouts",
    "requeue_or_fail",
    "schedule",
]
