// gpuorch dashboard: the jobs list (filter, sort, search, cursor paging) and the job page (logs with follow,
// cancel / requeue with a confirmation, utilisation over time). Loaded before app.js; uses its el(), api(),
// apiPage(), state, stateCell(), table(), ago(), pct(), arrayProgress(), refreshSoon() at call time.
"use strict";

const TERMINAL = ["succeeded", "failed", "cancelled", "rejected"];
const JOB_STATES = ["submitted", "queued", "placed", "running", "preempting", "parked", "succeeded", "failed",
  "cancelled", "rejected"];
const JOB_SORTS = [["-submitted", "newest first"], ["submitted", "oldest first"], ["name", "name"],
  ["state", "state"], ["tenant", "tenant"], ["-ended", "ended last first"]];
const PRIORITY_CLASSES = ["critical", "high", "normal", "low"];
const PAGE_SIZE = 50;
const FILTERS = ["state", "tenant", "tier", "q", "sort"];

// -- jobs list ----------------------------------------------------------------------------------------------------

// What the list shows; kept across the re-renders live events cause. ``pages``: the cursors of the pages before
// the one shown (for "previous"); ``cursor``: the shown page's own (null: the first page). A link may set the
// filters and the page size: #/jobs?state=running&q=train&limit=20 (``applied``: the link's query, applied once).
const jobsView = { state: "", tenant: "", tier: "", q: "", sort: "-submitted", limit: PAGE_SIZE, cursor: null,
  pages: [], next: null, applied: null };

function applyLink(params) {
  if (params.toString() === jobsView.applied) return;
  jobsView.applied = params.toString();
  for (const key of FILTERS) jobsView[key] = params.get(key) || (key === "sort" ? "-submitted" : "");
  jobsView.limit = Math.min(500, Math.max(1, Number(params.get("limit")) || PAGE_SIZE));
  jobsView.cursor = null; jobsView.pages = [];
}

function jobsQuery() {
  const params = new URLSearchParams({ limit: String(jobsView.limit), sort: jobsView.sort });
  for (const key of FILTERS) if (jobsView[key] && key !== "sort") params.set(key, jobsView[key]);
  if (jobsView.cursor) params.set("cursor", jobsView.cursor);
  return `/api/v1/jobs?${params}`;
}

function jobsFilters() {
  const changed = (key) => (event) => {
    jobsView[key] = event.target.value.trim();
    jobsView.cursor = null; jobsView.pages = [];
    render(true);
  };
  const select = (key, label, options) => el("select", { id: `jobs-${key}`, "aria-label": label, onchange: changed(key) },
    options.map(([value, text]) => {
      const option = el("option", { value }, text);
      if (value === jobsView[key]) option.setAttribute("selected", "");
      return option;
    }));
  const tenants = state.who.tenants.includes("*") ? [] : state.who.tenants;
  return el("form", { id: "jobs-filters", class: "filters", onsubmit: (e) => { e.preventDefault(); } },
    select("state", "state", [["", "any state"], ...JOB_STATES.map((s) => [s, s])]),
    tenants.length > 1 || !tenants.length ? (tenants.length ? select("tenant", "tenant", [["", "any tenant"],
      ...tenants.map((t) => [t, t])]) : el("input", { id: "jobs-tenant", placeholder: "tenant", "aria-label": "tenant",
      value: jobsView.tenant, onchange: changed("tenant") })) : null,
    select("tier", "tier", [["", "any tier"], ...["training", "batch", "inference", "interactive"].map((t) => [t, t])]),
    el("input", { id: "jobs-q", type: "search", placeholder: "name or id prefix", "aria-label": "search",
      value: jobsView.q, onchange: changed("q") }),
    select("sort", "order", JOB_SORTS));
}

function jobsPager(total, shown) {
  const first = jobsView.pages.length * jobsView.limit;
  const go = (forward) => () => {
    if (forward) { jobsView.pages.push(jobsView.cursor); jobsView.cursor = jobsView.next; } else {
      jobsView.cursor = jobsView.pages.pop() ?? null;
    }
    render(true);
  };
  return el("div", { class: "pager", id: "jobs-pager", "data-total": String(total) },
    el("button", { id: "jobs-prev", type: "button", onclick: go(false), ...(jobsView.pages.length ? {} : { disabled: "" }) },
      "‹ previous"),
    el("span", { class: "hint" }, shown ? ` ${first + 1}–${first + shown} of ${total} ` : ` 0 of ${total} `),
    el("button", { id: "jobs-next", type: "button", onclick: go(true), ...(jobsView.next ? {} : { disabled: "" }) },
      "next ›"));
}

async function jobsPage(_, params) {
  applyLink(params || new URLSearchParams());
  const { body: jobs, headers } = await apiPage(jobsQuery());
  jobsView.next = headers.get("X-Next-Cursor");
  const total = Number(headers.get("X-Total-Count") || jobs.length);
  return el("section", { id: "jobs" }, el("h2", {}, `Jobs (${total})`), jobsFilters(), jobsPager(total, jobs.length),
    table(["job", "name", "tenant", "tier", "state", "node", "gpus", "tasks", "exit", "submitted", "reason"],
      jobs.map((j) => [
        el("a", { href: `#/job/${j.id}`, class: "job-link", "data-job": j.id }, j.id.slice(0, 8)), j.name, j.tenant,
        j.tier, stateCell(j.state), j.node || "-", j.gpus, arrayProgress(j.array_counts),
        j.exit_code === null ? "-" : String(j.exit_code), ago(j.submitted_at), j.pending_reason || j.reason || "",
      ])));
}

// -- confirmation -------------------------------------------------------------------------------------------------

// A modal <dialog>: resolves true when confirmed, false when dismissed (Back, Escape).
function confirmAction(title, text, verb) {
  return new Promise((resolve) => {
    const dialog = el("dialog", { id: "confirm", class: "confirm" },
      el("h3", {}, title), el("p", {}, text),
      el("form", { method: "dialog", class: "confirm-buttons" },
        el("button", { value: "back", id: "confirm-back" }, "Back"),
        el("button", { value: "yes", id: "confirm-yes", class: "danger" }, verb)));
    dialog.addEventListener("close", () => { resolve(dialog.returnValue === "yes"); dialog.remove(); });
    document.body.append(dialog);
    dialog.showModal();
  });
}

// What the last action on a job answered, kept across re-renders of its page.
const lastAction = { jobId: null, result: null };

function jobActions(job) {
  if (lastAction.jobId !== job.id) Object.assign(lastAction, { jobId: job.id,
    result: el("span", { id: "action-result", class: "hint" }) });
  const result = lastAction.result;
  const act = (title, text, verb, path, body, done) => async () => {
    if (!(await confirmAction(title, text, verb))) return;
    try {
      const answer = await api(path, { method: "POST", body: JSON.stringify(body || {}) });
      result.replaceChildren(done(answer));
      refreshSoon();
    } catch (e) { result.replaceChildren(el("span", { class: "error" }, e.message)); }
  };
  const ended = TERMINAL.includes(job.state);
  return el("div", { class: "actions", id: "job-actions" },
    ended ? null : el("button", { id: "cancel-job", class: "danger", onclick: act("Cancel this job?",
      `${job.name} (${job.id.slice(0, 8)}) is ${job.state}: a running job gets its checkpoint signal, then is stopped.`,
      "Cancel job", `/api/v1/jobs/${job.id}/cancel`, { reason: `cancelled by ${state.who.identity} from the dashboard` },
      (a) => a.status) }, "Cancel…"),
    !ended && !job.array_counts && state.who.role === "operator" ? priorityControl(job, act) : null,
    ended && !job.array_id ? el("button", { id: "requeue-job", onclick: act("Queue this job again?",
      `A new job with the same spec as ${job.name} (${job.id.slice(0, 8)}) is submitted on your behalf.`,
      "Requeue", `/api/v1/jobs/${job.id}/resubmit`, {},
      (a) => el("span", {}, "queued again as ", el("a", { href: `#/job/${a.job_id}`, id: "requeued-link" },
        a.job_id.slice(0, 8)))) }, "Requeue…") : null,
    result);
}

// Operators: a job's priority class, changed through the confirmation (the scheduler orders and preempts by it).
// The class picked and not yet applied, kept across re-renders of the job's page.
const priorityChoice = { jobId: null, value: null };

function priorityControl(job, act) {
  if (priorityChoice.jobId !== job.id) Object.assign(priorityChoice, { jobId: job.id, value: job.priority_class });
  const choice = el("select", { id: "priority-class", "aria-label": "priority class",
    onchange: (e) => { priorityChoice.value = e.target.value; } }, PRIORITY_CLASSES.map((p) => {
    const option = el("option", { value: p }, p);
    if (p === priorityChoice.value) option.setAttribute("selected", "");
    return option;
  }));
  const button = el("button", { id: "change-priority", type: "button", onclick: () => act("Change this job's priority?",
    `${job.name} (${job.id.slice(0, 8)}) goes from ${job.priority_class} to ${choice.value}: its place in the queue and ` +
    "which jobs it may preempt follow the new class.", "Change priority", `/api/v1/jobs/${job.id}/priority`,
    { priority_class: choice.value }, (a) => a.status)() }, "Change priority…");
  return el("span", { class: "priority" }, choice, button);
}

// -- logs with follow ---------------------------------------------------------------------------------------------

// One follower at a time, kept across the job page's re-renders (its <pre> is moved into each new render).
const logs = { jobId: null, controller: null, pre: null, status: null, following: false, ended: false };

function logPanel(job) {
  if (logs.jobId !== job.id) {
    if (logs.controller) logs.controller.abort();
    Object.assign(logs, { jobId: job.id, controller: null, following: false, ended: false,
      pre: el("pre", { id: "job-log", class: "log" }), status: el("span", { id: "log-status", class: "hint" }) });
  }
  const neverRan = !job.nodes.length;
  if (!logs.controller && !logs.ended && !neverRan) readLog(job);
  if (neverRan) logs.status.textContent = TERMINAL.includes(job.state) ? "never ran: no log" : "not started yet";
  const follow = el("input", { type: "checkbox", id: "log-follow", checked: "" });
  follow.checked = logs.autoscroll !== false;
  follow.addEventListener("change", () => { logs.autoscroll = follow.checked; });
  return el("div", { class: "log-panel" },
    el("div", { class: "hint" }, el("label", {}, follow, " keep the end in view"), " · ", logs.status), logs.pre);
}

async function readLog(job) {
  const controller = new AbortController();
  const follow = !TERMINAL.includes(job.state);
  Object.assign(logs, { controller, following: follow });
  logs.pre.textContent = "";
  logs.status.textContent = follow ? "following…" : "";
  logs.pre.dataset.following = String(follow);
  try {
    const response = await fetch(`/api/v1/jobs/${encodeURIComponent(job.id)}/logs${follow ? "?follow=1" : ""}`,
      { headers: { Authorization: `Bearer ${state.token}` }, signal: controller.signal });
    if (!response.ok) {
      let detail = `HTTP ${response.status}`;
      try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
      throw new Error(detail);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      logs.pre.append(decoder.decode(value, { stream: true }));
      if (logs.autoscroll !== false) logs.pre.scrollTop = logs.pre.scrollHeight;
    }
    if (logs.controller === controller) {
      logs.ended = true;
      logs.status.textContent = follow ? "end of log: the job ended" : "end of log";
    }
  } catch (e) {
    if (logs.controller === controller) logs.status.textContent = `no log: ${e.message}`;
  } finally {
    if (logs.controller === controller) {
      logs.controller = null; logs.following = false;
      logs.pre.dataset.following = "false";
    }
  }
}

// -- utilisation over time ----------------------------------------------------------------------------------------

function seriesCharts(prefix, title, series) {
  const lines = (field) => series.series.map((s, i) => ({ label: s.label, values: s[field],
    colour: GpuorchCharts.COLOURS[i % GpuorchCharts.COLOURS.length] }));
  return el("div", { class: "charts" },
    el("p", { class: "hint" }, `from telemetry's ${series.source}; a gap is a time without samples`),
    GpuorchCharts.lines(`${prefix}-util`, `${title}: utilisation`, { t: series.t, max: 100,
      series: lines("util_pct") }),
    GpuorchCharts.lines(`${prefix}-memory`, `${title}: memory used`, { t: series.t, unit: " MiB",
      series: lines("memory_mib") }));
}

// -- the job page -------------------------------------------------------------------------------------------------

async function jobPage(id) {
  const job = await api(`/api/v1/jobs/${encodeURIComponent(id)}`);
  const facts = [["id", job.id], ["name", job.name], ["tenant", job.tenant], ["tier", job.tier],
    ["priority", job.priority_class], ["state", stateCell(job.state)],
    ["reason", job.pending_reason || job.reason || "-"], ["nodes", job.nodes.join(", ") || "-"],
    ["GPUs", job.gpus], ["placement", job.placement_id || "-"], ["exit code", job.exit_code ?? "-"],
    ["submitted", job.submitted_at], ["started", job.started_at || "-"], ["ended", job.ended_at || "-"],
    ["estimated start", job.estimated_start || "-"], ["GPU-hours so far", String(job.usage.gpu_hours)],
    ["trace", job.trace_url ? el("a", { href: job.trace_url, target: "_blank", rel: "noopener" }, "open in Jaeger")
      : "tracing link not configured (GPUORCH_JAEGER_URL)"]];
  if (job.array_counts) facts.splice(6, 0, ["tasks", arrayProgress(job.array_counts)]);
  if (job.array_id) facts.splice(1, 0, ["array", el("a", { href: `#/job/${job.array_id}` },
    `task ${job.array_index} of ${job.array_id.slice(0, 8)}`)]);
  const [tasks, series] = await Promise.all([
    job.array_counts ? api(`/api/v1/jobs?array=${encodeURIComponent(job.id)}&limit=500`) : [],
    job.started_at ? api(`/api/v1/jobs/${encodeURIComponent(job.id)}/utilisation`) : null]);
  return el("section", { id: "job", "data-state": job.state },
    el("h2", {}, `Job ${job.name} `, stateCell(job.state)), jobActions(job),
    el("dl", {}, facts.map(([k, v]) => [el("dt", {}, k), el("dd", { "data-field": k }, v)])),
    ...(job.array_counts ? [el("h2", {}, "Tasks (started or waiting)"),
      table(["task", "job", "state", "node", "exit", "reason"], tasks.map((t) => [String(t.array_index),
        el("a", { href: `#/job/${t.id}` }, t.id.slice(0, 8)), stateCell(t.state), t.node || "-",
        t.exit_code === null ? "-" : String(t.exit_code), t.pending_reason || t.reason || ""]))] : []),
    el("h2", {}, "Log"), job.array_counts ? el("p", { class: "hint" }, "each task has its own log") : logPanel(job),
    el("h2", {}, "Utilisation over time"),
    series ? seriesCharts("job", "this job", series) : el("p", { class: "hint" }, "not started yet"),
    el("h2", {}, "Timeline"),
    table(["at", "event", "detail"], job.timeline.map((e) => [e.at, e.type,
      Object.entries(e).filter(([k]) => k !== "at" && k !== "type").map(([k, v]) => `${k}=${v}`).join(" ")])),
    el("h2", {}, "Usage so far"),
    table(["node", "GPU", "allocated", "samples", "peak memory", "mean util"], job.usage.devices.map((d) => [
      d.node_id, String(d.gpu_index), `${d.alloc_milli} m`, String(d.samples), `${d.peak_memory_mib} MiB`,
      pct(d.mean_util_pct)])),
    el("h2", {}, "Advice and alerts"),
    job.advice.length ? table(["kind", "severity", "explanation", "advice", "raised", "resolved"], job.advice.map((a) => [
      a.kind, a.severity, a.explanation, a.advice || "", ago(a.raised_at), a.resolved_at ? ago(a.resolved_at) : "open",
    ])) : el("p", { class: "hint" }, "nothing noticed"),
    el("h2", {}, "Spec"), el("pre", {}, JSON.stringify(job.spec, null, 2)));
}

// -- a node's GPUs over time (from the fleet page) ----------------------------------------------------------------

async function nodePage(nodeId) {
  const since = "1h";
  const series = await api(`/api/v1/nodes/${encodeURIComponent(nodeId)}/utilisation?since=${since}`);
  return el("section", { id: "node", "data-node": nodeId }, el("h2", {}, `${nodeId}: GPUs over the last hour`),
    seriesCharts("node", nodeId, series));
}
