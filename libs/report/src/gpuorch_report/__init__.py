"""gpuorch-report: the weekly review of GPU use, read once and shown by the API, the dashboard and gpuctl."""

from gpuorch_report.document import (
    Conclusion,
    FleetPoint,
    JobUse,
    QueueWait,
    TenantPoint,
    TenantUse,
    WeeklyReport,
)
from gpuorch_report.period import OPEN_END, Period, parse_since, parse_when, resolve_period
from gpuorch_report.reading import read_report

__all__ = [
    "OPEN_END", "Conclusion", "FleetPoint", "JobUse", "Period", "QueueWait", "TenantPoint", "TenantUse",
    "WeeklyReport", "parse_since", "parse_when", "read_report", "resolve_period",
]
