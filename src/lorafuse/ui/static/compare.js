// "Compare": overlay the curves of several runs (loss, eval loss or reward, tokens/s, peak memory).

import { get } from "./api.js";
import { $, badge, bus, h, runLabel, store } from "./dom.js";
import { LineChart, PALETTE } from "./chart.js";

const METRICS = [["loss", "loss"], ["eval_loss", "eval loss"], ["eval_reward", "eval reward"], ["tokens_per_s", "tokens / s"], ["peak_mem_mb", "peak memory (MiB)"]];
const PICKED_KEY = "lorafuse.compare";
const cache = new Map();  // run id -> {records, step}
let charts = [];
let picked = new Set(JSON.parse(sessionStorage.getItem(PICKED_KEY) || "[]"));

async function recordsOf(run) {
  const hit = cache.get(run.id);
  if (hit && hit.step === run.step && hit.status === run.status) return hit.records;
  const { records } = await get(`/api/runs/${encodeURIComponent(run.id)}/metrics?after=-1`);
  cache.set(run.id, { records, step: run.step, status: run.status });
  return records;
}

function renderPicks() {
  const host = $("#compare-picks");
  if (!store.runs.length) { host.replaceChildren(h("span.muted", {}, "No runs yet.")); return; }
  host.replaceChildren(...store.runs.map((r, i) => h("label.pick", {},
    h("input", { type: "checkbox", checked: picked.has(r.id), onchange: (e) => {
      if (e.target.checked) picked.add(r.id); else picked.delete(r.id);
      sessionStorage.setItem(PICKED_KEY, JSON.stringify([...picked]));
      draw();
    } }),
    h("span", {}, runLabel(r)), badge(r.status))));
}

async function draw() {
  const runs = store.runs.filter((r) => picked.has(r.id));
  const host = $("#compare-charts");
  if (!charts.length) charts = METRICS.map(([, title]) => new LineChart(host, { title, alwaysLegend: true }));
  let data;
  try {
    data = await Promise.all(runs.map(async (r) => [r, await recordsOf(r)]));
  } catch (err) {
    $("#compare-picks").append(h("div.error-text", {}, err.message));
    return;
  }
  METRICS.forEach(([field, title], i) => {
    charts[i].empty = runs.length ? `no ${title} in these runs` : "pick runs above";
    charts[i].setSeries(data.map(([r, recs], k) => ({
      name: runLabel(r),
      color: PALETTE[store.runs.indexOf(r) % PALETTE.length] || PALETTE[k % PALETTE.length],
      points: recs.filter((x) => typeof x[field] === "number").map((x) => [x.step, x[field]]),
    })));
  });
}

export function initCompare() {
  bus.on("view", (v) => { if (v === "compare") { renderPicks(); draw(); } });
  bus.on("runs", () => { if (!$("#view-compare").hidden) { renderPicks(); draw(); } });
}
