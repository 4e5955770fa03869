"""What a batch of usage samples means, decided before anything is written (the ingest's domain step).

``analyse(messages, allocations)``: for every GPU sample of every message, the job each of its processes belongs
to and each job's use of its devices (``attribution.attribute_gpu_sample``), and the health finding the sample
raises (``detection.gpu_health_findings``), naming the job that holds that GPU. Pure: no I/O, no clock. The store
writes what it returns in the transaction that deduplicated the messages (``handlers.TelemetryHandlers._ingest``:
store -> domain -> store).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gpuorch_contracts import GpuUsageSampled
from gpuorch_contracts.nodes import GpuSample

from gpuorch_telemetry.domain.attribution import ActiveAllocation, JobDeviceUsage, attribute_gpu_sample
from gpuorch_telemetry.domain.detection import Finding, gpu_health_findings


@dataclass(frozen=True)
class AnalysedSample:
    """One GPU's sample of one message, with its attribution."""

    node_id: str
    at: datetime
    sample: GpuSample
    process_jobs: list[uuid.UUID | None]
    """Per process of the sample, in order: the job it belongs to, or None."""
    usage: list[JobDeviceUsage]


@dataclass
class Analysis:
    samples: list[AnalysedSample] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def analyse(messages: Sequence[GpuUsageSampled],
            allocations: Mapping[str, Sequence[ActiveAllocation]]) -> Analysis:
    """Attribution and health findings of ``messages``; ``allocations``: the active allocations per node."""
    analysis = Analysis()
    for message in messages:
        node_allocations = allocations.get(message.node_id, ())
        for sample in message.samples:
            attribution = attribute_gpu_sample(sample, node_allocations)
            analysis.samples.append(AnalysedSample(message.node_id, message.occurred_at, sample,
                                                   attribution.process_jobs, attribution.usage))
            health = gpu_health_findings(message.node_id, sample.uuid, sample.ecc_uncorrected,
                                         sample.remapped_rows_pending, sample.remapped_rows_failed)
            if health is not None:
                owner = next((a for a in node_allocations if a.holds_gpu(sample)), None)
                if owner is not None:
                    health = dataclasses.replace(health, job_id=owner.job_id, tenant=owner.tenant)
                analysis.findings.append(health)
    return analysis
