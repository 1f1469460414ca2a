// Small canvas charts: line charts with axes, ticks, legend and a hover read-out, and a histogram
// with a marker line. No library: a few hundred points per series is all a fine-tune produces.

export const PALETTE = ["#4f6bed", "#e8663d", "#2aa876", "#b556d8", "#d4a51c", "#1fa2c4", "#d9466f", "#7a8599"];

function css(name, fallback) {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** Round tick positions covering [lo, hi] with about n steps (1, 2, 5 x 10^k). */
export function niceTicks(lo, hi, n = 5, integer = false) {
  if (!isFinite(lo) || !isFinite(hi)) return [];
  if (hi === lo) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const mults = integer && mag <= 1 ? [1, 2, 5, 10] : [1, 2, 2.5, 5, 10];  // steps and counts: whole
  let step = mults.map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

/** Short number text for axes and read-outs: 0.000123 -> 1.23e-4, 12345 -> 12.3k. */
export function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 1000) return v.toFixed(0);
  if (a >= 100) return v.toFixed(1).replace(/\.0$/, "");
  if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
  if (a >= 0.01) return v.toFixed(3).replace(/\.?0+$/, "");
  return v.toExponential(1).replace("e-", "e-");
}

/** Axis label: as many decimals as the tick step needs (494.5, not 495), no more. */
export function tickFmt(v, step) {
  const a = Math.max(Math.abs(v), Math.abs(step));
  if (a >= 1e4) return fmt(v);
  if (Math.abs(step) < 1e-3) {  // 1.95e-4 next to 2.00e-4: the mantissa gets the step's digits
    if (v === 0) return "0";
    const exp = Math.floor(Math.log10(a));
    const m = step / 10 ** exp;
    let d = 0;
    while (d < 4 && Math.abs(m * 10 ** d - Math.round(m * 10 ** d)) > 1e-6) d++;
    return (v / 10 ** exp).toFixed(d) + "e" + exp;
  }
  let dec = 0;
  while (dec < 6 && Math.abs(step * 10 ** dec - Math.round(step * 10 ** dec)) > 1e-6) dec++;
  return v.toFixed(dec);
}

const PAD = { l: 48, r: 12, t: 8, b: 22 };

class CanvasChart {
  constructor(container, { title = "", unit = "", height = 180 } = {}) {
    this.root = document.createElement("figure");
    this.root.className = "chart card";
    this.head = document.createElement("figcaption");
    this.head.className = "chart-head";
    this.titleEl = document.createElement("span");
    this.titleEl.className = "chart-title";
    this.titleEl.textContent = title + (unit ? ` (${unit})` : "");
    this.valueEl = document.createElement("span");
    this.valueEl.className = "chart-value";
    this.legendEl = document.createElement("span");
    this.legendEl.className = "legend";
    this.head.append(this.titleEl, this.legendEl, this.valueEl);
    this.canvas = document.createElement("canvas");
    this.canvas.style.height = height + "px";
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", title);
    this.root.append(this.head, this.canvas);
    container.append(this.root);
    this.hoverX = null;
    this.canvas.addEventListener("mousemove", (e) => {
      const r = this.canvas.getBoundingClientRect();
      this.hoverX = e.clientX - r.left;
      this.draw();
    });
    this.canvas.addEventListener("mouseleave", () => { this.hoverX = null; this.draw(); });
    this.resize = new ResizeObserver(() => this.draw());
    this.resize.observe(this.canvas);
  }

  remove() { this.resize.disconnect(); this.root.remove(); }

  /** Size the backing store to CSS pixels x devicePixelRatio; returns the 2-D context. */
  context() {
    const dpr = window.devicePixelRatio || 1;
    const w = this.canvas.clientWidth, h = this.canvas.clientHeight;
    if (this.canvas.width !== Math.round(w * dpr) || this.canvas.height !== Math.round(h * dpr)) {
      this.canvas.width = Math.round(w * dpr);
      this.canvas.height = Math.round(h * dpr);
    }
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px " + css("--font-mono", "monospace");
    return { ctx, w, h };
  }

  axes(ctx, w, h, xs, ys, xFmt = null) {
    const yStep = ys.ticks.length > 1 ? ys.ticks[1] - ys.ticks[0] : 1;
    const xStep = xs.ticks.length > 1 ? xs.ticks[1] - xs.ticks[0] : 1;
    const grid = css("--grid", "#e5e7eb"), text = css("--muted", "#6b7280");
    ctx.strokeStyle = grid; ctx.fillStyle = text; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (const t of ys.ticks) {
      const y = ys.map(t);
      ctx.beginPath(); ctx.moveTo(PAD.l, y + 0.5); ctx.lineTo(w - PAD.r, y + 0.5); ctx.stroke();
      ctx.fillText(tickFmt(t, yStep), PAD.l - 6, y);
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const t of xs.ticks) ctx.fillText(xFmt ? xFmt(t) : tickFmt(t, xStep), xs.map(t), h - PAD.b + 6);
    ctx.strokeStyle = css("--axis", "#9ca3af");
    ctx.beginPath(); ctx.moveTo(PAD.l, PAD.t); ctx.lineTo(PAD.l, h - PAD.b); ctx.lineTo(w - PAD.r, h - PAD.b); ctx.stroke();
  }
}

function scale(lo, hi, a, b, n, integer = false) {
  const ticks = niceTicks(lo, hi, n, integer);
  if (ticks.length) { lo = Math.min(lo, ticks[0]); hi = Math.max(hi, ticks[ticks.length - 1]); }
  if (hi === lo) hi = lo + 1;
  return { lo, hi, ticks, map: (v) => a + ((v - lo) / (hi - lo)) * (b - a) };
}

/** Line chart of one or more series [{name, color, points: [[x, y], ...]}] against step. */
export class LineChart extends CanvasChart {
  constructor(container, opts = {}) {
    super(container, opts);
    this.series = [];
    this.markers = [];  // [{x, label}]: vertical lines, e.g. where a run was resumed
    this.empty = opts.empty || "no points yet";
    this.alwaysLegend = !!opts.alwaysLegend;
    this.xFmt = opts.xFmt || null;
  }

  setSeries(series, markers = []) {
    this.series = series;
    this.markers = markers;
    this.legendEl.replaceChildren();
    if (series.length > 1 || (this.alwaysLegend && series.length)) {
      for (const s of series) {
        const item = document.createElement("span");
        item.className = "legend-item";
        const dot = document.createElement("i");
        dot.style.background = s.color;
        item.append(dot, document.createTextNode(s.name));
        this.legendEl.append(item);
      }
    }
    this.draw();
  }

  pointCount() { return this.series.reduce((n, s) => n + s.points.length, 0); }

  draw() {
    const { ctx, w, h } = this.context();
    const all = this.series.flatMap((s) => s.points).filter((p) => isFinite(p[1]));
    this.canvas.dataset.points = String(all.length);
    if (!all.length) {
      ctx.fillStyle = css("--muted", "#6b7280"); ctx.textAlign = "center"; ctx.textBaseline = "middle";
      ctx.fillText(this.empty, w / 2, h / 2);
      this.valueEl.textContent = "";
      return;
    }
    let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const ys0 = all.map((p) => p[1]);
    let [y0, y1] = [Math.min(...ys0), Math.max(...ys0)];
    const padY = (y1 - y0) * 0.05 || Math.abs(y1) * 0.05 || 1;
    y0 -= padY; y1 += padY;
    if (Math.min(...ys0) >= 0 && y0 < 0) y0 = 0;
    const xs = scale(x0, x1, PAD.l, w - PAD.r, Math.max(2, Math.floor((w - PAD.l) / 80)), true);
    const ys = scale(y0, y1, h - PAD.b, PAD.t, 4);
    this.axes(ctx, w, h, xs, ys, this.xFmt);
    ctx.save();
    ctx.beginPath(); ctx.rect(PAD.l, PAD.t - 2, w - PAD.l - PAD.r + 2, h - PAD.t - PAD.b + 4); ctx.clip();
    for (const s of this.series) {
      const pts = s.points.filter((p) => isFinite(p[1]));
      ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 1.75;
      ctx.setLineDash(s.dashed ? [5, 4] : []);
      ctx.beginPath();
      pts.forEach((p, i) => (i ? ctx.lineTo(xs.map(p[0]), ys.map(p[1])) : ctx.moveTo(xs.map(p[0]), ys.map(p[1]))));
      ctx.stroke();
      if (pts.length < 40 || s.dots) {
        for (const p of pts) { ctx.beginPath(); ctx.arc(xs.map(p[0]), ys.map(p[1]), 2.25, 0, 2 * Math.PI); ctx.fill(); }
      }
    }
    ctx.restore();
    ctx.setLineDash([3, 3]);
    ctx.strokeStyle = css("--warn", "#b7791f"); ctx.fillStyle = css("--warn", "#b7791f");
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    for (const m of this.markers) {
      if (m.x < xs.lo || m.x > xs.hi) continue;
      const x = Math.round(xs.map(m.x)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, PAD.t); ctx.lineTo(x, h - PAD.b); ctx.stroke();
      ctx.fillText(m.label, x + 3, PAD.t);
    }
    ctx.setLineDash([]);
    this.hover(ctx, w, h, xs, ys);
  }

  /** Crosshair at the nearest step; the head shows every series' value there. */
  hover(ctx, w, h, xs, ys) {
    const last = this.series.map((s) => s.points[s.points.length - 1]).filter(Boolean);
    if (this.hoverX === null || this.hoverX < PAD.l) {
      this.valueEl.textContent = this.series.length === 1 && last.length && !this.alwaysLegend ? `${fmt(last[0][1])} @ ${fmt(last[0][0])}` : "";
      return;
    }
    const x = xs.lo + ((this.hoverX - PAD.l) / (w - PAD.r - PAD.l)) * (xs.hi - xs.lo);
    const parts = [];
    let nearestX = null;
    for (const s of this.series) {
      let best = null;
      for (const p of s.points) if (isFinite(p[1]) && (!best || Math.abs(p[0] - x) < Math.abs(best[0] - x))) best = p;
      if (!best) continue;
      nearestX = nearestX === null || Math.abs(best[0] - x) < Math.abs(nearestX - x) ? best[0] : nearestX;
      ctx.fillStyle = s.color;
      ctx.beginPath(); ctx.arc(xs.map(best[0]), ys.map(best[1]), 4, 0, 2 * Math.PI); ctx.fill();
      parts.push((this.series.length > 1 ? s.name + " " : "") + fmt(best[1]));
    }
    if (nearestX !== null) {
      ctx.strokeStyle = css("--axis", "#9ca3af"); ctx.setLineDash([3, 3]);
      ctx.beginPath(); ctx.moveTo(xs.map(nearestX) + 0.5, PAD.t); ctx.lineTo(xs.map(nearestX) + 0.5, h - PAD.b); ctx.stroke();
      ctx.setLineDash([]);
      this.valueEl.textContent = `step ${fmt(nearestX)}: ${parts.join(" · ")}`;
    }
  }
}

/** Histogram of {bins, counts} (bins: left edges, or counts+1 edges) with a vertical marker. */
export class Histogram extends CanvasChart {
  constructor(container, opts = {}) {
    super(container, opts);
    this.color = opts.color || PALETTE[0];
  }

  set(bins, counts, marker, markerLabel) {
    this.bins = bins; this.counts = counts; this.marker = marker; this.markerLabel = markerLabel;
    this.draw();
  }

  edges() {
    const b = this.bins || [];
    if (b.length === this.counts.length + 1) return b;
    const w = b.length > 1 ? b[1] - b[0] : 1;
    return [...b, b[b.length - 1] + w];
  }

  draw() {
    const { ctx, w, h } = this.context();
    if (!this.counts || !this.counts.length) return;
    const e = this.edges();
    const xMax = Math.max(e[e.length - 1], this.marker || 0) * 1.02;
    const xs = scale(Math.min(0, e[0]), xMax, PAD.l, w - PAD.r, Math.max(2, Math.floor((w - PAD.l) / 70)), true);
    const ys = scale(0, Math.max(...this.counts) * 1.1, h - PAD.b, PAD.t, 4, true);
    this.axes(ctx, w, h, xs, ys);
    let hovered = null;
    this.counts.forEach((c, i) => {
      const a = xs.map(e[i]), b = xs.map(e[i + 1]);
      const over = this.hoverX !== null && this.hoverX >= a && this.hoverX < b;
      if (over) hovered = i;
      ctx.fillStyle = this.color; ctx.globalAlpha = over ? 1 : 0.75;
      ctx.fillRect(a + 0.5, ys.map(c), Math.max(1, b - a - 1), ys.map(0) - ys.map(c));
    });
    ctx.globalAlpha = 1;
    if (this.marker) {
      const x = xs.map(this.marker);
      ctx.strokeStyle = css("--danger", "#d9466f"); ctx.lineWidth = 1.5; ctx.setLineDash([4, 3]);
      ctx.beginPath(); ctx.moveTo(x, PAD.t); ctx.lineTo(x, h - PAD.b); ctx.stroke(); ctx.setLineDash([]);
      ctx.fillStyle = css("--danger", "#d9466f"); ctx.textAlign = x > w - 120 ? "right" : "left"; ctx.textBaseline = "top";
      ctx.fillText(this.markerLabel || fmt(this.marker), x + (x > w - 120 ? -4 : 4), PAD.t);
    }
    this.valueEl.textContent = hovered === null ? "" :
      `${fmt(e[hovered])}–${fmt(e[hovered + 1])} tokens: ${this.counts[hovered]} records`;
  }
}
