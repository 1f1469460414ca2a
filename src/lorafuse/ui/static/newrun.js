// "New run": a form generated from /api/config/schema (TrainConfig is the one source of truth),
// validated by the server as you type, with a dataset preview, a memory/speed estimate, and
// Start / Copy as CLI command / Download YAML.

import { get, post } from "./api.js";
import { $, bus, copyText, download, h, showError, store } from "./dom.js";
import { Histogram, fmt } from "./chart.js";

const GROUPS = [
  ["model", "Model", true], ["data", "Data", true], ["lora", "LoRA", true],
  ["optimisation", "Optimisation", true], ["run", "Run", false],
];
// data: a file, or a Hugging Face dataset folder (save_to_disk); a hub id is typed as it is
const PICKABLE = { model: "dir-or-file", data: "dir-or-file", eval_data: "dir-or-file", init_adapter: "dir", resume: "dir" };
const DRAFT_KEY = "lorafuse.draft";

let fields = [];
let lastValid = null;  // the last /api/config/validate answer
let validateTimer = null, previewTimer = null, previewKey = "", histogram = null;

function inputFor(f) {
  const id = "f-" + f.name;
  let input;
  if (f.type === "bool") {
    input = h("input", { type: "checkbox", id, name: f.name, checked: !!f.default });
  } else if (f.choices && f.choices.length) {
    input = h("select", { id, name: f.name },
      f.default === null ? h("option", { value: "" }, "(default)") : null,
      f.choices.filter((c) => c !== null).map((c) => h("option", { value: String(c), selected: c === f.default }, String(c))));
  } else {
    const isNum = f.type === "int" || f.type === "float";
    const value = f.default === null ? "" : Array.isArray(f.default) ? f.default.join(", ") : String(f.default);
    input = h("input", {
      id, name: f.name, value, autocomplete: "off", spellcheck: "false",
      type: "text", inputmode: isNum ? (f.type === "int" ? "numeric" : "decimal") : null,
      placeholder: f.default === null ? "default" : f.type.startsWith("list") ? "comma-separated" : null,
    });
  }
  input.dataset.type = f.type;
  return input;
}

function fieldRow(f) {
  const input = inputFor(f);
  const hint = h("div.hint", { id: `hint-${f.name}` }, f.help || "");
  const err = h("div.field-error", { id: `err-${f.name}`, role: "alert" });
  input.setAttribute("aria-describedby", `hint-${f.name} err-${f.name}`);
  const label = h("label", { for: input.id }, f.name);
  const control = PICKABLE[f.name]
    ? h("div.with-button", {}, input, h("button.btn.small", { type: "button", onclick: () => openPicker(f.name) }, "Browse…"))
    : input;
  if (f.type === "bool") return h("div.field.check", { dataset: { field: f.name } }, h("div.check-row", {}, input, label), hint, err);
  return h("div.field", { dataset: { field: f.name } }, label, control, hint, err);
}

function parseValue(f, el) {
  // a setting the trainer decides when unset (gradient_checkpointing): unchecked leaves it to it
  if (f.type === "bool") return el.checked || (f.nullable && f.default === null ? null : false);
  const raw = el.value.trim();
  if (raw === "") return f.type.startsWith("list") ? (f.default === null ? null : []) : f.default === null ? null : f.default;
  if (f.type === "int" || f.type === "float") {
    const n = Number(raw);
    if (!isFinite(n) || (f.type === "int" && !Number.isInteger(n))) throw new FieldError(f.name, `not ${f.type === "int" ? "an integer" : "a number"}: ${raw}`);
    return n;
  }
  if (f.type === "list[str]") return raw.split(/[,\n]/).map((s) => s.trim()).filter(Boolean);
  if (f.type === "list[float]") {
    return raw.split(/[,\s]+/).filter(Boolean).map((s) => {
      const n = Number(s);
      if (!isFinite(n)) throw new FieldError(f.name, `not a number: ${s}`);
      return n;
    });
  }
  return raw;
}

class FieldError extends Error {
  constructor(field, message) { super(message); this.field = field; }
}

/** The config the form describes: only the fields that differ from TrainConfig's defaults. */
export function readConfig() {
  const config = {}, errors = [];
  for (const f of fields) {
    try {
      const v = parseValue(f, $(`#f-${f.name}`));
      if (JSON.stringify(v) !== JSON.stringify(f.default)) config[f.name] = v;
    } catch (err) {
      if (!(err instanceof FieldError)) throw err;
      errors.push({ field: err.field, message: err.message });
    }
  }
  return { config, errors };
}

function showErrors(errors) {
  document.querySelectorAll(".field-error").forEach((el) => { el.textContent = ""; });
  document.querySelectorAll("[aria-invalid]").forEach((el) => el.removeAttribute("aria-invalid"));
  const general = [];
  for (const e of errors) {
    const slot = e.field && $(`#err-${e.field}`);
    if (slot) {
      slot.textContent = e.message;
      $(`#f-${e.field}`).setAttribute("aria-invalid", "true");
      slot.closest("details").open = true;
    } else {
      general.push(e.field ? `${e.field}: ${e.message}` : e.message);
    }
  }
  const box = $("#form-errors");
  box.replaceChildren(...general.map((m) => h("div", {}, m)));
  box.hidden = general.length === 0;
}

async function validate() {
  const { config, errors } = readConfig();
  sessionStorage.setItem(DRAFT_KEY, JSON.stringify({ ...config, __name: $("#run-name").value }));
  if (errors.length) { showErrors(errors); lastValid = null; return null; }
  try {
    const res = await post("/api/config/validate", { config });
    showErrors(res.errors || []);
    lastValid = res;
    $("#cli-preview").textContent = res.ok ? res.cli : "";
    // the estimate needs no data: show it while only the data field is still missing or wrong
    if (res.ok || (res.errors || []).every((e) => e.field === "data" || e.field === "eval_data")) estimate(config);
    return res;
  } catch (err) {
    showErrors([{ field: null, message: err.message }]);
    return null;
  }
}

function scheduleValidate() {
  clearTimeout(validateTimer);
  validateTimer = setTimeout(validate, 350);
  clearTimeout(previewTimer);
  previewTimer = setTimeout(preview, 600);
}

async function estimate(config) {
  const box = $("#estimate");
  try {
    const e = await post("/api/estimate", { config });
    const free = e.free_mem_mb, peak = e.peak_mem_mb;
    const ratio = free ? Math.min(1, peak / free) : 0;
    const over = free && peak > free;
    box.className = "";
    box.replaceChildren(
      h("div.metric-row", {},
        h("div.metric", {}, h("div.metric-value", {}, `${fmt(peak)} MiB`), h("div.metric-label", {}, "peak memory")),
        h("div.metric", {}, h("div.metric-value", {}, e.tokens_per_s ? fmt(e.tokens_per_s) : "–"),
          h("div.metric-label", {}, e.tokens_per_s ? "tokens / s" : "tokens / s: not measured yet"))),
      h("div.meter", { title: `${fmt(peak)} of ${fmt(free)} MiB free`, "data-over": String(!!over) },
        h("div", { style: `width:${(ratio * 100).toFixed(1)}%` })),
      h("div.hint", {}, over
        ? `Needs more than the ${fmt(free)} MiB free: lower batch_size or max_seq_length, or use load_in_4bit.`
        : `${fmt(free)} MiB free on this machine.`),
      e.parts_mb ? h("div.parts", {}, Object.entries(e.parts_mb).map(([k, v]) =>
        h("span.chip", {}, `${k} ${fmt(v)} MiB`))) : null,
      h("details.basis", {}, h("summary", {}, "how this is estimated"), h("div.hint", {}, e.basis || "")));
  } catch (err) {
    box.className = "error-text";
    box.textContent = err.message;
  }
}

async function preview() {
  const box = $("#preview");
  let config;
  try { config = readConfig().config; } catch (_) { return; }
  const data = config.data || [];
  if (!data.length) return;
  const body = { path: data[0], data_format: config.data_format, max_seq_length: config.max_seq_length, model: config.model,
    think_tokens: config.think_tokens, data_split: config.data_split, data_subset: config.data_subset,
    data_columns: config.data_columns };
  const key = JSON.stringify(body);
  if (key === previewKey) return;
  previewKey = key;
  box.className = "muted";
  box.textContent = `Reading ${data[0]}…`;
  try {
    const p = await post("/api/dataset/preview", body);
    renderPreview(box, p, data[0]);
  } catch (err) {
    previewKey = "";
    box.className = "error-text";
    box.textContent = err.message;
  }
}

function renderPreview(box, p, path) {
  box.className = "";
  const stat = (label, value, warn) => h("div.metric", { "data-warn": String(!!warn) },
    h("div.metric-value", {}, String(value)), h("div.metric-label", {}, label));
  const histHost = h("div");
  const nRejected = p.n_rejected ?? p.rejected.length;
  box.replaceChildren(...[
    h("div.preview-head", {}, h("code", {}, path), h("span.chip", {}, p.format)),
    h("div.metric-row", {}, stat("records", p.n_records), stat("truncated", p.truncated, p.truncated > 0),
      stat("dropped", p.dropped, p.dropped > 0), stat("rejected", nRejected, nRejected > 0)),
    histHost,
    h("div.hint", {}, [
      p.mean_length !== undefined ? `mean ${fmt(p.mean_length)} tokens, longest ${fmt(p.max_length)}` : null,
      p.n_measured !== undefined && p.n_measured < (p.n_examples ?? p.n_measured) ? `measured on the first ${p.n_measured} examples` : null,
      p.no_targets ? `${p.no_targets} with no target tokens left after truncation` : null,
      p.too_long ? `too_long=${p.too_long}` : null,
      p.tokenizer ? `tokenizer: ${p.tokenizer}` : null,
    ].filter(Boolean).join(" · ")),
    p.rejected.length ? h("ul.rejected", {}, p.rejected.slice(0, 20).map((r) =>
      h("li", {}, h("code", {}, `${r.file}:${r.line}`), " ", r.message))) : null,
    h("div.rows", {}, p.first_rows.map((row, i) => h("details", { open: i === 0 },
      h("summary", {}, `record ${i + 1}`), h("pre.row", {}, JSON.stringify(row, null, 2))))),
  ].filter(Boolean));
  if (histogram) histogram.remove();
  histogram = new Histogram(histHost, { title: "token lengths", height: 130 });
  histogram.set(p.lengths.bins, p.lengths.counts, p.max_seq_length, `max_seq_length ${p.max_seq_length}`);
}

// ---- workspace file picker (/api/files; the server never opens dialogs) ----
let pickFor = null, pickDir = "";

async function openPicker(name) {
  pickFor = name;
  $("#file-pick-dir").hidden = !["model", "data", "eval_data", "init_adapter", "resume"].includes(name);
  await listDir("");
  $("#file-dialog").showModal();
}

async function listDir(dir) {
  try {
    const res = await get("/api/files?dir=" + encodeURIComponent(dir));
    pickDir = res.dir || "";
    const parts = pickDir.split("/").filter(Boolean);
    $("#file-crumbs").replaceChildren(h("button.link", { type: "button", onclick: () => listDir("") }, "workspace"),
      ...parts.flatMap((p, i) => [" / ", h("button.link", { type: "button", onclick: () => listDir(parts.slice(0, i + 1).join("/")) }, p)]));
    const items = res.entries.map((e) => h("li", {},
      h("button.file", { type: "button", onclick: () => (e.is_dir ? listDir(e.path) : pick(e.path)) },
        h("span", {}, (e.is_dir ? "📁 " : "📄 ") + e.name), h("span.muted", {}, e.is_dir ? "" : fmt(e.size) + " B"))));
    $("#file-list").replaceChildren(...(items.length ? items : [h("li.muted", {}, "empty folder")]));
    const first = $("#file-list button");
    if (first) first.focus();
  } catch (err) {
    $("#file-list").replaceChildren(h("li.error-text", {}, err.message));
  }
}

function pick(path) {
  const el = $(`#f-${pickFor}`);
  const f = fields.find((x) => x.name === pickFor);
  if (f.type.startsWith("list") && el.value.trim()) el.value = el.value.trim() + ", " + path;
  else el.value = path;
  $("#file-dialog").close();
  el.focus();
  scheduleValidate();
}

async function start(e) {
  e.preventDefault();
  const btn = $("#start-btn");
  btn.disabled = true;
  $("#form-status").textContent = "Checking…";
  try {
    const res = await validate();
    if (!res || !res.ok) {
      $("#form-status").textContent = "Fix the marked fields first.";
      const bad = document.querySelector("[aria-invalid=true]");
      if (bad) bad.focus();
      return;
    }
    const name = $("#run-name").value.trim() || undefined;
    const run = await post("/api/runs", { config: readConfig().config, name });
    $("#form-status").textContent = run.status === "queued" ? "Queued: another run is training." : "Started.";
    bus.emit("refresh-runs");
    bus.emit("navigate", { view: "run", runId: run.id });
  } catch (err) {
    $("#form-status").textContent = "";
    showErrors(err.errors || [{ field: null, message: err.message }]);
  } finally {
    btn.disabled = false;
  }
}

function restoreDraft() {
  let draft;
  try { draft = JSON.parse(sessionStorage.getItem(DRAFT_KEY) || "null"); } catch (_) { draft = null; }
  if (!draft) return;
  $("#run-name").value = draft.__name || "";
  for (const f of fields) {
    if (!(f.name in draft)) continue;
    const el = $(`#f-${f.name}`), v = draft[f.name];
    if (f.type === "bool") el.checked = !!v;
    else el.value = v === null ? "" : Array.isArray(v) ? v.join(", ") : String(v);
  }
}

/** Fill the form from a run's config (used by "New run like this"). */
export function fillForm(config) {
  for (const f of fields) {
    const el = $(`#f-${f.name}`), v = f.name in config ? config[f.name] : f.default;
    if (f.type === "bool") el.checked = !!v;
    else el.value = v === null || v === undefined ? "" : Array.isArray(v) ? v.join(", ") : String(v);
  }
  scheduleValidate();
}

export async function initNewRun() {
  const form = $("#config-form");
  form.addEventListener("submit", start);
  form.addEventListener("input", scheduleValidate);
  form.addEventListener("change", scheduleValidate);
  $("#file-cancel").addEventListener("click", () => $("#file-dialog").close());
  $("#file-pick-dir").addEventListener("click", () => { if (pickDir) pick(pickDir); });
  $("#copy-cli-btn").addEventListener("click", async () => {
    const res = await validate();
    if (!res || !res.ok) return;
    $("#form-status").textContent = (await copyText(res.cli)) ? "Command copied." : "Copy failed; select the command below.";
  });
  $("#yaml-btn").addEventListener("click", async () => {
    const res = await validate();
    if (res && res.ok) download(($("#run-name").value.trim() || "train") + ".yaml", res.yaml, "application/yaml");
  });
  bus.on("fill-form", fillForm);
  try {
    const schema = await get("/api/config/schema");
    fields = schema.fields;
  } catch (err) {
    showError(err);
    return;
  }
  const host = $("#config-fields");
  for (const [group, title, open] of GROUPS) {
    const fs = fields.filter((f) => f.group === group);
    if (!fs.length) continue;
    host.append(h("details.group", { open, dataset: { group } }, h("summary", {}, title,
      h("span.muted.small", {}, ` ${fs.length} settings`)), h("div.group-fields", {}, fs.map(fieldRow))));
  }
  const other = fields.filter((f) => !GROUPS.some(([g]) => g === f.group));
  if (other.length) host.append(h("details.group", {}, h("summary", {}, "Other"), h("div.group-fields", {}, other.map(fieldRow))));
  restoreDraft();
  store.formReady = true;
  scheduleValidate();
}
