// "Export": merge an adapter into its base, or write a GGUF, as background jobs on the server;
// the list shows each job's status, the tail of its log and a download link when done.

import { get, post, withToken } from "./api.js";
import { $, badge, bus, h, runLabel, store } from "./dom.js";

let timer = null;
const exportable = () => store.runs.filter((r) => r.has_final || r.last_checkpoint_step);

function fillRuns() {
  const sel = $("#export-run"), keep = sel.value || store.selected;
  const runs = exportable();
  sel.replaceChildren(...runs.map((r) => h("option", { value: r.id }, runLabel(r))));
  if (runs.some((r) => r.id === keep)) sel.value = keep;
  $("#merge-btn").disabled = $("#gguf-btn").disabled = !runs.length;
  $("#export-msg").textContent = runs.length ? "" : "No run with an adapter yet.";
}

async function start(kind) {
  const id = $("#export-run").value;
  if (!id) return;
  const body = { kind };
  if (kind === "gguf") body.outtype = $("#gguf-type").value;
  try {
    await post(`/api/runs/${encodeURIComponent(id)}/export`, body);
    $("#export-msg").textContent = "";
    refresh();
  } catch (err) {
    $("#export-msg").textContent = err.message;
  }
}

function jobCard(j) {
  const run = store.runs.find((r) => r.id === j.run_id);
  return h("div.card.job", {},
    h("div.job-head", {}, h("strong", {}, j.kind === "gguf" ? "GGUF" : "merge"),
      h("span.muted", {}, run ? runLabel(run) : j.run_id), badge(j.status),
      j.status === "finished" && j.output
        ? h("a.btn.small", { href: withToken(`/api/jobs/${encodeURIComponent(j.id)}/download`), download: "", title: j.output },
          j.kind === "gguf" ? "Download .gguf" : "Download (zip)")
        : null),
    j.message && j.status === "failed" ? h("div.error-text.clamp", {}, j.message) : null,
    j.output ? h("div.muted.small", {}, j.output) : null,
    j.log_tail ? h("pre.log.short", {}, j.log_tail) : null);
}

async function refresh() {
  clearTimeout(timer);
  try {
    const { jobs } = await get("/api/jobs");
    $("#jobs").replaceChildren(...jobs.slice().reverse().map(jobCard));
    $("#jobs-empty").hidden = jobs.length > 0;
    if (jobs.some((j) => j.status === "running" || j.status === "queued") && !$("#view-export").hidden) {
      timer = setTimeout(refresh, 1500);
    }
  } catch (err) {
    $("#export-msg").textContent = err.message;
  }
}

export function initExport() {
  $("#merge-btn").addEventListener("click", () => start("merge"));
  $("#gguf-btn").addEventListener("click", () => start("gguf"));
  bus.on("view", (v) => { if (v === "export") { fillRuns(); refresh(); } });
  bus.on("runs", () => { if (!$("#view-export").hidden) fillRuns(); });
}
