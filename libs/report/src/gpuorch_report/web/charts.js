// gpuorch's charts, on uPlot (vendored beside this file: uPlot.iife.min.js, uPlot.min.css; no CDN): the one
// implementation the dashboard (served at /charts/charts.js) and the HTML report (inlined by
// gpuorch_report.charts) both draw with.
//   GpuorchCharts.lines(id, title, {t, series: [{label, values, colour, width}], unit, max})  values over time
//   GpuorchCharts.bars(id, title, {labels, series: [{label, values, colour, size}], unit})    values by category
//   GpuorchCharts.report(report)  the weekly report's charts: {utilisation, allocation, idle, queueWait}
// A null value is a gap: lines are never joined across it (spanGaps false) and a lone point is drawn as a dot.
// Axes are sized from their widest label (never clipped). Each chart is a <div class="chart" id=...> carrying
// data-points (non-null values drawn) and data-labels (its categories or series, JSON) for tests and tools.
"use strict";

(function (global) {
  const COLOURS = ["#4f46e5", "#0891b2", "#d97706", "#16a34a", "#dc2626", "#7c3aed"];
  const FONT = "12px system-ui, sans-serif";

  // The room an axis needs: its ticks and gap plus its widest tick label (measured), plus its title.
  function fitted(self, values, axisIdx, cycleNum) {
    const axis = self.axes[axisIdx];
    if (cycleNum > 1 && axis._size) return axis._size;
    let size = (axis.ticks ? axis.ticks.size : 10) + (axis.gap || 5) + 4;
    const longest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
    self.ctx.font = FONT;
    const across = self.ctx.measureText(longest).width / (global.devicePixelRatio || 1);
    size += axis.side === 0 || axis.side === 2 ? (axis.rotate ? across * 0.72 + 8 : 14) : across;
    if (axis.label) size += 16;
    return Math.ceil(size);
  }

  function holder(id, title, points, labels) {
    const node = document.createElement("div");
    node.className = "chart";
    node.id = id;
    node.setAttribute("role", "img");
    node.setAttribute("aria-label", title);
    node.dataset.points = String(points);
    node.dataset.labels = JSON.stringify(labels);
    return node;
  }

  function counted(series) {
    return series.reduce((n, s) => n + s.values.filter((v) => v !== null && v !== undefined).length, 0);
  }

  function empty(node, text) {
    const note = document.createElement("p");
    note.className = "hint";
    note.textContent = text;
    node.append(note);
    return node;
  }

  // Lines over time: t in epoch seconds, one array of values (or null) per series, aligned on t.
  function lines(id, title, { t, series, unit = "%", max = null, width = 720, height = 240 }) {
    const node = holder(id, title, counted(series), series.map((s) => s.label));
    if (!t.length || !counted(series)) return empty(node, "no telemetry in this period");
    const opts = {
      title, width, height, font: FONT,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, max === null ? Math.max(1, hi * 1.1) : max] } },
      series: [{}, ...series.map((s, i) => ({
        label: s.label, stroke: s.colour || COLOURS[i % COLOURS.length], width: s.width || 1.5,
        spanGaps: false, value: (u, v) => (v === null || v === undefined ? "-" : `${v.toFixed(1)}${unit}`),
        points: { show: (u, si) => { const d = u.data[si]; return d.length < 90 || d.some((v, k) =>
          v !== null && (d[k - 1] === null || d[k - 1] === undefined) && (d[k + 1] === null || d[k + 1] === undefined)); },
          size: 5 },
      }))],
      axes: [{ size: fitted, space: 70 }, { size: fitted, label: unit === "%" ? "percent" : unit, values: (u, splits) =>
        splits.map((v) => `${Number(v.toFixed(2))}${unit === "%" ? "%" : ""}`) }],
      legend: { show: true },
    };
    node.chart = new global.uPlot(opts, [t, ...series.map((s) => s.values)], node);
    return node;
  }

  // Bars by category: one series (or several, drawn one inside the other, narrower in front) per kind.
  function bars(id, title, { labels, series, unit = "", width = 720, height = 260 }) {
    const node = holder(id, title, counted(series), labels);
    if (!labels.length) return empty(node, "nothing in this period");
    const long = labels.some((l) => l.length > 10);
    const x = labels.map((_, i) => i);
    const opts = {
      title, width, height, font: FONT,
      scales: { x: { time: false, range: [-0.5, labels.length - 0.5] },
        y: { range: (u, lo, hi) => [0, Math.max(1e-6, hi * 1.1)] } },
      series: [{ value: (u, i) => (i === null ? "-" : labels[i] ?? "") }, ...series.map((s, i) => ({
        label: s.label, fill: s.colour || COLOURS[i % COLOURS.length], stroke: s.colour || COLOURS[i % COLOURS.length],
        paths: global.uPlot.paths.bars({ size: [s.size || 0.6, 80] }), points: { show: false },
        value: (u, v) => (v === null || v === undefined ? "-" : `${Number(v.toPrecision(3))} ${unit}`),
      }))],
      axes: [{ size: fitted, rotate: long ? -35 : 0, splits: () => x, values: (u, splits) =>
        splits.map((i) => labels[i] ?? "") }, { size: fitted, label: unit }],
      legend: { show: true },
    };
    node.chart = new global.uPlot(opts, [x, ...series.map((s) => s.values)], node);
    return node;
  }

  function alpha(colour, a) {
    const n = parseInt(colour.slice(1), 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${a})`;
  }

  // Sorted times with every missing bucket put back (the step: the smallest spacing seen), so that a bucket without
  // telemetry (absent from the report's series) is a gap in the line, not a straight line across it.
  function everyBucket(times) {
    const t = times.sort((a, b) => a - b);
    const step = Math.min(...t.slice(1).map((v, i) => v - t[i]));
    if (!(step > 0) || (t[t.length - 1] - t[0]) / step > 5000) return t;
    const out = [];
    for (let v = t[0]; v <= t[t.length - 1]; v += step) out.push(v);
    return out;
  }

  // The weekly report (GET /api/v1/report, gpuctl report --json) as four charts.
  function report(report) {
    const tenants = report.tenants.map((t) => t.tenant);
    const colourOf = (tenant) => COLOURS[Math.max(0, tenants.indexOf(tenant)) % COLOURS.length];
    const at = (p) => Math.floor(Date.parse(p.bucket) / 1000);
    const t = everyBucket([...new Set([...report.fleet_series, ...report.tenant_series].map(at))]);
    const along = (points) => { const by = new Map(points.map((p) => [at(p), p.util_pct])); return t.map((s) =>
      (by.has(s) ? by.get(s) : null)); };
    const seriesTenants = [...new Set(report.tenant_series.map((p) => p.tenant))].sort();
    const utilisation = lines("report-utilisation", "GPU utilisation over time", { t, max: 100, series: [
      { label: "all GPUs", colour: "#111827", width: 2.5, values: along(report.fleet_series) },
      ...seriesTenants.map((tenant) => ({ label: `${tenant} (of its allocation)`, colour: colourOf(tenant),
        values: along(report.tenant_series.filter((p) => p.tenant === tenant)) }))] });
    const shown = report.tenants.filter((r) => r.allocated_gpu_hours > 0);
    const allocation = bars("report-allocation", "GPU-hours allocated against used, by tenant", {
      unit: "GPU-h", labels: shown.map((r) => r.tenant), series: [
        { label: "allocated", colour: alpha("#4f46e5", 0.35), size: 0.7, values: shown.map((r) => r.allocated_gpu_hours) },
        { label: "used", colour: "#4f46e5", size: 0.4, values: shown.map((r) => r.used_gpu_hours) }] });
    const idleRows = report.tenants.filter((r) => r.idle_gpu_hours > 0);
    const idle = bars("report-idle", "Idle GPU-hours by tenant", { unit: "GPU-h", labels: idleRows.map((r) => r.tenant),
      series: [{ label: "idle", colour: "#dc2626", values: idleRows.map((r) => r.idle_gpu_hours) }] });
    const waits = report.queue_waits.filter((w) => w.waited || w.never_fits).slice(0, 12);
    const queueWait = bars("report-queue-wait", "Queue wait by tier and request shape", { unit: "s",
      labels: waits.map((w) => `${w.tier} · ${w.shape}`), series: [
        { label: "longest wait", colour: alpha("#d97706", 0.35), size: 0.7, values: waits.map((w) => w.max_wait_s) },
        { label: "mean wait", colour: "#d97706", size: 0.4, values: waits.map((w) => w.mean_wait_s) }] });
    return { utilisation, allocation, idle, queueWait };
  }

  global.GpuorchCharts = { lines, bars, report, COLOURS };
})(typeof window !== "undefined" ? window : globalThis);
