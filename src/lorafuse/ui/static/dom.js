// DOM helpers and the page's shared state (the runs list), with a tiny event bus.

/** h("div.card", {onclick}, child, "text") -> element. Class names after dots in the tag. */
export function h(tag, attrs = {}, ...children) {
  const [name, ...classes] = tag.split(".");
  const el = document.createElement(name || "div");
  if (classes.length) el.className = classes.join(" ");
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false) el.append(c);
  return el;
}

export const $ = (sel) => document.querySelector(sel);

const listeners = {};
export const bus = {
  on(ev, fn) { (listeners[ev] ||= []).push(fn); },
  emit(ev, arg) { for (const fn of listeners[ev] || []) fn(arg); },
};

/** The runs the server knows (refreshed by the sidebar); views read it, never cache their own. */
export const store = { runs: [], info: null };
export const runById = (id) => store.runs.find((r) => r.id === id);
export const runLabel = (r) => r ? (r.name || r.id) : "";

export const STATUS_LABEL = {
  queued: "queued", running: "running", stopping: "stopping", stopped: "stopped",
  finished: "finished", failed: "failed", cancelled: "cancelled",
};
export const badge = (status) => h("span.badge", { "data-status": status }, STATUS_LABEL[status] || status);

/** Seconds -> "1h 02m" / "3m 05s" / "12s". */
export function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const hh = Math.floor(s / 3600), mm = Math.floor((s % 3600) / 60), ss = s % 60;
  if (hh) return `${hh}h ${String(mm).padStart(2, "0")}m`;
  if (mm) return `${mm}m ${String(ss).padStart(2, "0")}s`;
  return `${ss}s`;
}

/** Server times may be epoch seconds or ISO strings. */
export function toDate(t) {
  if (t === null || t === undefined || t === "") return null;
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  return isNaN(d) ? null : d;
}

export function ago(t) {
  const d = toDate(t);
  if (!d) return "";
  const s = (Date.now() - d.getTime()) / 1000;
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return d.toLocaleDateString();
}

/** A visible, dismissable error at the top of the page. */
export function showError(err) {
  const el = $("#banner");
  el.replaceChildren(h("span", {}, String(err.message || err)),
    h("button.btn.small", { onclick: () => { el.hidden = true; }, "aria-label": "Dismiss" }, "×"));
  el.hidden = false;
}

export function download(name, text, type = "text/plain") {
  const a = h("a", { href: URL.createObjectURL(new Blob([text], { type })), download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (_) {  // clipboard API needs a secure context; http://host:port from elsewhere is not one
    const ta = h("textarea", { style: "position:fixed;opacity:0" });
    ta.value = text; document.body.append(ta); ta.select();
    const ok = document.execCommand("copy"); ta.remove();
    return ok;
  }
}
