"""What an NVML health event means for the GPU and the job, following NVIDIA's XID catalogue.

``classify_xid`` maps an XID to a ``HealthVerdict``:

- application errors (the job's own fault; the GPU stays healthy): the job fails, nothing else happens;
- GPU faults: the GPU becomes ``unhealthy`` and is reset (or replaced when the hardware cannot recover);
- memory faults that are contained or already handled: the GPU is ``degraded`` and drained so a reset can apply
  the pending row remap once it is idle;
- an XID not in the table: ``degraded`` with action ``none`` so people look at it, never silently ignored.

``classify_event`` does the same for ECC and other event types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Health = Literal["healthy", "degraded", "unhealthy", "unknown"]
Action = Literal["none", "fail_job", "drain", "reset", "replace"]


@dataclass(frozen=True)
class HealthVerdict:
    health: Health
    action: Action
    reason: str


_APPLICATION = "application error: the job fails, the GPU stays healthy"

XID_CATALOGUE: dict[int, HealthVerdict] = {
    # application / user-program errors
    13: HealthVerdict("healthy", "fail_job", f"XID 13 graphics engine exception; {_APPLICATION}"),
    31: HealthVerdict("healthy", "fail_job", f"XID 31 GPU memory page fault; {_APPLICATION}"),
    43: HealthVerdict("healthy", "fail_job", f"XID 43 GPU stopped processing (channel reset); {_APPLICATION}"),
    45: HealthVerdict("healthy", "fail_job", f"XID 45 preemptive cleanup after an earlier error; {_APPLICATION}"),
    68: HealthVerdict("healthy", "fail_job", f"XID 68 video processor exception; {_APPLICATION}"),
    69: HealthVerdict("healthy", "fail_job", f"XID 69 graphics engine class error; {_APPLICATION}"),
    109: HealthVerdict("healthy", "fail_job", f"XID 109 context switch timeout; {_APPLICATION}"),
    # GPU faults that need a reset
    8: HealthVerdict("unhealthy", "reset", "XID 8 GPU stopped processing: reset the GPU"),
    32: HealthVerdict("unhealthy", "reset", "XID 32 invalid or corrupted push buffer stream: reset the GPU"),
    38: HealthVerdict("unhealthy", "reset", "XID 38 driver firmware error: reset the GPU"),
    48: HealthVerdict("unhealthy", "reset", "XID 48 double-bit ECC error: reset the GPU"),
    61: HealthVerdict("unhealthy", "reset", "XID 61 internal micro-controller breakpoint: reset the GPU"),
    62: HealthVerdict("unhealthy", "reset", "XID 62 internal micro-controller halt: reset the GPU"),
    74: HealthVerdict("unhealthy", "reset", "XID 74 NVLink error: reset the GPU (check the link if it repeats)"),
    79: HealthVerdict("unhealthy", "reset", "XID 79 GPU has fallen off the bus: reset or reboot the node"),
    95: HealthVerdict("unhealthy", "reset", "XID 95 uncontained ECC error: every job on the GPU is hit, reset it"),
    119: HealthVerdict("unhealthy", "reset", "XID 119 GSP RPC timeout: reset the GPU"),
    120: HealthVerdict("unhealthy", "reset", "XID 120 GSP error: reset the GPU"),
    140: HealthVerdict("unhealthy", "reset", "XID 140 unrecovered ECC error: reset the GPU"),
    # memory faults: drain, then reset when idle (row remap / page retirement), or replace
    63: HealthVerdict("degraded", "drain",
                      "XID 63 ECC page retirement / row remap recorded: drain, reset when idle to apply it"),
    64: HealthVerdict("unhealthy", "replace", "XID 64 page retirement / row remap failed: replace the GPU"),
    92: HealthVerdict("degraded", "drain", "XID 92 high single-bit ECC error rate: drain and watch"),
    94: HealthVerdict("degraded", "drain",
                      "XID 94 contained ECC error: the job using that memory fails; drain, reset when idle"),
}
APPLICATION_XIDS = frozenset(x for x, v in XID_CATALOGUE.items() if v.action == "fail_job")


def classify_xid(xid: int) -> HealthVerdict:
    verdict = XID_CATALOGUE.get(xid)
    if verdict is not None:
        return verdict
    return HealthVerdict("degraded", "none", f"XID {xid} is not in the catalogue: look at the node's kernel log")


# NVML event type bits (same values in pynvml)
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_CLOCK = 0x10
EVENT_SINGLE_BIT_ECC_STORM = 0x200
EVENT_DRAM_RETIREMENT = 0x400
EVENT_DRAM_RETIREMENT_FAILURE = 0x800


def classify_event(event_type: int, event_data: int) -> HealthVerdict | None:
    """The verdict for one NVML event, or ``None`` when it says nothing about health (clock changes)."""
    if event_type & EVENT_XID:
        return classify_xid(int(event_data))
    if event_type & EVENT_DOUBLE_BIT_ECC:
        return HealthVerdict("unhealthy", "reset", "double-bit (uncorrectable) ECC error: reset the GPU")
    if event_type & EVENT_DRAM_RETIREMENT_FAILURE:
        return HealthVerdict("unhealthy", "replace", "DRAM retirement failed: replace the GPU")
    if event_type & EVENT_SINGLE_BIT_ECC_STORM:
        return HealthVerdict("degraded", "drain", "single-bit ECC error storm: drain and watch")
    if event_type & EVENT_DRAM_RETIREMENT:
        return HealthVerdict("degraded", "drain", "DRAM page retired: drain, reset when idle")
    return None


GPU_LOST = HealthVerdict("unhealthy", "reset", "NVML reports the GPU lost (fallen off the bus): reset or reboot")
