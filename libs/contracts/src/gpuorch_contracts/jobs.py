"""Job specification and the job lifecycle messages.

A job spec says what a job needs, never where it runs. Exactly one GPU shape applies:
whole GPUs (``gpus`` > 0), a share of one GPU (``gpu_milli`` and/or ``gpu_memory_mib``), a MIG slice
(``mig_profiles``: acceptable profiles, in preference order), or no GPU at all.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field, model_validator

from gpuorch_contracts.arrays import MAX_ARRAY_PARALLELISM, ArraySpec, IndexText
from gpuorch_contracts.envelope import MAX_MESSAGE_BYTES, Message, Strict
from gpuorch_contracts.text import (
    Arg,
    GpuUuid,
    JobName,
    LabelValue,
    MigProfileName,
    Name,
    PathText,
    Seconds,
    ShortText,
    TenantName,
    Token,
)

Tier = Literal["training", "inference", "batch", "interactive"]
PriorityClass = Literal["critical", "high", "normal", "low"]
PRIORITY_VALUE: dict[str, int] = {"critical": 1000, "high": 500, "normal": 100, "low": 10}
"""Numeric priority of each class: higher wins, and only a strictly higher one may preempt."""

JobState = Literal[
    "submitted", "accepted", "rejected", "queued", "placed", "running",
    "preempting", "succeeded", "failed", "cancelled", "lost", "parked",
]
TERMINAL_STATES: frozenset[str] = frozenset({"rejected", "succeeded", "failed", "cancelled"})


DEFAULT_TENANT = "default"
"""What an encoder writes for an omitted ``JobSpec.tenant``; admission and routing treat it as omitted."""

class ProcessRun(Strict):
    """Run an argv array as a process (never a shell string)."""

    runtime: Literal["process"] = "process"
    argv: Annotated[list[Arg], Field(min_length=1, max_length=256)]
    env: Annotated[dict[Name, Arg], Field(max_length=128)] = {}
    workdir: PathText | None = None


class ContainerRun(Strict):
    """Run an image pinned by digest; the executor refuses tags."""

    runtime: Literal["container"] = "container"
    image: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[!-~]+@sha256:[0-9a-f]{64}$")]
    argv: Annotated[list[Arg], Field(max_length=256)] = []
    env: Annotated[dict[Name, Arg], Field(max_length=128)] = {}


AUTO_SHARE_DEFAULT_MIB = 8192
"""The memory of a ``gpu_memory_auto`` share with no history (nor a ``gpu_memory_mib`` of its own)."""


class GpuRequest(Strict):
    """GPUs a job needs on each node it runs on."""

    gpus: int = Field(default=0, ge=0, le=64, description="whole GPUs per node")
    gpu_milli: int | None = Field(default=None, ge=1, le=999, description="share of one GPU, in thousandths")
    gpu_memory_mib: int | None = Field(default=None, ge=1, le=1_048_576, description=(
        "GPU memory of a share; \"auto\" is accepted as input for gpu_memory_auto"))
    gpu_memory_auto: bool = Field(default=False, description=(
        "size the share's memory from use: the API asks for the p95 of the peak GPU memory of earlier runs with the "
        "same name and tenant, or gpu_memory_mib (default AUTO_SHARE_DEFAULT_MIB) without history"))
    mig_profiles: Annotated[list[MigProfileName], Field(max_length=16)] = []
    gpu_models: Annotated[list[Name], Field(max_length=32)] = Field(
        default=[], description="accepted GPU models; empty accepts any"
    )

    @model_validator(mode="before")
    @classmethod
    def _auto_memory(cls, data: object) -> object:
        """``gpu_memory_mib: auto`` (a YAML spec, ``gpuctl submit --share auto``) is ``gpu_memory_auto: true``."""
        if isinstance(data, dict) and data.get("gpu_memory_mib") == "auto":
            data = {k: v for k, v in data.items() if k != "gpu_memory_mib"} | {"gpu_memory_auto": True}
        if isinstance(data, dict) and data.get("gpu_memory_auto") and data.get("gpu_memory_mib") is None:
            data = data | {"gpu_memory_mib": AUTO_SHARE_DEFAULT_MIB}
        return data

    @model_validator(mode="after")
    def _one_shape(self) -> GpuRequest:
        shapes = [self.gpus > 0, self.gpu_milli is not None or self.gpu_memory_mib is not None, bool(self.mig_profiles)]
        if sum(shapes) > 1:
            raise ValueError("ask for whole GPUs, a share, or MIG profiles: only one of them")
        return self

    @property
    def kind(self) -> Literal["none", "whole", "share", "mig"]:
        if self.gpus > 0:
            return "whole"
        if self.mig_profiles:
            return "mig"
        if self.gpu_milli is not None or self.gpu_memory_mib is not None:
            return "share"
        return "none"


MAX_GANG_NODES = 128
MAX_GANG_GPUS = 1024
"""A gang holds at most this many GPUs (or GPU slices) in all, so that the ``JobPlaced`` naming each of them fits
one message (``MAX_MESSAGE_BYTES``) whatever the node ids and GPU uuids."""

MAX_SPEC_BYTES = MAX_MESSAGE_BYTES - 32 * 1024
"""Largest job spec, measured as its JSON encoding (``encode``). Every message that embeds a spec (``SubmitJob``,
``JobAccepted``, ``LaunchJob``) adds at most about 15 KiB to it (envelope, ids, a node id, 64 GPU allocations), so
any admissible spec fits each of them with room to spare; ``libs/contracts/tests`` builds the largest ones to prove
it."""


TOPOLOGY_LABEL_PREFIX = "topology.gpuorch.io/"
"""A node's place in a topology level is its label ``topology.gpuorch.io/<level>`` (``.../rack: r07``)."""


class GangTopology(Strict):
    """Keep a gang's nodes inside one block of a topology level (``rack``, ``block``, ``nvlink-domain``: whatever
    the nodes' ``topology.gpuorch.io/<level>`` labels name): ``required`` waits until one block has room;
    ``preferred`` takes the fewest blocks when no single one has room."""

    required: Name | None = None
    preferred: Name | None = None

    @model_validator(mode="after")
    def _one_level(self) -> GangTopology:
        if (self.required is None) == (self.preferred is None):
            raise ValueError("gang.topology names one level, as required or as preferred")
        return self

    @property
    def level(self) -> str:
        return self.required or self.preferred or ""


class Gang(Strict):
    """All-or-nothing shape: ``nodes`` nodes, each holding ``GpuRequest`` (whole GPUs) for this job."""

    nodes: int = Field(default=1, ge=1, le=MAX_GANG_NODES)
    topology: GangTopology | None = Field(default=None, description=(
        "place the gang inside one block of a topology level: {required: rack} or {preferred: rack}"))


class Checkpoint(Strict):
    """How to ask a job to checkpoint before it is stopped."""

    signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"] = "SIGTERM"
    grace_s: float = Field(default=30.0, ge=0, le=3600)


class ModelHints(Strict):
    """Optional facts about the model, used to estimate memory and advise on precision."""

    parameter_count: int | None = Field(default=None, ge=1, le=10**13)
    dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"] | None = None


DependencyCondition = Literal["afterok", "afternotok", "afterany", "aftercorr"]
MAX_DEPENDENCIES = 64


class Dependency(Strict):
    """Start only once job (or array) ``job_id`` ended in a way ``condition`` accepts (Slurm's ``--dependency``):
    ``afterok`` it succeeded (an array: every task did), ``afternotok`` it ended otherwise, ``afterany`` it ended,
    ``aftercorr`` (an array on an array) task i after task i succeeded. A dependency that can no longer be met
    cancels the dependent job with the reason."""

    condition: DependencyCondition = "afterok"
    job_id: uuid.UUID


class SessionSpec(Strict):
    """An interactive session (tier ``interactive``): a job with a port, reached only through the API's proxy at
    ``/sessions/<job id>/``, parked when idle and resumed on the next request (docs/sessions.md).

    The executor gives the job ``GPUORCH_PORT`` (a free port of its node), ``GPUORCH_BASE_URL`` (``/sessions/<job
    id>/``, the path prefix it is served under) and ``GPUORCH_WORK_DIR`` (its working directory, kept across parks),
    and replaces ``$(GPUORCH_PORT)`` in the argv by the port (no shell)."""

    idle_park_after_s: float | None = Field(default=None, ge=10, le=30 * 86_400, description=(
        "park the session after this long with no proxied request and GPU utilisation below 1 %; None: its "
        "tenant's default (the identity map's session_idle_park_s, else the scheduler's settings)"))
    strip_prefix: bool = Field(default=True, description=(
        "forward requests without the /sessions/<id> prefix (an app that knows nothing of it, http.server); "
        "False keeps it (an app told GPUORCH_BASE_URL, such as Jupyter's --ServerApp.base_url)"))
    owner: Name | None = Field(default=None, description=(
        "set by the scheduler at admission to the verified identity that submitted it (a value in a submission "
        "is replaced): the per-user session caps of the identity map count by it"))


class JobSpec(Strict):
    """What a job needs and what it runs.

    ``tenant`` and ``priority_class`` are checked against the publisher's identity at admission
    (``gpuorch_identity.authorize_submission``): a ``SubmitJob`` whose spec omits ``tenant`` gets the publisher's
    default tenant, one naming a tenant its publisher may not use is rejected. In every message the scheduler sends
    afterwards (``JobAccepted``, ``LaunchJob``) the tenant is the verified one.
    """

    name: JobName = "job"
    tenant: TenantName = Field(default=DEFAULT_TENANT, description=(
        "the team the job runs for; omit it to use the publisher's default tenant (from the identity map); a "
        "tenant the publisher may not submit for is rejected"))
    tier: Tier = "batch"
    priority_class: PriorityClass = "normal"
    resources: GpuRequest = GpuRequest()
    cpu_milli: int = Field(default=1000, ge=0, le=1_024_000)
    memory_mib: int = Field(default=1024, ge=0, le=16_777_216)
    gang: Gang = Gang()
    preemptible: bool = False
    runtime_estimate_s: float | None = Field(default=None, gt=0, le=10**8)
    max_runtime_s: float | None = Field(default=None, gt=0, le=10**8)
    max_requeues: int = Field(default=3, ge=0, le=100)
    checkpoint: Checkpoint = Checkpoint()
    run: ProcessRun | ContainerRun = Field(discriminator="runtime")
    model: ModelHints | None = None
    labels: Annotated[dict[Name, LabelValue], Field(max_length=64)] = {}
    array: ArraySpec | None = Field(default=None, description=(
        "run this spec as an array of tasks, one per index (each its own job id: arrays.array_task_id)"))
    depends_on: Annotated[list[Dependency], Field(max_length=MAX_DEPENDENCIES)] = Field(default=[], description=(
        f"jobs or arrays (at most {MAX_DEPENDENCIES}) this job waits for, each with a condition"))
    session: SessionSpec | None = Field(default=None, description=(
        "an interactive session's port and parking (tier interactive; an interactive job without it gets the "
        "defaults)"))

    @model_validator(mode="after")
    def _session_is_interactive(self) -> JobSpec:
        if self.session is not None and self.tier != "interactive":
            raise ValueError("session settings are for tier interactive only")
        if self.tier == "interactive" and (self.array is not None or self.gang.nodes > 1):
            raise ValueError("an interactive session is one job on one node: no array, no gang")
        return self

    @model_validator(mode="after")
    def _fits_every_message(self) -> JobSpec:
        gang_gpus = self.gang.nodes * max(self.resources.gpus, 1)
        if gang_gpus > MAX_GANG_GPUS:
            raise ValueError(f"the gang asks for {gang_gpus} GPUs ({self.gang.nodes} nodes x "
                             f"{max(self.resources.gpus, 1)}); at most {MAX_GANG_GPUS} in all")
        size = len(self.__pydantic_serializer__.to_json(self))
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"the spec is {size} bytes as JSON; at most {MAX_SPEC_BYTES} (argv, env and labels "
                             "together must be smaller)")
        return self


class TenantRouted(Message):
    """A job lifecycle event routed per tenant: with ``tenant`` set its routing key is ``<type>.<tenant>``
    (``job.started.acme``), so a submitter binds ``job.*.<its tenant>`` and reads only its own jobs' events;
    consumers of every tenant bind ``<type>.#`` (which also matches the bare ``<type>`` of an event without one)."""

    tenant: TenantName | None = Field(default=None, description=(
        "the job's verified tenant; routes the event as <type>.<tenant> on gpuorch.events"))


class SubmitJob(Message):
    """Public entry point: ask gpuorch to run a job.

    Published to exchange ``gpuorch.submit`` with routing key ``job.submit``. ``job_id`` is chosen by the
    submitter (a UUID) so that it is known before any answer; re-sending the same ``message_id`` or ``job_id``
    submits once. Answers arrive as ``job.accepted`` or ``job.rejected`` events.
    """

    TYPE = "job.submit"
    type: Literal["job.submit"] = "job.submit"
    job_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    spec: JobSpec
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity (identity map name) a gateway submits for, after authenticating it (the API with a token); "
        "honoured only when the publisher's own identity is a gateway or an operator, refused from anyone else"))


class CancelJob(Message):
    """Ask the scheduler to cancel a job (stopping it where it runs)."""

    TYPE = "job.cancel"
    type: Literal["job.cancel"] = "job.cancel"
    job_id: uuid.UUID
    reason: ShortText = "cancelled by user"
    array_tasks: IndexText | None = Field(default=None, description=(
        "with the id of an array: cancel only these tasks (0-9, 3, ...); None cancels the whole array"))
    tenant: TenantName | None = Field(default=None, description=(
        "the job's tenant, if the canceller knows it: routes the cancel as job.cancel.<tenant>, in the same lane "
        "as that tenant's submissions (so it cannot overtake them); the scheduler checks the job's own tenant"))
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity a gateway cancels for (see SubmitJob.on_behalf_of)"))


class SetArrayParallelism(Message):
    """Change how many tasks of an array may run at once. Who may send it: whoever may cancel the array (its
    tenant's submitters, operators). Tasks already running keep running when it is lowered."""

    TYPE = "job.array_set"
    type: Literal["job.array_set"] = "job.array_set"
    job_id: uuid.UUID = Field(description="the array's job id")
    parallelism: int | None = Field(ge=1, le=MAX_ARRAY_PARALLELISM, description="None: as many as fit")
    tenant: TenantName | None = Field(default=None, description="routes it as CancelJob.tenant does")
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity a gateway acts for (see SubmitJob.on_behalf_of)"))


class SetJobPriority(Message):
    """Change the priority class of a job that has not ended. Who may send it: operators only (a tenant's own
    ceiling, ``max_priority``, bounds what it submits; moving a job past others is the operators' call). From the
    change on, the job's place in the queue and which jobs it may preempt, or be preempted by, follow the new class."""

    TYPE = "job.priority_set"
    type: Literal["job.priority_set"] = "job.priority_set"
    job_id: uuid.UUID
    priority_class: PriorityClass
    tenant: TenantName | None = Field(default=None, description="routes it as CancelJob.tenant does")
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity a gateway acts for (see SubmitJob.on_behalf_of)"))


class JobAccepted(TenantRouted):
    TYPE = "job.accepted"
    type: Literal["job.accepted"] = "job.accepted"
    job_id: uuid.UUID
    spec: JobSpec


class JobRejected(TenantRouted):
    TYPE = "job.rejected"
    type: Literal["job.rejected"] = "job.rejected"
    job_id: uuid.UUID
    reason: ShortText


AMQP_ID_PATTERN = r"^[\x21-\x7e]{1,255}$"
"""An AMQP ``message-id``/``correlation-id`` as an answer repeats it: printable ASCII without spaces, at most 255
bytes (a short string); an id outside it is left out of the answer."""


class SubmissionRejected(TenantRouted):
    """A submission refused before anything could be read from it: oversized or undecodable, with no ``job_id`` to
    answer with a ``JobRejected`` (issue 30). Sent by whoever consumed it (the scheduler) to its *publisher's*
    tenant, taken from the delivery's verified AMQP ``user_id`` (``job.submission_rejected.<tenant>``, which a
    submitter's ``job.*.<tenant>`` binding receives), never to a tenant its bytes name. The submitter recognises its
    message by ``submission_message_id`` (the AMQP ``message-id`` it published with; every gpuorch client sets it)
    or ``correlation_id``. Not in the scheduler's event log: no job ever existed."""

    TYPE = "job.submission_rejected"
    type: Literal["job.submission_rejected"] = "job.submission_rejected"
    submission_message_id: str | None = Field(default=None, max_length=255, pattern=AMQP_ID_PATTERN, description=(
        "the AMQP message-id of the refused delivery"))
    correlation_id: str | None = Field(default=None, max_length=255, pattern=AMQP_ID_PATTERN, description=(
        "the AMQP correlation-id of the refused delivery, if it had one"))
    size_bytes: int = Field(ge=0, le=2**31, description="the size of the refused body")
    reason: ShortText


class JobQueued(TenantRouted):
    """The job waits; ``pending_reason`` says why in plain words, ``estimated_start`` when it may start."""

    TYPE = "job.queued"
    type: Literal["job.queued"] = "job.queued"
    job_id: uuid.UUID
    pending_reason: ShortText
    estimated_start_s: float | None = Field(default=None, ge=0, le=10**11,
                                            description="when the job may start: Unix time, in seconds")


class GpuAllocation(Strict):
    """One GPU (or MIG instance) given to a placement: ``milli`` = 1000 for a whole GPU."""

    gpu_uuid: GpuUuid
    gpu_index: int = Field(ge=0, le=1024)
    milli: int = Field(default=1000, ge=1, le=1000)
    memory_mib: int | None = Field(default=None, ge=0, le=16_777_216)
    mig_profile: MigProfileName | None = None


MIG_COMPUTE_SLICES_PER_GPU = 7
"""Compute slices of a whole GPU on every MIG-capable model of the fleet (A100, H100: NVIDIA's MIG tables in
``gpuorch_policy.mig_profiles``, ``MIG_COMPUTE_SLICES``)."""


def gpu_equivalents(milli: int, mig_profile: str | None) -> float:
    """The share of one GPU an allocation holds: a whole GPU 1.0, a share ``milli / 1000``, a MIG instance its
    compute slices over the GPU's 7 (``3g.40gb``: 3/7, ``1c.2g.20gb``: its compute instance's 1/7). A profile name
    without a slice count falls back to ``milli / 1000``. Not rounded."""
    if mig_profile:
        parts = mig_profile.split(".")
        counts = [p[:-1] for p in parts if p[-1:] in ("c", "g") and p[:-1].isdigit()]
        if counts:
            return min(1.0, int(counts[0]) / MIG_COMPUTE_SLICES_PER_GPU)
    return milli / 1000.0


class NodeAssignment(Strict):
    node_id: Name
    gpus: Annotated[list[GpuAllocation], Field(max_length=64)] = []


class JobPlaced(TenantRouted):
    TYPE = "job.placed"
    type: Literal["job.placed"] = "job.placed"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    assignments: Annotated[list[NodeAssignment], Field(min_length=1, max_length=1024)]


class JobStarted(TenantRouted):
    TYPE = "job.started"
    type: Literal["job.started"] = "job.started"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    node_id: Name
    pid: int | None = Field(default=None, ge=0, le=2**31 - 1)
    container_id: Token | None = None
    log_path: PathText | None = None


class JobFinished(TenantRouted):
    TYPE = "job.finished"
    type: Literal["job.finished"] = "job.finished"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    node_id: Name
    exit_code: int = Field(ge=-(2**31), le=2**31 - 1)
    duration_s: Seconds


FailureCause = Literal[
    "nonzero_exit", "killed", "host_oom", "gpu_oom", "launch_error", "refused", "max_runtime", "gpu_error", "lost",
]


class JobFailed(TenantRouted):
    TYPE = "job.failed"
    type: Literal["job.failed"] = "job.failed"
    job_id: uuid.UUID
    placement_id: uuid.UUID | None = None
    node_id: Name | None = None
    cause: FailureCause
    reason: ShortText
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    duration_s: Seconds | None = None
    stop_reason: Literal["cancel", "preempt", "max_runtime", "drain", "fenced", "gpu_memory_exceeded"] | None = Field(
        default=None, description="set by the executor when the placement ended because it was stopped "
        "(a StopJob's reason, max runtime, fencing, or its share's GPU memory watchdog); None when the job ended "
        "by itself",
    )
    gpu_memory_peak_mib: int | None = Field(default=None, ge=0, le=16_777_216, description=(
        "with stop_reason gpu_memory_exceeded: the most GPU memory the job's processes held, in MiB (the "
        "scheduler sizes the job's next ask from it)"))


class JobCheckpointed(TenantRouted):
    """The job confirmed a checkpoint after the checkpoint signal (executor saw its confirmation file)."""

    TYPE = "job.checkpointed"
    type: Literal["job.checkpointed"] = "job.checkpointed"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    node_id: Name


class JobLost(TenantRouted):
    """The executor found that a placement it had started no longer runs and left no exit status."""

    TYPE = "job.lost"
    type: Literal["job.lost"] = "job.lost"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    node_id: Name
    reason: ShortText


class JobPreempting(TenantRouted):
    TYPE = "job.preempting"
    type: Literal["job.preempting"] = "job.preempting"
    job_id: uuid.UUID
    placement_id: uuid.UUID
    reason: ShortText
    preempted_by: uuid.UUID | None = Field(default=None, description=(
        "the waiting job this placement makes room for; None from a scheduler older than this field"))
    park: bool = Field(default=False, description=(
        "an interactive session stopped to be parked (idle, or asked): once stopped it is parked, not requeued"))


class JobRequeued(TenantRouted):
    TYPE = "job.requeued"
    type: Literal["job.requeued"] = "job.requeued"
    job_id: uuid.UUID
    reason: ShortText
    requeues: int = Field(ge=0, le=10**6)
    preempted: bool = Field(
        default=False, description="requeued after a preemption (does not count against max_requeues)",
    )
    resources: GpuRequest | None = Field(default=None, description=(
        "the GPU ask the job is queued with from now on, when the requeue changed it (a share escalated after it "
        "outgrew its GPU memory); None keeps the ask it had"))


class JobCancelled(TenantRouted):
    """A job ended by a cancel (or by a dependency that can never be met). For an array: its tasks not yet started
    (only ``array_tasks`` among them when set) will never run; each task already started has its own event."""

    TYPE = "job.cancelled"
    type: Literal["job.cancelled"] = "job.cancelled"
    job_id: uuid.UUID
    reason: ShortText
    array_tasks: IndexText | None = None


class ArrayParallelismChanged(TenantRouted):
    """An array's parallelism was changed (``SetArrayParallelism``)."""

    TYPE = "job.array_parallelism_changed"
    type: Literal["job.array_parallelism_changed"] = "job.array_parallelism_changed"
    job_id: uuid.UUID
    parallelism: int | None = Field(ge=1, le=MAX_ARRAY_PARALLELISM)


class JobPriorityChanged(TenantRouted):
    """A job's priority class was changed (``SetJobPriority``): the scheduler orders and preempts by the new one."""

    TYPE = "job.priority_changed"
    type: Literal["job.priority_changed"] = "job.priority_changed"
    job_id: uuid.UUID
    priority_class: PriorityClass
    previous: PriorityClass


SessionAction = Literal["park", "resume"]


class ChangeSession(Message):
    """Park a running interactive session (checkpoint stop, GPU freed, work directory kept) or resume a parked one
    (queued again, placed where room is). Who may send it: whoever may cancel the job (its tenant's submitters,
    operators); travels on ``gpuorch.submit`` as ``job.session[.<tenant>]``, which no tenant lane binds (the
    shared lane)."""

    TYPE = "job.session"
    type: Literal["job.session"] = "job.session"
    job_id: uuid.UUID
    action: SessionAction
    reason: ShortText = "asked by its owner"
    tenant: TenantName | None = Field(default=None, description="routes it as CancelJob.tenant does")
    on_behalf_of: Name | None = Field(default=None, description=(
        "the identity a gateway acts for (see SubmitJob.on_behalf_of)"))


class SessionParked(TenantRouted):
    """An interactive session's placement ended for a park: it holds no GPU and waits for a resume (a
    ``JobRequeued`` with ``reason`` ``resumed``). ``gpu_count`` and ``parked_at`` let the report count the GPU hours
    given back."""

    TYPE = "job.session_parked"
    type: Literal["job.session_parked"] = "job.session_parked"
    job_id: uuid.UUID
    reason: ShortText
    node_id: Name | None = Field(default=None, description="the node it last ran on (its work directory's node)")
    gpus: float = Field(default=0.0, ge=0, le=MAX_GANG_GPUS, description="GPUs (fractions for shares) it gave back")
