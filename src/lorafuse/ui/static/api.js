// The HTTP API of `lorafuse ui`: token handling, JSON calls, event streams and SSE over fetch.
// The token comes from the page's own URL (?token=...) once, then lives in sessionStorage, so a
// reload or a hash change keeps it while it never sits in the address bar longer than needed.

const TOKEN_KEY = "lorafuse.token";

function initToken() {
  const url = new URL(window.location.href);
  const t = url.searchParams.get("token");
  if (t) {
    sessionStorage.setItem(TOKEN_KEY, t);
    url.searchParams.delete("token");
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
}
initToken();

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

/** A URL with the token in the query: for EventSource and download links (no headers there). */
export function withToken(path) {
  const t = token();
  if (!t) return path;
  return path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(t);
}

export class ApiError extends Error {
  constructor(status, detail, errors = null) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
    this.errors = errors;  // 422 config errors: [{field, message}]
  }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const t = token();
  if (t) h["Authorization"] = "Bearer " + t;
  return h;
}

async function errorOf(res) {
  let detail = res.statusText || `HTTP ${res.status}`, errors = null;
  try {
    const body = await res.json();
    if (body && body.detail !== undefined) detail = body.detail;
    if (body && Array.isArray(body.errors)) errors = body.errors;
  } catch (_) { /* not JSON: keep the status text */ }
  if (Array.isArray(detail)) {  // FastAPI's request-validation errors
    detail = detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
  }
  if (res.status === 401) detail = `${detail} (open the URL with ?token=... printed by \`lorafuse ui\`)`;
  return new ApiError(res.status, detail, errors);
}

/** fetch, with a network failure said in words (the server stopped, the machine went away). */
async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, `cannot reach the lorafuse ui server (${err.message}); is it still running?`);
  }
}

/** JSON call; throws ApiError with the server's `detail` message. */
export async function api(path, { method = "GET", body } = {}) {
  const res = await send(path, {
    method,
    headers: headers(body !== undefined),
    body: body !== undefined ? JSON.stringify(body) : undefined,
  });
  if (!res.ok) throw await errorOf(res);
  return res.json();
}

export const get = (path) => api(path);
export const post = (path, body = {}) => api(path, { method: "POST", body });

/**
 * POST and read a text/event-stream response with fetch + ReadableStream (EventSource is GET-only).
 * Calls onData(parsed JSON) per `data:` line until `data: [DONE]`; resolves when the stream ends.
 */
export async function postStream(path, body, onData, signal) {
  const res = await send(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!res.ok) throw await errorOf(res);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, cut).replace(/\r$/, "");
      buf = buf.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}
