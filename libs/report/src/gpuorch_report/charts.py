"""The report's charts, drawn in the browser by the one chart implementation gpuorch has: uPlot (vendored in
``web/``, MIT, from its npm package) and ``web/charts.js`` on it. The dashboard loads those files from the API
(``/charts/``, served from ``WEB_ASSETS``); ``report_html`` inlines them, so that a written report is one
self-contained file that opens without a network.

    report_html(report) -> str    the weekly review as one HTML page: conclusions, the four charts (utilisation
                                  over time with gaps left open, allocated against used, idle GPU-hours, queue
                                  wait), tenants and jobs tables; the data is the report's JSON, embedded
"""

from __future__ import annotations

import html
from pathlib import Path

from gpuorch_report.document import WeeklyReport

WEB_ASSETS = Path(__file__).parent / "web"
"""uPlot.iife.min.js, uPlot.min.css (and uPlot.LICENSE) and charts.js."""


def _asset(name: str) -> str:
    return (WEB_ASSETS / name).read_text(encoding="utf-8")


def _script_text(text: str) -> str:
    """``text`` safe inside ``<script>``: a ``</`` (as in ``</script>``) cannot end the element early."""
    return text.replace("</", "<\\/")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def _rows(rows: list[tuple[object, ...]]) -> str:
    return "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)


def report_html(report: WeeklyReport) -> str:
    """The review as one self-contained page (uPlot, the chart helpers and the data inlined; no request made)."""
    tenants = _rows([(t.tenant, t.jobs, _num(t.allocated_gpu_hours, 2), _num(t.used_gpu_hours, 2), _num(t.use_pct),
                      _num(t.idle_gpu_hours, 2), _num(t.energy_kwh, 2)) for t in report.tenants])
    jobs = _rows([(j.tenant, j.name or j.job_id, _num(j.gpus, 2), _gib(j.alloc_memory_mib_per_gpu),
                   _gib(j.peak_memory_mib_per_gpu), _num(j.mean_util_pct), _num(j.p95_util_pct, 0),
                   _num(j.idle_gpu_hours, 2), j.detections, j.advice) for j in report.jobs])
    conclusions = "".join(f"<li><b>{html.escape(c.kind)}</b>: {html.escape(c.text)}</li>" for c in report.conclusions)
    scope = f", tenant {report.tenant}" if report.tenant else ""
    data = _script_text(report.model_dump_json())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpuorch GPU use report</title>
<style>{_asset("uPlot.min.css")}
body{{font-family:system-ui,sans-serif;margin:2em;color:#1d2330}}table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child,td:nth-child(2){{text-align:left}}
.chart{{margin:0 0 1.5em}}.hint{{color:#6b7280}}</style></head><body>
<h1>Which work under-uses what it was given</h1>
<p>{html.escape(report.period)}{html.escape(scope)}, generated {report.generated_at:%Y-%m-%d %H:%M} UTC.</p>
<h2>Conclusions</h2><ol>{conclusions or "<li>nothing to change in this period</li>"}</ol>
<h2>Charts</h2><p class="hint">utilisation from {html.escape(report.series_source)}; a gap in the line is a time
without telemetry</p><div id="charts"></div>
<h2>By tenant</h2><table><tr><th>tenant</th><th>jobs</th><th>alloc GPU-h</th><th>used GPU-h</th><th>use %</th>
<th>idle GPU-h</th><th>energy kWh</th></tr>{tenants}</table>
<h2>Jobs, most idle first</h2><table><tr><th>tenant</th><th>job</th><th>GPUs</th><th>mem GiB alloc/GPU</th>
<th>peak GiB/GPU</th><th>mean util %</th><th>p95 %</th><th>idle GPU-h</th><th>detections</th><th>advice</th></tr>
{jobs}</table>
<script type="application/json" id="report-data">{data}</script>
<script>{_script_text(_asset("uPlot.iife.min.js"))}</script>
<script>{_script_text(_asset("charts.js"))}</script>
<script>
const drawn = GpuorchCharts.report(JSON.parse(document.getElementById("report-data").textContent));
document.getElementById("charts").append(drawn.utilisation, drawn.allocation, drawn.idle, drawn.queueWait);
</script>
</body></html>
"""
