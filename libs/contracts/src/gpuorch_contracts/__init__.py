"""gpuorch message contracts: the envelope, job specs, node inventory, commands, and their routing.

Import models from here; ``decode`` turns a body into the right model, ``route`` says where a message goes.
``output_tail_text`` makes untrusted text (a job's output, a library's error) fit a free-text field; the string
types themselves live in ``gpuorch_contracts.text``.
"""

from gpuorch_contracts.arrays import ArraySpec, ArrayTask, array_task_id, parse_array, parse_indices
from gpuorch_contracts.capacity import FleetScaleRequested
from gpuorch_contracts.commands import ApplyMigLayout, LaunchJob, MigGpuLayout, StopJob
from gpuorch_contracts.envelope import MAX_MESSAGE_BYTES, Message, utc_now
from gpuorch_contracts.jobs import (
    AUTO_SHARE_DEFAULT_MIB,
    MAX_DEPENDENCIES,
    MAX_GANG_GPUS,
    MAX_GANG_NODES,
    MAX_SPEC_BYTES,
    PRIORITY_VALUE,
    TERMINAL_STATES,
    TOPOLOGY_LABEL_PREFIX,
    ArrayParallelismChanged,
    CancelJob,
    ChangeSession,
    Checkpoint,
    ContainerRun,
    Dependency,
    Gang,
    GangTopology,
    GpuAllocation,
    GpuRequest,
    JobAccepted,
    JobCancelled,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobPlaced,
    JobPreempting,
    JobPriorityChanged,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobSpec,
    JobStarted,
    ModelHints,
    NodeAssignment,
    ProcessRun,
    SessionParked,
    SessionSpec,
    SetArrayParallelism,
    SetJobPriority,
    SubmissionRejected,
    SubmitJob,
)
from gpuorch_contracts.nodes import (
    ExecutorHeartbeat,
    FleetAlert,
    GpuHealthChanged,
    GpuInfo,
    GpuLive,
    GpuSample,
    GpuUsageSampled,
    JobIsolation,
    MigGpuOutcome,
    MigInstance,
    MigLayoutApplied,
    MigPlanProposed,
    MigProposalView,
    MigReconfiguration,
    MigSlot,
    NodeHeartbeat,
    NodeInventory,
    NodeLivenessChanged,
    NodeRegistered,
    ProcessUsage,
    RunningPlacement,
)
from gpuorch_contracts.reservations import (
    CreateReservation,
    DeleteReservation,
    ReservationCreated,
    ReservationDeleted,
    ReservationRefused,
)
from gpuorch_contracts.routing import (
    COMMANDS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    EVENTS_EXCHANGE,
    MESSAGE_TYPES,
    SUBMIT_EXCHANGE,
    SUBMIT_SHARED_EXCHANGE,
    TENANT_ROUTED_TYPES,
    UnknownMessageType,
    decode,
    encode,
    event_binding,
    route,
    submit_routing_key,
    tenant_binding,
)
from gpuorch_contracts.telemetry import AlertRaised, AlertResolved, RecommendationMade
from gpuorch_contracts.text import output_tail_text, reason_text, strip_terminal_controls

__all__ = [
    "AUTO_SHARE_DEFAULT_MIB", "COMMANDS_EXCHANGE", "DEAD_LETTER_EXCHANGE", "EVENTS_EXCHANGE", "MAX_MESSAGE_BYTES", "MESSAGE_TYPES",
    "PRIORITY_VALUE", "SUBMIT_EXCHANGE", "SUBMIT_SHARED_EXCHANGE", "TERMINAL_STATES",
    "ApplyMigLayout", "ExecutorHeartbeat", "FleetAlert", "MigGpuOutcome", "MigLayoutApplied", "MigPlanProposed", "MigProposalView", "MigReconfiguration", "MigSlot",
    "NodeLivenessChanged", "CancelJob", "Checkpoint", "ContainerRun", "Gang", "GpuAllocation", "GpuHealthChanged",
    "GpuInfo", "GpuLive", "GpuRequest", "GpuSample", "GpuUsageSampled", "JobAccepted", "JobCancelled",
    "JobCheckpointed", "JobFailed", "JobFinished", "JobLost", "JobPlaced", "JobPreempting", "JobQueued",
    "JobRejected", "JobRequeued", "JobSpec", "JobStarted", "LaunchJob", "Message", "MigGpuLayout", "MigInstance",
    "ModelHints", "NodeAssignment", "NodeHeartbeat", "NodeInventory", "NodeRegistered", "ProcessRun",
    "ProcessUsage", "JobIsolation", "RunningPlacement", "StopJob", "SubmissionRejected", "SubmitJob", "UnknownMessageType", "decode", "encode", "route", "utc_now",
    "AlertRaised", "AlertResolved", "RecommendationMade", "FleetScaleRequested",
    "MAX_GANG_GPUS", "MAX_GANG_NODES", "MAX_SPEC_BYTES", "output_tail_text", "reason_text",
    "strip_terminal_controls", "TENANT_ROUTED_TYPES", "ArraySpec", "ArrayTask", "array_task_id", "parse_array",
    "CreateReservation", "DeleteReservation", "ReservationCreated", "ReservationDeleted", "ReservationRefused",
    "GangTopology", "TOPOLOGY_LABEL_PREFIX", "parse_indices", "MAX_DEPENDENCIES", "ArrayParallelismChanged",
    "Dependency", "SetArrayParallelism", "SetJobPriority", "JobPriorityChanged", "ChangeSession", "SessionParked", "SessionSpec", "event_binding",
    "submit_routing_key", "tenant_binding",
]
