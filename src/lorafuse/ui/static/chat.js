// "Chat": talk to a run's adapter, the base model it was trained from, or the built-in model, one
// or two side by side, streamed from POST /api/chat (SSE read with fetch + ReadableStream). The
// base and the adapter of one run are answered by the same `lorafuse serve` process on the server
// (`adapter: false` picks the base), so "base vs adapter" costs one model load. Each pane keeps
// its own history.

import { postStream } from "./api.js";
import { $, bus, h, runLabel, store } from "./dom.js";

const BUILTIN = "builtin";
const panes = {
  a: { select: "#chat-a", msgs: "#chat-a-msgs", title: "#chat-a-title", history: [], model: BUILTIN },
  b: { select: "#chat-b", msgs: "#chat-b-msgs", title: "#chat-b-title", history: [], model: "" },
};
let busy = false;

const chatable = () => store.runs.filter((r) => r.has_final || r.last_checkpoint_step);

/** Option value -> label and the /api/chat fields that pick the model. */
function target(value) {
  if (!value) return null;
  if (value === BUILTIN) return { label: "built-in model (SmolLM2-135M-Instruct)", body: { run_id: null } };
  const [kind, id] = [value.slice(0, value.indexOf(":")), value.slice(value.indexOf(":") + 1)];
  const run = store.runs.find((r) => r.id === id);
  const name = run ? runLabel(run) : id;
  return kind === "base"
    ? { label: `base model of ${name}`, body: { run_id: id, adapter: false } }
    : { label: `adapter: ${name}`, body: { run_id: id } };
}

function fillSelects() {
  for (const [k, p] of Object.entries(panes)) {
    const sel = $(p.select);
    const runs = chatable();
    const opts = [
      k === "b" ? h("option", { value: "" }, "(none)") : null,
      runs.length ? h("optgroup", { label: "adapters" }, runs.map((r) => h("option", { value: `adapter:${r.id}` }, runLabel(r)))) : null,
      runs.length ? h("optgroup", { label: "base models" }, runs.map((r) => h("option", { value: `base:${r.id}` }, `base of ${runLabel(r)}`))) : null,
      h("option", { value: BUILTIN }, "built-in SmolLM2-135M-Instruct"),
    ];
    sel.replaceChildren(...opts.filter(Boolean));
    sel.value = [...sel.options].some((o) => o.value === p.model) ? p.model : (k === "b" ? "" : BUILTIN);
    p.model = sel.value;
    titleOf(k);
  }
}

function titleOf(k) {
  const p = panes[k], t = target(p.model);
  $(p.title).textContent = t ? t.label : "off";
  if (k === "b") $("#chat-b-pane").classList.toggle("off", !p.model);
}

function bubble(role, text) {
  return h("div.msg", { dataset: { role } }, h("div.msg-role", {}, role), h("div.msg-text", {}, text));
}

async function ask(k, text) {
  const p = panes[k], t = target(p.model);
  if (!t) return;
  p.history.push({ role: "user", content: text });
  const box = $(p.msgs);
  box.append(bubble("user", text));
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  box.append(out);
  const textEl = out.querySelector(".msg-text");
  textEl.dataset.wait = "loading the model…";
  let reply = "";
  try {
    await postStream("/api/chat", {
      ...t.body, messages: p.history,
      max_tokens: Number($("#chat-max").value) || 128, temperature: Number($("#chat-temp").value) || 0,
    }, (d) => {
      if (d.error) throw new Error(d.error);
      reply += d.delta || "";
      textEl.textContent = reply;
      box.scrollTop = box.scrollHeight;
    });
    if (!reply) textEl.textContent = "(empty reply)";
    p.history.push({ role: "assistant", content: reply });
  } catch (err) {
    out.classList.add("error");
    textEl.textContent = (reply ? reply + "\n" : "") + "Error: " + err.message;
    p.history.pop();
  } finally {
    out.classList.remove("streaming");
  }
}

async function send(e) {
  e.preventDefault();
  const ta = $("#chat-text");
  const text = ta.value.trim();
  if (!text || busy) return;
  busy = true;
  $("#chat-send").disabled = true;
  ta.value = "";
  try {
    await Promise.all(Object.keys(panes).map((k) => ask(k, text)));
  } finally {
    busy = false;
    $("#chat-send").disabled = false;
    ta.focus();
  }
}

function clear() {
  for (const p of Object.values(panes)) { p.history = []; $(p.msgs).replaceChildren(); }
}

export function initChat() {
  $("#chat-form").addEventListener("submit", send);
  $("#chat-text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
  });
  for (const [k, p] of Object.entries(panes)) {
    $(p.select).addEventListener("change", (e) => {
      p.model = e.target.value; p.history = []; $(p.msgs).replaceChildren(); titleOf(k);
    });
  }
  $("#chat-clear").addEventListener("click", clear);
  bus.on("runs", fillSelects);
  bus.on("view", (v) => { if (v === "chat") fillSelects(); });
  bus.on("chat-with", (id) => {  // "Chat with this adapter": its base on the left, it on the right
    panes.a.model = id ? `base:${id}` : BUILTIN;
    panes.b.model = id ? `adapter:${id}` : "";
    clear();
    bus.emit("navigate", { view: "chat" });
    fillSelects();
  });
}
