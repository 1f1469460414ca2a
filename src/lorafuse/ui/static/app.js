// Entry point of the `lorafuse ui` page: tabs and the URL hash, the runs sidebar, machine info.
// Everything shown comes from the server, so a reload (or another browser) shows the same state;
// the hash (#/run/<id>) only says which view and run are open.

import { get } from "./api.js";
import { $, ago, badge, bus, h, runLabel, showError, store } from "./dom.js";
import { initNewRun } from "./newrun.js";
import { initRunView, showRun } from "./runview.js";
import { initCompare } from "./compare.js";
import { initChat } from "./chat.js";
import { initExport } from "./export.js";

const VIEWS = ["new", "run", "compare", "chat", "export"];
let current = { view: "new", runId: null };

function parseHash() {
  const [view, id] = location.hash.replace(/^#\/?/, "").split("/");
  return { view: VIEWS.includes(view) ? view : "new", runId: id ? decodeURIComponent(id) : null };
}

export function navigate(view, runId = null) {
  const hash = view === "run" && runId ? `#/run/${encodeURIComponent(runId)}` : `#/${view}`;
  if (location.hash !== hash) location.hash = hash; else route();
}

function route() {
  current = parseHash();
  if (current.view === "run" && !current.runId && store.selected) current.runId = store.selected;
  for (const v of VIEWS) {
    const tab = $(`#tab-${v}`), on = v === current.view;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(`#view-${v}`).hidden = !on;
  }
  if (current.runId) store.selected = current.runId;
  renderRuns();
  bus.emit("view", current.view);
  if (current.view === "run") showRun(store.selected || null);
}

/** The one number a run's list entry shows: a grpo run's (eval) reward, any other run's loss. */
function headline(m) {
  if (!m) return "";
  const [key, label] = typeof m.eval_reward === "number" ? ["eval_reward", "eval reward"]
    : typeof m.reward === "number" ? ["reward", "reward"] : ["loss", "loss"];
  return typeof m[key] === "number" ? `${label} ${m[key].toFixed(3)}` : "";
}

function renderRuns() {
  const ul = $("#runs");
  const items = store.runs.map((r) => {
    const pct = r.total_steps ? Math.min(100, (100 * (r.step || 0)) / r.total_steps) : 0;
    const sub = r.status === "queued" && r.queue_position !== null && r.queue_position !== undefined
      ? `#${r.queue_position} in queue`
      : `step ${r.step || 0}${r.total_steps ? " / " + r.total_steps : ""}`;
    const loss = headline(r.last_metrics);
    const li = h("li.run-item", {
      role: "option", tabIndex: 0, "aria-selected": String(r.id === store.selected), dataset: { id: r.id },
      onclick: () => navigate("run", r.id),
      onkeydown: (e) => {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); navigate("run", r.id); }
        if (e.key === "ArrowDown" && li.nextElementSibling) li.nextElementSibling.focus();
        if (e.key === "ArrowUp" && li.previousElementSibling) li.previousElementSibling.focus();
      },
    },
      h("div.run-line", {}, h("span.run-name", { title: r.output_dir || "" }, runLabel(r)), badge(r.status)),
      h("div.run-sub", {}, h("span", {}, sub), h("span", {}, loss || ago(r.created))),
      h("div.mini-progress", {}, h("div", { style: `width:${pct}%` })));
    return li;
  });
  ul.replaceChildren(...items);
  $("#runs-empty").hidden = store.runs.length > 0;
}

let runsTimer = null, runsFailed = false;
export async function refreshRuns() {
  try {
    const { runs } = await get("/api/runs");
    store.runs = runs;
    renderRuns();
    bus.emit("runs", runs);
    if (runsFailed) $("#banner").hidden = true;  // the server is back
    runsFailed = false;
  } catch (err) {
    runsFailed = true;
    showError(err);
  }
  clearTimeout(runsTimer);
  const busy = store.runs.some((r) => ["running", "stopping", "queued"].includes(r.status));
  runsTimer = setTimeout(refreshRuns, busy ? 2000 : 6000);
}

async function loadInfo() {
  try {
    const info = await get("/api/info");
    store.info = info;
    $("#version").textContent = "v" + info.version;
    const gb = (mb) => (mb / 1024).toFixed(1) + " GiB";
    const parts = [info.device || "cpu"];
    if (info.free_mem_mb !== undefined) parts.push(`${gb(info.free_mem_mb)} free of ${gb(info.total_mem_mb)}`);
    if (info.cpu) parts.push(info.cpu);
    $("#machine").replaceChildren(h("span.chip", { title: "workspace" }, info.workspace),
      ...parts.map((p) => h("span.chip", {}, p)));
  } catch (err) {
    showError(err);
  }
}

function keyboard() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => navigate(tab.dataset.view, tab.dataset.view === "run" ? store.selected : null));
    tab.addEventListener("keydown", (e) => {
      const d = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
      if (!d) return;
      const next = tabs[(i + d + tabs.length) % tabs.length];
      next.focus(); next.click();
    });
  });
  document.addEventListener("keydown", (e) => {  // Alt+1..5 switch views from anywhere
    if (e.altKey && /^[1-5]$/.test(e.key)) {
      e.preventDefault();
      const v = VIEWS[+e.key - 1];
      navigate(v, v === "run" ? store.selected : null);
      $(`#tab-${v}`).focus();
    }
  });
  $("#new-run-btn").addEventListener("click", () => navigate("new"));
}

async function main() {
  keyboard();
  bus.on("navigate", ({ view, runId }) => navigate(view, runId));
  bus.on("refresh-runs", refreshRuns);
  initNewRun();
  initRunView();
  initCompare();
  initChat();
  initExport();
  window.addEventListener("hashchange", route);
  loadInfo();
  await refreshRuns();
  route();
}

main();
