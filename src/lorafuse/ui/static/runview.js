// "Run": status, progress, ETA, live charts (SSE on /api/runs/{id}/events, replayed from the
// last step seen; polling /metrics when the stream cannot be used), log tail, stop/resume/cancel.

import { get, post, withToken } from "./api.js";
import { $, badge, bus, duration, h, runById, runLabel, store } from "./dom.js";
import { LineChart, PALETTE, fmt } from "./chart.js";

const ACTIVE = ["running", "stopping", "queued"];
const CHARTS = [
  { key: "loss", title: "loss", series: [["loss", "train", 0], ["eval_loss", "eval", 1]] },
  { key: "lr", title: "learning rate", series: [["lr", "lr", 2]] },
  { key: "grad_norm", title: "grad norm", series: [["grad_norm", "grad norm", 3]] },
  { key: "tokens_per_s", title: "tokens / s", series: [["tokens_per_s", "tokens/s", 4]] },
  { key: "peak_mem_mb", title: "peak memory", unit: "MiB", series: [["peak_mem_mb", "peak MiB", 5]] },
  // grpo runs only (hidden while no record has a reward): the mean total reward per step, the
  // greedy held-out reward at each eval
  { key: "reward", title: "reward", optional: true, series: [["reward", "train", 6], ["eval_reward", "eval", 1]] },
];

let view = null;  // {id, run, records: Map, charts, es, pollTimer, logTimer}

/** Records keyed by step and kind: an eval record shares its step with a train record. */
const keyOf = (r) => `${r.step}:${("eval_loss" in r || "eval_reward" in r) && !("loss" in r) ? "e" : "t"}`;

function teardown() {
  if (!view) return;
  if (view.es) view.es.close();
  clearTimeout(view.pollTimer);
  clearTimeout(view.logTimer);
  for (const c of view.charts) c.remove();
  view = null;
}

export async function showRun(id) {
  $("#run-none").hidden = !!id;
  $("#run-detail").hidden = !id;
  if (!id) { teardown(); return; }
  if (view && view.id === id) return;
  teardown();
  if (!runById(id)) bus.emit("refresh-runs");  // started elsewhere (another tab, the API)
  view = { id, run: runById(id) || null, records: new Map(), charts: [], es: null, lastStep: -1, errors: 0 };
  const host = $("#run-charts");
  host.replaceChildren();
  view.charts = CHARTS.map((c) => Object.assign(new LineChart(host, { title: c.title, unit: c.unit }), { spec: c }));
  if (view.run) renderHead(view.run);
  try {
    const run = await get(`/api/runs/${encodeURIComponent(id)}`);
    if (!view || view.id !== id) return;
    view.run = run;
    renderHead(run);
    $("#run-config").textContent = JSON.stringify(run.config, null, 2);
  } catch (err) {
    $("#run-msg").textContent = err.message;
    return;
  }
  openEvents();
  refreshLog();
}

function addRecords(records) {
  if (!view || !records.length) return;
  for (const r of records) {
    view.records.set(keyOf(r), r);
    view.lastStep = Math.max(view.lastStep, r.step);
  }
  drawCharts();
  renderHead(view.run);
}

/** Steps a run was resumed from: where elapsed_s (time since that process started) starts over. */
function resumeMarkers(recs) {
  const train = recs.filter((r) => typeof r.elapsed_s === "number");
  const out = [];
  for (let i = 1; i < train.length; i++) {
    if (train[i].elapsed_s < train[i - 1].elapsed_s) out.push({ x: train[i - 1].step, label: "resumed" });
  }
  return out;
}

function drawCharts() {
  const recs = [...view.records.values()].sort((a, b) => a.step - b.step);
  const markers = resumeMarkers(recs);
  for (const chart of view.charts) {
    const series = chart.spec.series
      .map(([field, name, color]) => ({ name, color: PALETTE[color], points: recs.filter((r) => typeof r[field] === "number").map((r) => [r.step, r[field]]) }))
      .filter((s, i) => i === 0 || s.points.length);
    chart.root.hidden = !!chart.spec.optional && !series.some((s) => s.points.length);
    chart.setSeries(series, markers);
  }
}

// ---- live updates ----
function openEvents() {
  if (!view) return;
  if (view.es) view.es.close();
  if (typeof EventSource === "undefined") { poll(); return; }
  const id = view.id;
  let url = `/api/runs/${encodeURIComponent(id)}/events`;
  if (view.lastStep >= 0) url += `?last_event_id=${view.lastStep}`;
  const es = new EventSource(withToken(url));
  view.es = es;
  view.mode = "stream";
  es.addEventListener("metrics", (e) => { view.errors = 0; addRecords([JSON.parse(e.data)]); });
  es.addEventListener("status", (e) => {
    view.errors = 0;
    const run = JSON.parse(e.data);
    updateRun(run);
  });
  es.onerror = () => {
    if (!view || view.es !== es) return;
    view.errors += 1;
    if (!ACTIVE.includes(view.run && view.run.status) && es.readyState !== EventSource.CLOSED) {
      // the server ends the stream after the last status of a run that is done: no reconnect
      es.close();
      view.es = null;
      renderHead(view.run);
      return;
    }
    // The browser reconnects by itself (sending Last-Event-ID); give up on the stream only when it
    // is closed for good or keeps failing, then poll /metrics instead.
    if (es.readyState === EventSource.CLOSED || view.errors >= 3) {
      es.close();
      view.es = null;
      if (ACTIVE.includes(view.run && view.run.status)) poll();
      else pollOnce();
    }
  };
}

async function pollOnce() {
  const v = view;
  const after = Math.max(-1, v.lastStep - 1);  // re-read the last step: its eval record comes later
  const { records } = await get(`/api/runs/${encodeURIComponent(v.id)}/metrics?after=${after}`);
  if (view === v) addRecords(records);
}

function poll() {
  if (!view) return;
  view.mode = "polling";
  const v = view;
  pollOnce().catch((err) => { $("#run-msg").textContent = err.message; }).finally(() => {
    if (view === v && ACTIVE.includes(v.run && v.run.status)) v.pollTimer = setTimeout(poll, 2000);
  });
}

function updateRun(run) {
  if (!view || run.id !== view.id) return;
  const was = view.run && view.run.status;
  view.run = { ...view.run, ...run };
  renderHead(view.run);
  if (was !== run.status) {
    if (was) $("#run-msg").textContent = "";
    bus.emit("refresh-runs");
    refreshLog();
    if (!ACTIVE.includes(run.status)) {
      // done for now: the stream sends what is left and ends (onerror then closes it)
    } else if (ACTIVE.includes(run.status) && !view.es && view.mode !== "polling") {
      openEvents();
    } else if (ACTIVE.includes(run.status) && view.mode === "polling") {
      clearTimeout(view.pollTimer);
      poll();
    }
  }
}

async function refreshLog() {
  if (!view) return;
  const v = view;
  clearTimeout(v.logTimer);
  try {
    const { text } = await get(`/api/runs/${encodeURIComponent(v.id)}/log?tail=200`);
    const pre = $("#run-log");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    // tqdm redraws with \r: show only the last state of each line
    pre.textContent = text.split("\n").map((l) => l.split("\r").filter(Boolean).pop() || "").join("\n");
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  } catch (err) {
    $("#run-log").textContent = err.message;
  }
  if (view === v && ACTIVE.includes(v.run && v.run.status)) v.logTimer = setTimeout(refreshLog, 2500);
}

// ---- head: status, progress, ETA, buttons ----
function eta(run) {
  const recs = [...view.records.values()].filter((r) => "loss" in r && typeof r.elapsed_s === "number").sort((a, b) => a.step - b.step);
  let i = recs.length - 1;  // the current segment: elapsed_s restarts after a resume
  while (i > 0 && recs[i - 1].elapsed_s < recs[i].elapsed_s && recs.length - i < 30) i--;
  const a = recs[i], b = recs[recs.length - 1];
  if (!a || !b || b.step === a.step || !run.total_steps) return null;
  const perStep = (b.elapsed_s - a.elapsed_s) / (b.step - a.step);
  return perStep * Math.max(0, run.total_steps - Math.max(run.step || 0, b.step));
}

function renderHead(run) {
  if (!run) return;
  const step = Math.max(run.step || 0, view ? view.lastStep : 0);
  $("#run-name-h").textContent = runLabel(run);
  $("#run-status").replaceWith(Object.assign(badge(run.status), { id: "run-status" }));
  $("#run-queue").textContent = run.status === "queued" && run.queue_position !== null && run.queue_position !== undefined
    ? `#${run.queue_position} in queue` : "";
  $("#run-message").textContent = run.message || "";
  $("#run-message").hidden = !run.message;
  const pct = run.total_steps ? Math.min(100, (100 * step) / run.total_steps) : 0;
  $("#run-bar").style.width = pct + "%";
  $("#run-progressbar").setAttribute("aria-valuenow", String(Math.round(pct)));
  const recs = view ? [...view.records.values()] : [];
  const lastTrain = recs.filter((r) => "loss" in r).sort((a, b) => a.step - b.step).pop() || run.last_metrics || {};
  // a GRPO run evaluates the held-out reward, the other methods a loss
  const evalKey = recs.some((r) => "eval_reward" in r) || "eval_reward" in (run.last_metrics || {}) ? "eval_reward" : "eval_loss";
  const lastEval = recs.filter((r) => evalKey in r).sort((a, b) => a.step - b.step).pop() || run.last_metrics || {};
  const kv = [
    ["step", `${step}${run.total_steps ? " / " + run.total_steps : ""}`],
    ["ETA", run.status === "running" ? duration(eta(run)) : "–"],
    ["loss", fmt(lastTrain.loss)],
    [evalKey === "eval_reward" ? "eval reward" : "eval loss", evalKey in lastEval ? fmt(lastEval[evalKey]) : "–"],
    ["tokens/s", fmt(lastTrain.tokens_per_s)],
    ["peak memory", lastTrain.peak_mem_mb !== undefined ? fmt(lastTrain.peak_mem_mb) + " MiB" : "–"],
    ["checkpoint", run.last_checkpoint_step !== null && run.last_checkpoint_step !== undefined ? `step ${run.last_checkpoint_step}` : "none"],
    ["updates", !view ? "–" : view.es ? "live" : view.mode === "polling" ? "polling" : "idle"],
  ];
  $("#run-kv").replaceChildren(...kv.map(([k, v]) => h("div", {}, h("span.k", {}, k), h("span.v", { dataset: { k } }, v))));
  const active = ACTIVE.includes(run.status);
  $("#stop-btn").hidden = !(run.status === "running");
  $("#cancel-btn").hidden = run.status !== "queued";
  const canResume = !!run.resumable && !active && run.status !== "finished";
  $("#resume-btn").hidden = !canResume;
  $("#resume-btn").textContent = `Resume from step ${run.last_checkpoint_step ?? 0}`;
  $("#chat-run-btn").hidden = !(run.has_final || run.last_checkpoint_step);
  $("#log-path").textContent = run.output_dir || "";
}

async function act(verb) {
  if (!view) return;
  const id = view.id;
  const btn = $(`#${verb}-btn`);
  btn.disabled = true;
  $("#run-msg").textContent = "";
  try {
    const run = await post(`/api/runs/${encodeURIComponent(id)}/${verb}`);
    if (!view || view.id !== id) return;
    view.run = { ...view.run, ...run };
    renderHead(view.run);
    if (verb === "stop") $("#run-msg").textContent = "Stopping: the trainer writes a checkpoint, then exits.";
    if (verb === "resume") {
      $("#run-msg").textContent = run.status === "queued" ? "Queued behind the run that is training." : "Resumed.";
      openEvents();
      refreshLog();
    }
    bus.emit("refresh-runs");
  } catch (err) {
    $("#run-msg").textContent = err.message;
  } finally {
    btn.disabled = false;
  }
}

export function initRunView() {
  $("#stop-btn").addEventListener("click", () => act("stop"));
  $("#resume-btn").addEventListener("click", () => act("resume"));
  $("#cancel-btn").addEventListener("click", () => act("cancel"));
  $("#chat-run-btn").addEventListener("click", () => bus.emit("chat-with", view && view.id));
  $("#like-btn").addEventListener("click", () => {
    if (!view || !view.run) return;
    bus.emit("fill-form", view.run.config || {});
    bus.emit("navigate", { view: "new" });
  });
  bus.on("runs", (runs) => {  // the sidebar's poll keeps the head fresh when the stream is down
    if (!view) return;
    const r = runs.find((x) => x.id === view.id);
    if (r) updateRun(r);
  });
}
