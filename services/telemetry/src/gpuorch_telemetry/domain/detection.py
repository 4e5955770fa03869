"""Detection rules: from a window of a job's usage to findings with plain explanations and their numbers.

``evaluate_job`` is pure: it gets the job's facts, one ``DeviceWindow`` per allocated device (aggregates over the
last ``DetectionConfig.window_s``) and returns the findings that hold now plus the kinds it could judge and found
clear (so their open alerts can be resolved). A rule without enough data neither fires nor clears. The
``contended`` rule (a share slowed by a neighbour share on a saturated GPU) also reads the neighbours' windows.

GPU health (``gpu_unhealthy``) is not windowed: it comes from ``gpu.health_changed`` events and from samples that
report uncorrectable ECC errors or row remapping (``gpu_health_findings``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpuorch_telemetry.domain.sizing import smallest_fit, weights_memory_mib

Category = Literal["alert", "recommendation"]
Severity = Literal["info", "warning", "critical"]

IDLE = "idle"
OVERSIZED = "oversized"
STARVED = "starved"
THROTTLED = "throttled"
MEMORY_PRESSURE = "memory_pressure"
CONTENDED = "contended"
GPU_UNHEALTHY = "gpu_unhealthy"
JOB_KINDS = (IDLE, OVERSIZED, STARVED, THROTTLED, MEMORY_PRESSURE, CONTENDED)


@dataclass(frozen=True)
class DetectionConfig:
    """Thresholds of every rule. Environment variables ``GPUORCH_TELEMETRY_<FIELD>`` override them."""

    window_s: float = 600.0
    """Length of the window the windowed rules look at."""
    min_coverage: float = 0.8
    """A rule judges only when samples span at least this fraction of the window."""
    idle_util_pct: float = 5.0
    """Below this mean utilisation of the allocation (or with no process at all) a job is idle."""
    oversized_min_observed_s: float = 1800.0
    """Oversized advice waits until the job ran this long, so that its peak is representative."""
    oversized_peak_ratio: float = 0.5
    """Peak memory below this fraction of the allocated memory is oversized."""
    headroom: float = 0.2
    """Added to the peak when choosing what fits (0.2 = 20 %)."""
    starved_util_pct: float = 40.0
    starved_cpu_busy_ratio: float = 0.85
    """Host CPU at or above this fraction of the job's requested CPU counts as busy."""
    starved_io_wait_pct: float = 25.0
    throttle_fraction: float = 0.5
    """Throttled for at least this fraction of the window's samples."""
    pressure_memory_ratio: float = 0.9
    pressure_fraction: float = 0.5
    """Memory above ``pressure_memory_ratio`` of the allocation for at least this fraction of the samples."""
    contention_gpu_util_pct: float = 90.0
    """A shared GPU at least this busy on average is saturated: a share there may get less than it was given."""
    contention_victim_util_pct: float = 60.0
    """A share below this use of its allocation on a saturated GPU, beside a share using all of its own, is slowed."""


@dataclass(frozen=True)
class JobFacts:
    job_id: uuid.UUID
    tenant: str
    name: str | None
    tier: str | None
    state: str
    cpu_milli: int | None
    model_parameter_count: int | None
    model_dtype: str | None
    running_for_s: float | None
    """Seconds since the job started (None if it has not)."""


@dataclass(frozen=True)
class DeviceWindow:
    """Aggregates of one allocated device's samples over the window (``util`` = share of the allocation)."""

    device_uuid: str
    node_id: str
    gpu_uuid: str
    alloc_milli: int
    alloc_memory_mib: int | None
    gpu_memory_total_mib: int | None
    mig_profile: str | None
    samples: int
    span_s: float
    samples_with_process: int
    util_samples: int
    mean_util_pct: float | None
    p95_util_pct: float | None
    max_util_pct: float | None
    mean_gpu_util_pct: float | None
    peak_memory_mib: int
    mean_memory_mib: float
    lifetime_peak_memory_mib: int
    pressure_samples: int
    mean_host_cpu_pct: float | None
    mean_io_wait_pct: float | None
    thermal_samples: int
    power_samples: int
    max_temperature_c: float | None
    mean_power_w: float | None
    mean_sm_clock_mhz: float | None
    gpu_model: str | None = None
    """The GPU's model as its node's inventory reports it (``H100-80GB``, ``L4``); None when not known. Sizing advice
    names only this model's MIG profiles."""


@dataclass(frozen=True)
class Neighbour:
    """Another job's share on a GPU the evaluated job shares (its window over the same time)."""

    job: JobFacts
    window: DeviceWindow


@dataclass(frozen=True)
class Finding:
    category: Category
    kind: str
    severity: Severity
    dedup_key: str
    node_id: str
    explanation: str
    evidence: dict[str, float]
    advice: str | None = None
    job_id: uuid.UUID | None = None
    gpu_uuid: str | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class Evaluation:
    findings: list[Finding] = field(default_factory=list)
    cleared: set[str] = field(default_factory=set)
    """Kinds judged with enough data that do not hold now."""


def job_dedup_key(kind: str, job_id: uuid.UUID) -> str:
    return f"{kind}:job:{job_id}"


def gpu_dedup_key(kind: str, node_id: str, gpu_uuid: str) -> str:
    return f"{kind}:gpu:{node_id}/{gpu_uuid}"


def _label(job: JobFacts) -> str:
    return f"job {job.name} ({job.job_id})" if job.name else f"job {job.job_id}"


def _gpus(devices: list[DeviceWindow]) -> float:
    return sum(d.alloc_milli for d in devices) / 1000


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _round(value: float | None, digits: int = 1) -> float:
    return round(value, digits) if value is not None else -1.0


def evaluate_job(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig,
                 neighbours: Sequence[Neighbour] = ()) -> Evaluation:
    """Apply every windowed rule to one job; see the module docstring for what is returned. ``neighbours``: the
    other shares on the GPUs this job shares (the ``contended`` rule judges only shares that have some)."""
    result = Evaluation()
    if not devices or job.state not in ("placed", "running"):
        return result
    covered = [d for d in devices if d.samples >= 2 and d.span_s >= config.window_s * config.min_coverage]
    if len(covered) < len(devices):
        return result  # not enough data on some device: judge nothing yet
    node_id = devices[0].node_id
    starved = _starved(job, devices, config)
    idle = None if starved else _idle(job, devices, config)
    checks = {
        STARVED: starved,
        IDLE: idle,
        THROTTLED: _throttled(job, devices, config),
        MEMORY_PRESSURE: _memory_pressure(job, devices, config),
    }
    if any(_is_share(d) for d in devices):
        checks[CONTENDED] = _contended(job, devices, neighbours, config)
    for kind, finding in checks.items():
        if finding is None:
            result.cleared.add(kind)
        else:
            result.findings.append(finding)
    if idle is None and job.running_for_s is not None and job.running_for_s >= config.oversized_min_observed_s:
        # an idle job's low memory says nothing about its size: the idle alert says what matters
        finding = _oversized(job, devices, config, node_id)
        if finding is None:
            result.cleared.add(OVERSIZED)
        else:
            result.findings.append(finding)
    return result


def _is_share(device: DeviceWindow) -> bool:
    return device.mig_profile is None and device.alloc_milli < 1000


def _contended(job: JobFacts, devices: list[DeviceWindow], neighbours: Sequence[Neighbour],
               config: DetectionConfig) -> Finding | None:
    """A share slowed by a neighbour: on a saturated GPU (``contention_gpu_util_pct``) it got less than
    ``contention_victim_util_pct`` of its share while another share there used all of its own (utilisation of an
    allocation is capped at 100 %, so "all" may be more). Worse for a latency-sensitive (inference) share."""
    for device in (d for d in devices if _is_share(d)):
        busy, got = device.mean_gpu_util_pct, device.mean_util_pct
        if busy is None or got is None or busy < config.contention_gpu_util_pct \
                or got >= config.contention_victim_util_pct:
            continue
        noisy = [n for n in neighbours if (n.window.node_id, n.window.gpu_uuid) == (device.node_id, device.gpu_uuid)
                 and n.job.job_id != job.job_id and _is_share(n.window) and (n.window.mean_util_pct or 0.0) >= 99.0]
        if not noisy:
            continue
        names = ", ".join(f"{_label(n.job)} of tenant {n.job.tenant} ({n.window.alloc_milli} milli)" for n in noisy)
        return Finding(
            category="alert", kind=CONTENDED, severity="warning" if job.tier == "inference" else "info",
            dedup_key=job_dedup_key(CONTENDED, job.job_id), job_id=job.job_id, tenant=job.tenant,
            node_id=device.node_id, gpu_uuid=device.gpu_uuid,
            explanation=f"{_label(job)} got {got:.0f} % of its {device.alloc_milli}-milli share over the last "
                        f"{_span(config.window_s)} while its GPU was {busy:.0f} % busy: {names} used all of its "
                        f"share there, so its work slows this one.",
            evidence={"mean_util_pct": _round(got), "gpu_util_pct": _round(busy), "alloc_milli": device.alloc_milli,
                      "noisy_neighbours": len(noisy)},
            advice="Give the latency-sensitive share a MIG slice (hardware isolation), or move the busy neighbour "
                   "to a MIG profile or whole GPU; where MPS runs, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps each "
                   "share's SMs (docs/sharing.md).",
        )
    return None


def _idle(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig) -> Finding | None:
    minutes = config.window_s / 60
    gpus = _gpus(devices)
    no_process = all(d.samples_with_process == 0 for d in devices)
    measured = [d for d in devices if d.mean_util_pct is not None]
    mean_util = (sum(d.mean_util_pct or 0.0 for d in measured) / len(measured)) if measured else None
    max_util = max((d.max_util_pct or 0.0 for d in measured), default=None)
    if no_process:
        why = f"no process ran on its {gpus:g} allocated GPU(s) during the last {_span(minutes * 60)}"
    elif mean_util is not None and len(measured) == len(devices) and mean_util < config.idle_util_pct:
        why = (f"its processes used {mean_util:.1f} % of the {gpus:g} allocated GPU(s) on average over the last "
               f"{_span(minutes * 60)} (idle below {config.idle_util_pct:g} %)")
    else:
        return None
    return Finding(
        category="alert", kind=IDLE, severity="warning", dedup_key=job_dedup_key(IDLE, job.job_id),
        job_id=job.job_id, tenant=job.tenant, node_id=devices[0].node_id, gpu_uuid=devices[0].gpu_uuid,
        explanation=f"{_label(job)} is allocated but idle: {why}.",
        evidence={
            "allocated_gpus": gpus, "window_s": config.window_s, "mean_util_pct": _round(mean_util),
            "max_util_pct": _round(max_util),
            "samples_with_process_pct": round(
                100 * sum(d.samples_with_process for d in devices) / max(1, sum(d.samples for d in devices)), 1),
            "idle_gpu_hours": round(gpus * config.window_s / 3600, 3),
        },
        advice="Stop or cancel the job if it is done or stuck, so that its GPUs go back to the queue; "
               "if it waits for data or a peer, allocate the GPUs only when the work is ready.",
    )


def _starved(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig) -> Finding | None:
    if any(d.samples_with_process < d.samples * config.min_coverage for d in devices):
        return None  # the job's processes must be on the GPU for most of the window
    measured = [d for d in devices if d.mean_util_pct is not None]
    if not measured:
        return None
    mean_util = sum(d.mean_util_pct or 0.0 for d in measured) / len(measured)
    if mean_util >= config.starved_util_pct:
        return None
    cpus = [d.mean_host_cpu_pct for d in devices if d.mean_host_cpu_pct is not None]
    ios = [d.mean_io_wait_pct for d in devices if d.mean_io_wait_pct is not None]
    host_cpu = max(cpus) if cpus else None
    io_wait = max(ios) if ios else None
    requested_cpu_pct = (job.cpu_milli or 1000) / 10
    cpu_busy = host_cpu is not None and host_cpu >= config.starved_cpu_busy_ratio * requested_cpu_pct
    io_busy = io_wait is not None and io_wait >= config.starved_io_wait_pct
    if not (cpu_busy or io_busy):
        return None
    causes = []
    if cpu_busy:
        causes.append(f"its host CPU runs at {host_cpu:.0f} % of one core against {requested_cpu_pct:.0f} % requested")
    if io_busy:
        causes.append(f"it waits on I/O {io_wait:.0f} % of the time")
    advice = []
    if cpu_busy:
        advice.append("ask for more CPU and raise the data loader's workers")
    if io_busy:
        advice.append("stage the data on local disk or prefetch it, and read in larger blocks")
    return Finding(
        category="alert", kind=STARVED, severity="warning", dedup_key=job_dedup_key(STARVED, job.job_id),
        job_id=job.job_id, tenant=job.tenant, node_id=devices[0].node_id, gpu_uuid=devices[0].gpu_uuid,
        explanation=(f"{_label(job)} is starved: its GPU(s) are busy only {mean_util:.0f} % of the time while "
                     + " and ".join(causes) + ", so the input pipeline, not the GPU, sets the pace."),
        evidence={
            "mean_util_pct": round(mean_util, 1), "host_cpu_pct": _round(host_cpu),
            "requested_cpu_pct": requested_cpu_pct, "io_wait_pct": _round(io_wait),
            "window_s": config.window_s,
        },
        advice=_sentence("; ".join(advice)),
    )


def _throttled(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig) -> Finding | None:
    worst: tuple[float, DeviceWindow, str] | None = None
    for d in devices:
        for cause, count in (("thermal", d.thermal_samples), ("power", d.power_samples)):
            share = count / max(1, d.samples)
            if share >= config.throttle_fraction and (worst is None or share > worst[0]):
                worst = (share, d, cause)
    if worst is None:
        return None
    share, d, cause = worst
    detail = (f"at up to {d.max_temperature_c:.0f} °C" if cause == "thermal" and d.max_temperature_c is not None
              else f"drawing {d.mean_power_w:.0f} W on average" if d.mean_power_w is not None else "")
    advice = ("Check the node's cooling and airflow, or move the job to another node; the GPU lowers its clocks "
              "to protect itself." if cause == "thermal" else
              "Check the power cap (nvidia-smi -q -d POWER) and the node's power budget; the GPU runs below its "
              "clocks to stay under the cap.")
    return Finding(
        category="alert", kind=THROTTLED, severity="warning", dedup_key=job_dedup_key(THROTTLED, job.job_id),
        job_id=job.job_id, tenant=job.tenant, node_id=d.node_id, gpu_uuid=d.gpu_uuid,
        explanation=(f"GPU {d.gpu_uuid} of {_label(job)} on node {d.node_id} was {cause}-throttled in "
                     f"{share * 100:.0f} % of the samples of the last {_span(config.window_s)} {detail}, "
                     f"so the job runs slower than the hardware allows.").replace("  ", " "),
        evidence={
            "throttled_pct": round(share * 100, 1), "thermal_pct": round(100 * d.thermal_samples / max(1, d.samples), 1),
            "power_pct": round(100 * d.power_samples / max(1, d.samples), 1),
            "max_temperature_c": _round(d.max_temperature_c), "mean_power_w": _round(d.mean_power_w),
            "mean_sm_clock_mhz": _round(d.mean_sm_clock_mhz, 0),
        },
        advice=advice,
    )


def _memory_pressure(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig) -> Finding | None:
    worst: tuple[float, DeviceWindow] | None = None
    for d in devices:
        if not d.alloc_memory_mib:
            continue
        share = d.pressure_samples / max(1, d.samples)
        if share >= config.pressure_fraction and (worst is None or share > worst[0]):
            worst = (share, d)
    if worst is None:
        return None
    share, d = worst
    alloc = d.alloc_memory_mib or 1
    if job.tier == "inference":
        advice = ("Scale out: add a replica of this deployment (an autoscaling signal), or give each replica a "
                  "larger share or MIG profile.")
    else:
        advice = ("The job risks a GPU out-of-memory error: lower the batch size, enable activation checkpointing, "
                  "or ask for a larger share or MIG profile.")
    return Finding(
        category="alert", kind=MEMORY_PRESSURE, severity="warning",
        dedup_key=job_dedup_key(MEMORY_PRESSURE, job.job_id), job_id=job.job_id, tenant=job.tenant,
        node_id=d.node_id, gpu_uuid=d.gpu_uuid,
        explanation=(f"{_label(job)} uses {d.peak_memory_mib / 1024:.1f} GiB of its {alloc / 1024:.1f} GiB of GPU "
                     f"memory ({100 * d.peak_memory_mib / alloc:.0f} % at peak) and stayed above "
                     f"{config.pressure_memory_ratio * 100:.0f} % in {share * 100:.0f} % of the last "
                     f"{_span(config.window_s)}."),
        evidence={
            "peak_memory_mib": float(d.peak_memory_mib), "mean_memory_mib": round(d.mean_memory_mib, 1),
            "allocated_memory_mib": float(alloc), "peak_ratio": round(d.peak_memory_mib / alloc, 3),
            "pressure_samples_pct": round(share * 100, 1),
        },
        advice=advice,
    )


def _oversized(job: JobFacts, devices: list[DeviceWindow], config: DetectionConfig, node_id: str) -> Finding | None:
    sized = [d for d in devices if d.alloc_memory_mib]
    if not sized or len(sized) < len(devices):
        return None
    ratios = [d.lifetime_peak_memory_mib / (d.alloc_memory_mib or 1) for d in sized]
    if max(ratios) >= config.oversized_peak_ratio:
        return None
    d = max(sized, key=lambda w: w.lifetime_peak_memory_mib)
    alloc = d.alloc_memory_mib or 1
    p95_of_gpu = (d.p95_util_pct * d.alloc_milli / 1000) if d.p95_util_pct is not None else None
    fit = smallest_fit(d.lifetime_peak_memory_mib, d.gpu_model, headroom=config.headroom,
                       p95_util_of_gpu_pct=p95_of_gpu)
    if d.mig_profile is not None and fit.mig_profile == d.mig_profile:
        return None  # already on the smallest profile that fits
    options = []
    if fit.mig_profile:
        options.append(f"the MIG profile {fit.mig_profile} ({fit.mig_profile_memory_mib / 1024:.1f} GiB)")
    options.append(f"a share of {fit.share_memory_mib / 1024:.0f} GiB and {fit.share_milli} milli-GPU")
    advice = (f"Ask for {' or '.join(options)} instead of {alloc / 1024:.1f} GiB per GPU: that holds the peak "
              f"plus {config.headroom * 100:.0f} % headroom.")
    evidence = {
        "peak_memory_mib": float(d.lifetime_peak_memory_mib), "allocated_memory_mib": float(alloc),
        "peak_ratio": round(d.lifetime_peak_memory_mib / alloc, 3), "needed_memory_mib": float(fit.needed_memory_mib),
        "recommended_share_memory_mib": float(fit.share_memory_mib),
        "recommended_share_milli": float(fit.share_milli), "p95_util_pct": _round(d.p95_util_pct),
    }
    if fit.mig_profile_memory_mib:
        evidence["recommended_mig_memory_mib"] = float(fit.mig_profile_memory_mib)
    if job.model_parameter_count:
        fp16 = weights_memory_mib(job.model_parameter_count, "fp16")
        int8 = weights_memory_mib(job.model_parameter_count, "int8")
        evidence.update({"parameter_count": float(job.model_parameter_count), "fp16_weights_mib": float(fp16),
                         "int8_weights_mib": float(int8)})
        advice += (f" With {job.model_parameter_count / 1e9:.2g} B parameters the weights take "
                   f"{fp16 / 1024:.1f} GiB in fp16/bf16 and {int8 / 1024:.1f} GiB in int8")
        if job.model_dtype in ("fp32", None):
            fp32 = weights_memory_mib(job.model_parameter_count, "fp32")
            advice += f" (against {fp32 / 1024:.1f} GiB in fp32)"
        advice += "; activations and KV cache come on top."
    return Finding(
        category="recommendation", kind=OVERSIZED, severity="info", dedup_key=job_dedup_key(OVERSIZED, job.job_id),
        job_id=job.job_id, tenant=job.tenant, node_id=node_id, gpu_uuid=d.gpu_uuid,
        explanation=(f"{_label(job)} is oversized: its GPU memory peaked at {d.lifetime_peak_memory_mib / 1024:.1f} "
                     f"GiB of the {alloc / 1024:.1f} GiB allocated per GPU ({100 * max(ratios):.0f} %)."),
        evidence=evidence, advice=advice,
    )


# -- GPU health -------------------------------------------------------------------------------------------------

XID_EXPLANATIONS: dict[int, tuple[str, Severity]] = {
    13: ("graphics engine exception, usually an application bug (out-of-range access)", "warning"),
    31: ("GPU memory page fault, usually an application bug", "warning"),
    43: ("GPU stopped processing, usually the application's fault", "warning"),
    45: ("preemptive cleanup after a previous error", "info"),
    48: ("double-bit ECC error: uncorrectable memory error", "critical"),
    61: ("internal micro-controller breakpoint/warning", "warning"),
    62: ("internal micro-controller halt", "critical"),
    63: ("ECC page retirement or row remapping recorded: needs a GPU reset", "warning"),
    64: ("ECC page retirement or row remapping failed: replace the GPU", "critical"),
    74: ("NVLink error", "critical"),
    79: ("GPU has fallen off the bus", "critical"),
    92: ("high single-bit ECC error rate", "warning"),
    94: ("contained ECC error: the affected application was stopped", "warning"),
    95: ("uncontained ECC error: every application on the GPU is affected, reset needed", "critical"),
    119: ("GSP firmware timeout", "critical"),
    120: ("GSP firmware error", "critical"),
}


def health_event_finding(
    node_id: str, gpu_uuid: str, health: str, reason: str, xid: int | None, action: str,
    job_id: uuid.UUID | None, tenant: str | None,
) -> Finding | None:
    """A ``gpu.health_changed`` event as a finding; None when the GPU is healthy again (resolve instead)."""
    if health == "healthy":
        return None
    severity: Severity = "critical" if health == "unhealthy" else "warning"
    explanation = f"GPU {gpu_uuid} on node {node_id} is {health}: {reason}"
    evidence: dict[str, float] = {}
    if xid is not None:
        described = XID_EXPLANATIONS.get(xid)
        evidence["xid"] = float(xid)
        if described:
            explanation += f" (XID {xid}: {described[0]})"
            severity = described[1] if health != "unhealthy" else "critical"
        else:
            explanation += f" (XID {xid})"
    advice = {
        "none": "Watch the GPU; no action was taken yet.",
        "fail_job": "The job on this GPU was failed; resubmit it (it will be placed elsewhere).",
        "drain": "The node is drained of new work on this GPU; move running work off it.",
        "reset": "Reset the GPU (nvidia-smi -r) once its work is drained.",
        "replace": "Replace the GPU; it cannot be trusted with work.",
    }.get(action)
    return Finding(
        category="alert", kind=GPU_UNHEALTHY, severity=severity,
        dedup_key=gpu_dedup_key(GPU_UNHEALTHY, node_id, gpu_uuid), node_id=node_id, gpu_uuid=gpu_uuid,
        job_id=job_id, tenant=tenant, explanation=explanation + ".", evidence=evidence, advice=advice,
    )


def gpu_health_findings(
    node_id: str, gpu_uuid: str, ecc_uncorrected: int | None, remapped_rows_pending: bool | None,
    remapped_rows_failed: bool | None,
) -> Finding | None:
    """A sample's health counters as a finding: uncorrectable ECC errors, a pending or failed row remap."""
    problems = []
    severity: Severity = "warning"
    if ecc_uncorrected:
        problems.append(f"{ecc_uncorrected} uncorrectable ECC error(s) since the last reset")
        severity = "critical"
    if remapped_rows_failed:
        problems.append("a memory row remap failed")
        severity = "critical"
    if remapped_rows_pending:
        problems.append("a memory row remap waits for a GPU reset")
    if not problems:
        return None
    advice = "Replace the GPU." if remapped_rows_failed else "Drain the GPU and reset it (nvidia-smi -r)."
    return Finding(
        category="alert", kind=GPU_UNHEALTHY, severity=severity,
        dedup_key=gpu_dedup_key(GPU_UNHEALTHY, node_id, gpu_uuid), node_id=node_id, gpu_uuid=gpu_uuid,
        explanation=f"GPU {gpu_uuid} on node {node_id} reports " + " and ".join(problems) + ".",
        evidence={"ecc_uncorrected": float(ecc_uncorrected or 0),
                  "remapped_rows_pending": float(bool(remapped_rows_pending)),
                  "remapped_rows_failed": float(bool(remapped_rows_failed))},
        advice=advice,
    )


def _span(seconds: float) -> str:
    """A window in words: '10 min', '90 s'."""
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
