// gpuorch dashboard: plain JavaScript over the API (/api/v1), no build step. jobs.js: the jobs list and the job
// and node pages; /charts/charts.js: the charts (uPlot, vendored; the HTML report draws with the same file).
// Every value from the API reaches the page through textContent (el()), never as HTML.
// Live: /api/v1/events read with fetch() (EventSource cannot send the Authorization header); each event
// refreshes the page shown, at most every 700 ms, and again a few times after the last event (SETTLE_MS); the
// stream's opening refreshes it once; the fleet also refreshes every 5 s (usage samples are not events).
"use strict";

const state = { token: localStorage.getItem("gpuorch-token") || "", who: null, stream: null, pending: null,
  settling: [], renders: 0 };

// An executor's job fact (job.started, job.finished, job.failed...) reaches the stream when the scheduler receives
// it, but the read models the page re-reads show it only once the scheduler has folded and committed it: later
// than 700 ms on a loaded scheduler. One refresh then reads the old state and, with no later event (a session that
// just runs), the page would keep it. So the last event is followed by these refreshes too.
const SETTLE_MS = [2500, 6000, 15000];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.setAttribute("style", value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options, headers: { "Authorization": `Bearer ${state.token}`, "Content-Type": "application/json" },
  });
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) throw new Error((body && body.error) || `HTTP ${response.status}`);
  return body;
}

// A listing with its paging headers (X-Total-Count, X-Next-Cursor): {body, headers}.
async function apiPage(path) {
  const response = await fetch(path, { headers: { "Authorization": `Bearer ${state.token}` } });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.error) || `HTTP ${response.status}`);
  return { body, headers: response.headers };
}

function ago(iso) {
  if (!iso) return "-";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  return s < 120 ? `${s.toFixed(0)}s ago` : s < 7200 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}

function stateCell(value, kind = "state") { return el("span", { class: `${kind}-${value}` }, value); }

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((c) => el("td", {}, c))))));
}

function pct(value) { return value === null || value === undefined ? "-" : `${Math.round(value)}%`; }

// -- pages ------------------------------------------------------------------------------------------------------

// A job on a GPU: its tenant; a share with what it uses of its share (memory, SM utilisation of the share).
function jobOnGpu(j) {
  if (j.milli >= 1000 || j.mig_profile) return j.tenant;
  const memory = j.memory_mib ? ` ${j.memory_used_mib === null ? "-" : (j.memory_used_mib / 1024).toFixed(1)}/${(j.memory_mib / 1024).toFixed(1)} GiB` : "";
  return `${j.tenant} ${j.milli}m${memory} ${pct(j.utilization_pct)}`;
}

function gpuTile(gpu) {
  const slices = gpu.mig_slices.length ? el("div", { class: "slices" }, gpu.mig_slices.map((s) =>
    el("span", { class: `slice${s.allocated ? " held" : ""}`, title: `${s.profile}` + (s.allocated ?
      ` util ${pct(s.utilization_pct)}, mem ${s.memory_used_mib ?? "-"}/${s.memory_mib} MiB` : " free") }))) : null;
  const memory = gpu.memory_used_mib === null ? "mem -" :
    `mem ${(gpu.memory_used_mib / 1024).toFixed(1)}/${(gpu.memory_total_mib / 1024).toFixed(0)} GiB`;
  return el("div", {
    class: `gpu${gpu.free ? "" : " busy"}${gpu.health === "healthy" ? "" : " sick"}`,
    title: `${gpu.uuid} ${gpu.health}${gpu.health_reason ? ": " + gpu.health_reason : ""}`,
  },
  el("div", {}, `GPU ${gpu.index} ${gpu.model}`),
  el("div", {}, `util ${pct(gpu.utilization_pct)}`),
  el("div", { class: "bar" }, el("span", { style: `width:${gpu.utilization_pct || 0}%` })),
  el("div", {}, memory),
  el("div", {}, gpu.temperature_c === null ? "" : `${Math.round(gpu.temperature_c)} °C `, stateCell(gpu.health, "health")),
  el("div", { class: "hint" }, gpu.jobs.map(jobOnGpu).join(", ") || "free"),
  slices);
}

function nodeCard(node) {
  const seen = node.last_seen_s === null ? "never" : `${node.last_seen_s} s ago`;
  const mig = node.mig_slices_total ? ` · ${node.mig_slices_free}/${node.mig_slices_total} MIG slices free` : "";
  return el("div", { class: "node", "data-node": node.node_id },
    el("h3", {}, el("a", { href: `#/node/${node.node_id}`, class: "node-link" }, node.node_id), " ",
      stateCell(node.liveness, "liveness")),
    el("div", { class: "hint" }, `last seen ${seen} · ${node.gpus_free}/${node.gpus_total} GPUs free${mig}`),
    el("div", { class: "gpus" }, node.gpus.map(gpuTile)));
}

function layoutText(layout) {
  return layout ? layout.map((s) => `${s.profile}@${s.start}`).join(" ") : "whole GPU";
}

function countOrIds(value) {  // job ids for operators, a count for everyone else
  if (Array.isArray(value)) return value.length ? value.map((id) => id.slice(0, 8)).join(", ") : "-";
  return value ? String(value) : "-";
}

function migPlanSection(plan) {
  const head = `MIG planner: mode ${plan.mode}` + (plan.updated_at ? `, plan of ${ago(plan.updated_at)}` : "");
  const rows = [
    ...plan.under_way.map((r) => [`${r.node_id}`, String(r.gpu_index), layoutText(r.current), layoutText(r.target),
      countOrIds(r.enables), `under way: ${r.phase}`]),
    ...plan.proposals.map((p) => [`${p.node_id}`, String(p.gpu_index), layoutText(p.current),
      layoutText(p.target) + (p.needs_reset ? " (GPU reset)" : ""), countOrIds(p.enables), p.reason]),
  ];
  return el("section", { id: "mig-plan", "data-mode": plan.mode }, el("h3", {}, head),
    rows.length ? table(["node", "GPU", "now", "proposed", "lets start", "why"], rows)
      : el("p", { class: "hint" }, "no change proposed"),
    plan.mode === "advise" && plan.proposals.length ?
      el("p", { class: "hint" }, "advise: nothing changes until an operator applies a layout or sets " +
        "GPUORCH_MIG_MODE=auto") : null);
}

async function fleetPage() {
  const [nodes, plan] = await Promise.all([api("/api/v1/nodes"), api("/api/v1/mig/plan")]);
  return el("section", { id: "fleet" }, el("h2", {}, `Fleet: ${nodes.length} nodes`),
    el("div", { class: "nodes" }, nodes.map(nodeCard)), plan.mode === "unknown" ? null : migPlanSection(plan));
}

async function queuesPage() {
  const queues = await api("/api/v1/queues");
  return el("section", { id: "queues" }, el("h2", {}, "Queues per tier"),
    table(["tier", "waiting", "oldest wait", "why they wait", "next estimated starts"], queues.map((q) => [
      q.tier, String(q.depth), q.oldest_wait_s === null ? "-" : `${q.oldest_wait_s.toFixed(0)} s`,
      el("div", {}, q.pending_reasons.map((r) => el("div", {}, `${r.jobs} × ${r.reason}`))),
      el("div", {}, q.estimated_starts.map((s) => el("div", {},
        el("a", { href: `#/job/${s.job_id}` }, s.name), ` in ~${s.in_s.toFixed(0)} s`))),
    ])));
}

// An array's progress: a bar of its tasks that ended (succeeded, then failed or cancelled) and the counts.
function arrayProgress(counts) {
  if (!counts) return "-";
  const total = Object.values(counts).reduce((a, b) => a + b, 0) || 1;
  const done = counts.succeeded + counts.failed + counts.cancelled;
  return el("div", { class: "array-progress", "data-done": String(done), "data-total": String(total) },
    el("div", { class: "bar" }, el("span", { style: `width:${(100 * counts.succeeded) / total}%` }),
      el("span", { class: "bad", style: `width:${(100 * (counts.failed + counts.cancelled)) / total}%` })),
    el("div", { class: "hint" }, `${done}/${total} ended · ${counts.running} running · ${counts.queued} queued` +
      (counts.failed ? ` · ${counts.failed} failed` : "") + (counts.cancelled ? ` · ${counts.cancelled} cancelled` : "")));
}

async function tenantsPage() {
  const [tenants, share] = await Promise.all([api("/api/v1/tenants"), api("/api/v1/share")]);
  const scale = Math.max(1, ...tenants.map((t) => Math.max(t.allocated_gpus, t.quota_gpus || 0)));
  const fairShare = [el("h2", {}, "Fair share over time"),
    el("p", { class: "hint" }, share.half_life_s ? `usage (GPU-hours, weighted by GPU model) halves every ` +
      `${num(share.half_life_s / 86400, 1)} days; factor 1: used nothing lately, 0.5: used exactly its share` :
      "not computed yet"),
    table(["tenant", "share", "norm. share", "decayed usage (GPU-h)", "norm. usage", "factor", "GPUs held"],
      share.tenants.map((t) => [t.tenant, String(t.share), num(t.normalized_share, 3), hours(t.usage_gpu_hours),
        num(t.normalized_usage, 3), num(t.factor, 3), String(t.gpus_held)]))];
  return el("section", { id: "tenants" }, el("h2", {}, "Allocation against quota and use"),
    table(["tenant", "allocated GPUs", "quota", "used GPUs", "", "running", "queued"], tenants.map((t) => [
      t.tenant, String(t.allocated_gpus), t.quota_gpus === null ? "-" : String(t.quota_gpus),
      t.used_gpus === null ? "-" : String(t.used_gpus),
      el("div", { class: "meter", title: "allocated (light), used (dark), quota (red line)" },
        el("span", { class: "alloc", style: `width:${(100 * t.allocated_gpus) / scale}%` }),
        el("span", { class: "use", style: `width:${(100 * (t.used_gpus || 0)) / scale}%` }),
        t.quota_gpus === null ? null : el("span", { class: "quota", style: `left:${(100 * t.quota_gpus) / scale}%` })),
      String(t.running), String(t.queued),
    ])), fairShare);
}

// GPU-hours per day and tenant: used (solid) and allocated (light) bars per day, one pair per tenant in turn.
async function weekPage() {
  const rows = await api("/api/v1/usage?days=7");
  const days = [...new Set(rows.map((r) => r.day))].sort();
  const tenants = [...new Set(rows.map((r) => r.tenant))].sort();
  const value = (day, tenant, key) => { const row = rows.find((r) => r.day === day && r.tenant === tenant);
    return row ? row[key] : null; };
  const labels = days.flatMap((day) => tenants.map((tenant) => `${day.slice(5)} ${tenant}`));
  const chart = GpuorchCharts.bars("usage-chart", "GPU-hours per day", { unit: "GPU-h", labels, series: [
    { label: "allocated", colour: "rgba(79, 70, 229, 0.35)", size: 0.7,
      values: days.flatMap((day) => tenants.map((tenant) => value(day, tenant, "allocated_gpu_hours"))) },
    { label: "used", colour: "#4f46e5", size: 0.4,
      values: days.flatMap((day) => tenants.map((tenant) => value(day, tenant, "used_gpu_hours"))) }] });
  return el("section", { id: "week" }, el("h2", {}, "GPU-hours per day, last 7 days"), chart,
    el("p", { class: "hint" }, "light: allocated GPU-hours, dark: used (allocation × utilisation)"),
    table(["day", "tenant", "allocated GPU-h", "used GPU-h", "idle GPU-h"], rows.map((r) => [
      r.day, r.tenant, String(r.allocated_gpu_hours), String(r.used_gpu_hours), String(r.idle_gpu_hours)])));
}

// -- the weekly report: GET /api/v1/report, drawn by GpuorchCharts.report (as the HTML report is) --------------------------------------------------

const PERIODS = ["1h", "1d", "7d", "30d"];

function num(value, digits = 2) { return value === null || value === undefined ? "-" : Number(value).toFixed(digits); }

// GPU-hours readable at any size: 3 significant digits below 10 (a short job is a few thousandths of an hour).
function hours(value) {
  if (value === null || value === undefined) return "-";
  return value === 0 || value >= 10 ? Number(value).toFixed(value >= 10 ? 1 : 0) : Number(value).toPrecision(3);
}

async function reportPage(since) {
  const period = PERIODS.includes(since) ? since : "7d";
  const report = await api(`/api/v1/report?since=${period}`);
  const { utilisation, allocation, idle, queueWait } = GpuorchCharts.report(report);
  return el("section", { id: "report" },
    el("h2", {}, "Weekly report: which work under-uses what it was given"),
    el("p", { class: "hint" }, `${report.start.slice(0, 16).replace("T", " ")} – ${report.end.slice(0, 16).replace("T", " ")} UTC`,
      report.tenants_shown ? `, tenants ${report.tenants_shown.join(", ")}` : ", every tenant", " · period: ",
      PERIODS.map((p) => el("a", { href: `#/report/${p}`, class: p === period ? "active" : "", style: "margin-right:.5rem" }, p))),
    el("h3", {}, "Conclusions"),
    el("ol", { id: "report-conclusions" }, report.conclusions.length
      ? report.conclusions.map((c) => el("li", { "data-kind": c.kind }, el("b", {}, c.kind), ": ", c.text))
      : el("li", {}, "nothing to change in this period")),
    el("h3", {}, `Utilisation over time (${report.series_source})`), utilisation,
    el("h3", {}, "Allocated against used, by tenant"), allocation,
    el("p", { class: "hint" }, "light: allocated GPU-hours, dark: used (allocation × utilisation)"),
    el("h3", {}, "Idle GPU-hours by tenant"), idle,
    el("h3", {}, "Queue wait by tier and request shape"), queueWait,
    el("h3", {}, "Jobs, most idle first"),
    el("div", { id: "report-jobs" }, table(["tenant", "job", "GPUs", "mem GiB alloc/GPU", "peak GiB/GPU", "mean util",
      "p95", "alloc GPU-h", "used GPU-h", "idle GPU-h", "advice"], report.jobs.map((j) => [
      j.tenant, el("a", { href: `#/job/${j.job_id}`, class: "report-job" }, j.name || j.job_id.slice(0, 8)), num(j.gpus),
      j.alloc_memory_mib_per_gpu === null ? "-" : num(j.alloc_memory_mib_per_gpu / 1024, 1),
      j.peak_memory_mib_per_gpu === null ? "-" : num(j.peak_memory_mib_per_gpu / 1024, 1), pct(j.mean_util_pct),
      pct(j.p95_util_pct), hours(j.allocated_gpu_hours), hours(j.used_gpu_hours), hours(j.idle_gpu_hours),
      [j.detections, j.advice].filter(Boolean).join(": ")]))));
}

function submitPage() {
  const field = (name, input) => [el("label", { for: name }, name), input];
  const form = el("form", { class: "submit", id: "submit-form" },
    field("name", el("input", { id: "name", value: "job" })),
    field("tenant", el("input", { id: "tenant", placeholder: "(your default tenant)" })),
    field("tier", el("select", { id: "tier" }, ["batch", "inference", "training"].map((t) => el("option", {}, t)))),
    field("gpus", el("input", { id: "gpus", type: "number", min: "0", value: "1" })),
    field("command", el("textarea", { id: "command", placeholder: '["python", "-c", "print(42)"]' })),
    el("span"), el("button", { type: "submit" }, "Submit"), el("span"), el("span", { id: "submit-result" }));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const result = document.getElementById("submit-result");
    const text = document.getElementById("command").value.trim();
    let argv;
    try { argv = text.startsWith("[") ? JSON.parse(text) : text.split(/\s+/); } catch (e) {
      result.replaceChildren(el("span", { class: "error" }, `command: ${e.message}`)); return;
    }
    const spec = { name: document.getElementById("name").value, tier: document.getElementById("tier").value,
      resources: { gpus: Number(document.getElementById("gpus").value || 0) }, run: { runtime: "process", argv } };
    const tenant = document.getElementById("tenant").value.trim();
    if (tenant) spec.tenant = tenant;
    try {
      const answer = await api("/api/v1/jobs", { method: "POST", body: JSON.stringify({ spec }) });
      result.replaceChildren("submitted: ", el("a", { href: `#/job/${answer.job_id}`, id: "submitted-link" },
        answer.job_id));
    } catch (e) { result.replaceChildren(el("span", { class: "error" }, e.message)); }
  });
  return el("section", { id: "submit" }, el("h2", {}, "Submit a job"), form);
}

// -- routing, live events, sign-in ------------------------------------------------------------------------------

// -- sessions: GET /api/v1/sessions; open (the proxy, signed in once with ?token=), park, resume, stop -----------

async function sessionsPage() {
  const sessions = await api("/api/v1/sessions");
  const act = (path, body) => async () => {
    try { await api(path, { method: "POST", body: JSON.stringify(body || {}) }); } catch (e) { alert(e.message); }
    refreshSoon();
  };
  const saved = sessions.reduce((sum, s) => sum + (s.parked_gpu_hours || 0), 0);
  return el("section", { id: "sessions" }, el("h2", {}, `Sessions (${sessions.length})`),
    el("p", { class: "hint" }, `Parking idle sessions gave back ${hours(saved)} GPU-hours.`),
    table(["session", "name", "tenant", "state", "node", "gpus", "parks", "GPU-h given back", "reason", ""],
      sessions.map((s) => {
        const ended = ["succeeded", "failed", "cancelled", "rejected"].includes(s.state);
        const open = `${s.url}?${new URLSearchParams({ token: state.token })}`;
        return [
          el("a", { href: `#/job/${s.id}`, class: "job-link", "data-job": s.id }, s.id.slice(0, 8)), s.name, s.tenant,
          stateCell(s.state), s.node || "-", s.gpus, String(s.parks),
          el("span", { class: "parked-hours", "data-hours": s.parked_gpu_hours }, hours(s.parked_gpu_hours)),
          s.pending_reason || s.reason || "",
          el("span", { class: "actions" },
            ended ? null : el("a", { href: open, target: "_blank", rel: "noopener", class: "open-session" }, "open"),
            s.state === "running" ? el("button", { class: "park-session",
              onclick: act(`/api/v1/sessions/${s.id}/park`) }, "park") : null,
            s.state === "parked" ? el("button", { class: "resume-session",
              onclick: act(`/api/v1/sessions/${s.id}/resume`) }, "resume") : null,
            ended ? null : el("button", { class: "stop-session", onclick: act(`/api/v1/jobs/${s.id}/cancel`,
              { reason: "session stopped by its owner" }) }, "stop")),
        ];
      })));
}

const pages = { fleet: fleetPage, queues: queuesPage, jobs: jobsPage, tenants: tenantsPage, week: weekPage,
  report: reportPage, submit: submitPage, sessions: sessionsPage, job: jobPage, node: nodePage };

// The page the hash names (#/page/id?query); live refreshes leave a search being typed alone (force: render anyway).
async function render(force = false) {
  const [route, query = ""] = location.hash.split("?");
  const [, page = "fleet", id] = route.split("/");
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.id === `nav-${page}`);
  const view = document.getElementById("view");
  if (!state.who) return;
  if (page === "submit" && view.querySelector("#submit")) return;  // keep what is being typed
  if (!force && document.activeElement?.matches("#jobs-filters input")) return;
  const seq = ++state.renders;  // renders overlap (an event's, the page's own): only the newest one is shown
  try {
    const content = await (pages[page] || fleetPage)(id, new URLSearchParams(query));
    if (seq === state.renders) view.replaceChildren(content);
  } catch (e) { if (seq === state.renders) view.replaceChildren(el("p", { class: "error" }, e.message)); }
}

function refreshSoon() {
  for (const timer of state.settling) clearTimeout(timer);
  state.settling = SETTLE_MS.map((ms) => setTimeout(() => render(), ms));
  if (state.pending) return;
  state.pending = setTimeout(() => { state.pending = null; render(); }, 700);
}

async function follow() {
  if (state.stream) state.stream.abort();
  const controller = new AbortController();
  state.stream = controller;
  const live = document.getElementById("live");
  try {
    const response = await fetch("/api/v1/events", { headers: { Authorization: `Bearer ${state.token}` },
      signal: controller.signal });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    live.classList.add("on");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let opened = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        // the stream's first block (": stream for ...") comes once it is subscribed: what happened between the
        // page's last read and now was sent to no stream, so the page is read again
        if (!opened || block.split("\n").some((line) => line.startsWith("data:"))) refreshSoon();
        opened = true;
      }
    }
  } catch (_) { /* aborted, or the API went away: retried below */ }
  live.classList.remove("on");
  if (state.stream === controller) setTimeout(follow, 3000);
}

async function signIn(token) {
  state.token = token;
  try {
    state.who = await api("/api/v1/whoami");
  } catch (e) {
    state.who = null;
    document.getElementById("who").textContent = "";
    document.getElementById("view").replaceChildren(el("p", { class: "error", id: "login-error" }, e.message));
    return;
  }
  localStorage.setItem("gpuorch-token", token);
  document.getElementById("who").textContent = `${state.who.identity} (${state.who.role}: ${state.who.tenants.join(", ")})`;
  follow();
  render();
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  signIn(document.getElementById("token").value.trim());
});
window.addEventListener("hashchange", () => render(true));
setInterval(() => { if (state.who && (location.hash || "#/fleet").startsWith("#/fleet")) render(); }, 5000);
window.gpuorchSignIn = signIn;  // auth.js: a single sign-on hands its ID token here
if (state.token) signIn(state.token);
