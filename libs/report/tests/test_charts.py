"""The HTML report: one self-contained file (uPlot, the chart helpers and the data inlined, nothing fetched), and
data that cannot end its script element early. In a browser, where Chromium is installed: the charts draw, the
utilisation line has a gap where telemetry had none, and no axis label is cut."""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from gpuorch_report.charts import WEB_ASSETS, report_html
from gpuorch_report.document import FleetPoint, JobUse, TenantUse, WeeklyReport

START = datetime(2026, 11, 30, tzinfo=UTC)


def weekly(name: str = "train") -> WeeklyReport:
    buckets = [START + timedelta(minutes=5 * i) for i in range(12)]
    fleet = [FleetPoint(bucket=b, util_pct=None if 4 <= i < 8 else 40.0 + i, gpus=2) for i, b in enumerate(buckets)]
    return WeeklyReport(
        since="1h", start=START, end=START + timedelta(hours=1), generated_at=START + timedelta(hours=1),
        tenants=[TenantUse(tenant="acme-research-long-tenant-name", jobs=1, allocated_gpu_hours=2.0,
                           used_gpu_hours=0.5, idle_gpu_hours=1.5)],
        jobs=[JobUse(job_id="j1", name=name, tenant="acme-research-long-tenant-name", tier="batch",
                     state="succeeded", devices=1, gpus=1.0, alloc_memory_mib_per_gpu=None,
                     peak_memory_mib_per_gpu=None, mean_util_pct=25.0, p95_util_pct=50.0, allocated_gpu_hours=2.0,
                     used_gpu_hours=0.5, idle_gpu_hours=1.5, energy_kwh=None)],
        fleet_series=[p for p in fleet if p.util_pct is not None])


def test_the_report_is_one_file_that_loads_nothing() -> None:
    page = report_html(weekly(name="</script><script>alert(1)</script>"))
    assert (WEB_ASSETS / "uPlot.iife.min.js").read_text()[:200] in page
    assert "GpuorchCharts" in page and '"tenant":"acme-research-long-tenant-name"' in page
    assert not re.findall(r"""(?:src|href)=["']""", page)  # no external script, stylesheet or image
    assert page.count("</script>") == 4  # the data, uPlot, the helpers, the drawing: nothing closes one early
    assert "&lt;/script&gt;" in page  # the job's name in the table, escaped


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None or shutil.which("chromedriver") is None, reason="headless Chromium absent")
def test_the_charts_draw_with_gaps_and_unclipped_labels(tmp_path: Path) -> None:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    path = tmp_path / "report.html"
    path.write_text(report_html(weekly()), encoding="utf-8")
    options = Options()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    try:
        browser.get(path.as_uri())
        drawn = browser.execute_script("""
            const u = document.getElementById('report-utilisation').chart;
            const bars = document.getElementById('report-allocation');
            const x = bars.chart.axes[0], y = u.axes[1];
            return {points: Number(document.getElementById('report-utilisation').dataset.points),
                    values: u.data[1], canvases: document.querySelectorAll('canvas').length,
                    xSize: x._size, ySize: y._size, labels: JSON.parse(bars.dataset.labels),
                    plotLeft: u.bbox.left / devicePixelRatio};""")
    finally:
        browser.quit()
    assert drawn["points"] == 8 and drawn["canvases"] == 3  # utilisation, allocation, idle (no queue wait: a note)
    assert drawn["values"][4:8] == [None] * 4  # no sample there: a gap, not a joined line
    assert drawn["labels"] == ["acme-research-long-tenant-name"]
    assert drawn["xSize"] > 100  # the rotated long tenant name has the room it needs below the bars
    assert drawn["plotLeft"] >= drawn["ySize"] - 1 > 20  # the y labels sit left of the plot, inside the chart
