"""The scheduler's MIG plan as recommendations (mode ``advise``: what would change, why, and what it would let
start; people apply it, or switch the scheduler to ``auto``).

``plan_findings(plan)``: one recommendation per proposed GPU change, keyed by node, GPU and target layout, so a plan
published again raises nothing new and a proposal that left the plan is resolved (``MIG_LAYOUT`` rows whose key is
not in the new set). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuorch_contracts import MigPlanProposed, MigSlot

from gpuorch_telemetry.domain.detection import Finding

MIG_LAYOUT = "mig_layout"


def layout_text(layout: Sequence[MigSlot] | None) -> str:
    if layout is None:
        return "whole GPU"
    return " ".join(f"{s.profile}@{s.start}" for s in layout) or "MIG, no instances"


def plan_findings(plan: MigPlanProposed) -> list[Finding]:
    findings = []
    for p in plan.proposals:
        change = f"{layout_text(p.current)} -> {layout_text(p.target)}"
        reset = " (MIG mode change: the GPU is reset)" if p.needs_reset else ""
        waits = f"; waits for {len(p.drains)} running job(s)" if p.drains else ""
        applies = "the scheduler carries it out (mode auto)" if plan.mode == "auto" else \
            "apply it (ApplyMigLayout) or set GPUORCH_MIG_MODE=auto; `gpuctl mig plan` shows the whole plan"
        findings.append(Finding(
            category="recommendation", kind=MIG_LAYOUT, severity="info",
            dedup_key=f"{MIG_LAYOUT}:{p.node_id}:{p.gpu_index}:{layout_text(p.target)}", node_id=p.node_id,
            explanation=f"GPU {p.gpu_index} on {p.node_id} ({p.model or 'GPU'}): {change}{reset}: {p.reason}"
                        f"{waits}"[:1000],
            evidence={"gpu_index": float(p.gpu_index), "enables_jobs": float(len(p.enables)),
                      "drains_jobs": float(len(p.drains)), "needs_reset": float(p.needs_reset),
                      "unmet_jobs": float(plan.unmet_jobs)},
            advice=f"change GPU {p.gpu_index} on {p.node_id} to {layout_text(p.target)}: {applies}"[:1000],
        ))
    return findings
