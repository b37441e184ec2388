"""The dashboard page: one self-contained HTML document (no CDN: training machines are offline).

Inline in a module rather than a .html file so it ships with the package without package_data.
The script polls ``api/status`` (relative, so the page also works behind a path-prefix proxy)
every 2 s and fills elements with stable ids that tests read back: ``tokens-per-s``, ``step``,
``eta``, ``queue-<name>`` and its chart ``chart-queue-<name>``, ``kv-engine-<id>``,
``metric-<name>``, ``chart-reward_mean``; asynchronous mode: ``staleness-<k>`` (trajectories at
staleness k, over the run), ``staleness-last-<k>``, ``staleness-mean``, ``staleness-last-step``,
``staleness-chart`` (bars ``staleness-bar-<k>``), ``busy-engine``, ``busy-trainer`` (percent) and
``chart-busy`` (lines ``chart-busy-line-engine``, ``chart-busy-line-trainer``). Names in ids pass
through ``safeId`` (anything outside ``[A-Za-z0-9_-]`` becomes ``_``).
"""

PAGE_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rlmega dashboard</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
  header { display: flex; gap: 16px; align-items: baseline; padding: 12px 20px; background: #1d2330; color: #fff; }
  header h1 { font-size: 18px; margin: 0; }
  header .muted { color: #aab; }
  .pill { padding: 2px 10px; border-radius: 10px; background: #2e7d32; font-weight: 600; }
  .pill.stop { background: #c62828; } .pill.down { background: #777; }
  main { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 14px; padding: 14px 20px; }
  section { background: #fff; border-radius: 8px; padding: 12px 16px; box-shadow: 0 1px 2px #0002; }
  .charts { grid-column: 1 / -1; display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr));
            gap: 14px; }
  h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .05em; color: #667; margin: 0 0 8px; }
  .big { font-size: 28px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .bar { height: 8px; background: #e3e6ec; border-radius: 4px; margin: 8px 0; }
  .bar > div { height: 100%; background: #3b6fd8; border-radius: 4px; width: 0; }
  table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
  td, th { text-align: left; padding: 3px 6px; border-bottom: 1px solid #eee; }
  th { color: #667; font-weight: 500; }
  .empty { color: #99a; font-style: italic; }
  svg text { font-size: 11px; fill: #667; }
  .sub { font-size: 12px; color: #667; margin: 8px 0 0; }
</style>
</head>
<body>
<header>
  <h1>rlmega</h1>
  <span id="run-state" class="pill down">connecting</span>
  <span class="muted">should_stop: <b id="should-stop">–</b></span>
  <span class="muted">uptime: <b id="uptime">–</b></span>
  <span class="muted" id="updated"></span>
</header>
<main>
  <section>
    <h2>Progress</h2>
    <div class="big"><span id="step">–</span> / <span id="total-steps">–</span></div>
    <div class="bar"><div id="progress-bar"></div></div>
    <div>ETA <b id="eta">–</b> &middot; <span id="s-per-step">–</span> s/step</div>
  </section>
  <section>
    <h2>Throughput</h2>
    <div class="big"><span id="tokens-per-s">–</span> <small>tokens/s</small></div>
    <div>prefill <b id="prefill-tokens-per-s">–</b> &middot; decode <b id="decode-tokens-per-s">–</b>
      tokens/s over <span id="token-window">–</span> s</div>
    <div>total <b id="total-tokens">–</b> tokens (prefill <span id="total-prefill-tokens">–</span>,
      decode <span id="total-decode-tokens">–</span>)</div>
  </section>
  <section>
    <h2>Step timings (s)</h2>
    <table>
      <tr><th></th><th>last</th><th>mean</th><th>count</th></tr>
      <tr><td>training step</td><td id="training-step-last">–</td><td id="training-step-mean">–</td>
          <td id="training-step-count">–</td></tr>
      <tr><td>batch generation</td><td id="batch-generation-last">–</td><td id="batch-generation-mean">–</td>
          <td id="batch-generation-count">–</td></tr>
    </table>
  </section>
  <section><h2>Queues</h2><div id="queues"></div><div id="queue-charts"></div></section>
  <section>
    <h2>Staleness</h2>
    <div>mean <b id="staleness-mean">–</b> steps &middot; last step <b id="staleness-last-step">–</b></div>
    <div id="staleness-chart"></div>
    <div id="staleness"></div>
  </section>
  <section>
    <h2>Busy</h2>
    <div>engines <b id="busy-engine">–</b> &middot; trainer <b id="busy-trainer">–</b>
      of the last step's wall time</div>
    <div id="chart-busy"></div>
  </section>
  <section><h2>KV-cache max concurrency</h2><div id="kv"></div></section>
  <section><h2>Start-up</h2><div class="sub">seconds since the command started; phases that ran at once
    overlap</div><div id="startup"></div></section>
  <section><h2>Latest metrics <span id="metrics-step"></span></h2><div id="metrics"></div></section>
  <div class="charts">
    <section><h2>reward_mean</h2><div id="chart-reward_mean"></div></section>
    <section><h2>kl_ref</h2><div id="chart-kl_ref"></div></section>
    <section id="distill" hidden><h2>distill_kl</h2><div id="chart-distill_kl"></div></section>
  </div>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const safeId = (s) => String(s).replace(/[^A-Za-z0-9_-]/g, "_");
const SVG = "http://www.w3.org/2000/svg";

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  if (Math.abs(v) >= 100) return v.toFixed(1);
  return String(+v.toPrecision(4));
}
function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
  const pad = (x) => String(x).padStart(2, "0");
  return h ? `${h}h ${pad(m)}m ${pad(sec)}s` : m ? `${m}m ${pad(sec)}s` : `${sec}s`;
}
function set(id, text) { const el = $(id); if (el) el.textContent = text; }

// A key/value table whose cells get ids prefix + name, rebuilt each poll (names can appear later).
function kvTable(container, rows, prefix, header) {
  container.replaceChildren();
  if (!rows.length) {
    const p = document.createElement("div"); p.className = "empty"; p.textContent = "none reported";
    container.append(p); return;
  }
  const t = document.createElement("table");
  const hr = t.insertRow();
  for (const h of header) { const th = document.createElement("th"); th.textContent = h; hr.append(th); }
  for (const [name, value, extra] of rows) {
    const r = t.insertRow();
    r.insertCell().textContent = name;
    const c = r.insertCell(); c.id = prefix + safeId(name); c.textContent = fmt(value);
    if (extra !== undefined) r.insertCell().append(extra);
  }
  container.append(t);
}

// An <svg> of w x h and a helper that appends elements to it.
function newSvg(w, h) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`); svg.setAttribute("width", "100%");
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e); return e;
  };
  return [svg, el];
}
function empty(container, text) {
  const p = document.createElement("div"); p.className = "empty"; p.textContent = text;
  container.replaceChildren(p);
}
const COLOURS = ["#3b6fd8", "#e07b24", "#2e7d32"];

// Inline SVG line chart of history[key] against history[].step, one line per key. Options: w, h,
// yMin/yMax (always inside the range shown), xFmt/yFmt (axis labels). Line ids: the container's
// id + "-line" for one key, + "-line-<key>" for several.
function lineChart(container, history, keys, opt = {}) {
  const { w = 720, h = 200, yMin, yMax, xFmt = (x) => "step " + fmt(x), yFmt = fmt } = opt;
  keys = [].concat(keys);
  const series = keys.map((key) => history.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]));
  if (!series.some((pts) => pts.length)) { empty(container, "no data yet"); return container; }
  const stride = Math.ceil(Math.max(...series.map((pts) => pts.length)) / 2000);  // keep the DOM small on long runs
  const S = series.map((pts) => pts.filter((_, i) => i % stride === 0 || i === pts.length - 1));
  const xs = S.flat().map((p) => p[0]), ys = S.flat().map((p) => p[1]);
  if (yMin !== undefined) ys.push(yMin);
  if (yMax !== undefined) ys.push(yMax);
  const pad = 40;
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (w - 2 * pad);
  const Y = (y) => h - pad / 2 - (y - y0) / (y1 - y0) * (h - 1.5 * pad);
  const [svg, el] = newSvg(w, h);
  el("line", { x1: pad, y1: Y(y0), x2: w - pad, y2: Y(y0), stroke: "#ccd" });
  el("line", { x1: pad, y1: Y(y0), x2: pad, y2: Y(y1), stroke: "#ccd" });
  el("text", { x: pad - 4, y: Y(y1) + 4, "text-anchor": "end" }, yFmt(y1));
  el("text", { x: pad - 4, y: Y(y0) + 4, "text-anchor": "end" }, yFmt(y0));
  el("text", { x: pad, y: h - 4 }, xFmt(x0));
  el("text", { x: w - pad, y: h - 4, "text-anchor": "end" }, xFmt(x1));
  S.forEach((P, i) => {
    if (!P.length) return;
    const colour = COLOURS[i % COLOURS.length];
    const line = el("polyline", { fill: "none", stroke: colour, "stroke-width": 2,
                                  points: P.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") });
    if (container.id) line.id = container.id + "-line" + (keys.length > 1 ? "-" + safeId(keys[i]) : "");
    const [lx, ly] = P[P.length - 1];
    el("circle", { cx: X(lx), cy: Y(ly), r: 3, fill: colour });
    el("text", { x: X(lx) - 6, y: Y(ly) - 8, "text-anchor": "end", fill: "#1d2330" }, yFmt(ly));
    if (keys.length > 1) el("text", { x: pad + 6 + 70 * i, y: 14, fill: colour }, "— " + keys[i]);  // legend
  });
  container.replaceChildren(svg);
  return container;
}

// Inline SVG bar chart of [[label, value], ...]; bar ids idPrefix + label.
function barChart(container, bars, idPrefix, w = 360, h = 140) {
  const [svg, el] = newSvg(w, h);
  const top = Math.max(...bars.map(([, v]) => v)) || 1, slot = (w - 20) / bars.length;
  const base = h - 18, H = (v) => v / top * (base - 16);
  bars.forEach(([label, v], i) => {
    const x = 10 + i * slot, bw = Math.max(slot * 0.7, 1);
    el("rect", { id: idPrefix + safeId(label), x: x + (slot - bw) / 2, y: base - H(v), width: bw,
                 height: H(v), fill: "#3b6fd8" });
    el("text", { x: x + slot / 2, y: base - H(v) - 3, "text-anchor": "middle", fill: "#1d2330" }, fmt(v));
    el("text", { x: x + slot / 2, y: h - 4, "text-anchor": "middle" }, label);
  });
  el("line", { x1: 10, y1: base, x2: w - 10, y2: base, stroke: "#ccd" });
  container.replaceChildren(svg);
}

const pct = (f) => (typeof f === "number" ? `${+(100 * f).toFixed(1)}%` : "–");

function renderStaleness(st) {
  const total = st.cumulative, keys = Object.keys(total).map(Number);
  set("staleness-last-step", fmt(st.last_step));
  if (!keys.length) {  // a synchronous run never reports staleness
    set("staleness-mean", "–");
    empty($("staleness-chart"), "none reported (a synchronous run trains on-policy)");
    $("staleness").replaceChildren();
    return;
  }
  // Every k from 0 to the largest seen, so a gap shows as a zero bar (unless the range is absurd).
  const kMax = Math.max(...keys);
  const ks = kMax <= 64 ? Array.from({ length: kMax + 1 }, (_, k) => k) : keys.sort((a, b) => a - b);
  const n = (d, k) => d[String(k)] || 0;
  const count = ks.reduce((a, k) => a + n(total, k), 0);
  set("staleness-mean", count ? fmt(ks.reduce((a, k) => a + k * n(total, k), 0) / count) : "–");
  barChart($("staleness-chart"), ks.map((k) => [String(k), n(total, k)]), "staleness-bar-");
  const t = document.createElement("table"), hr = t.insertRow();
  for (const h of ["staleness", "trajectories", "share", `step ${fmt(st.last_step)}`]) {
    const th = document.createElement("th"); th.textContent = h; hr.append(th);
  }
  for (const k of ks) {
    const r = t.insertRow();
    r.insertCell().textContent = String(k);
    const c = r.insertCell(); c.id = `staleness-${k}`; c.textContent = fmt(n(total, k));
    r.insertCell().textContent = count ? pct(n(total, k) / count) : "–";
    const l = r.insertCell(); l.id = `staleness-last-${k}`; l.textContent = fmt(n(st.last, k));
  }
  $("staleness").replaceChildren(t);
}

function render(s) {
  const state = $("run-state");
  state.textContent = s.should_stop ? "stopping" : "running";
  state.className = "pill" + (s.should_stop ? " stop" : "");
  set("should-stop", String(s.should_stop));
  set("uptime", fmtDuration(s.uptime_s));
  set("updated", "updated " + new Date().toLocaleTimeString());

  const p = s.progress;
  set("step", fmt(p.step)); set("total-steps", fmt(p.total_steps));
  set("eta", fmtDuration(p.eta_s)); set("s-per-step", fmt(p.s_per_step));
  $("progress-bar").style.width = p.total_steps ? `${Math.min(100, 100 * p.step / p.total_steps)}%` : "0";

  const t = s.tokens;
  set("tokens-per-s", fmt(t.tokens_per_s));
  set("prefill-tokens-per-s", fmt(t.prefill_tokens_per_s)); set("decode-tokens-per-s", fmt(t.decode_tokens_per_s));
  set("token-window", fmt(t.window_s)); set("total-tokens", fmt(t.total_tokens));
  set("total-prefill-tokens", fmt(t.total_prefill_tokens)); set("total-decode-tokens", fmt(t.total_decode_tokens));

  for (const kind of ["training_step", "batch_generation"]) {
    const k = s.timings[kind] || {}, id = kind.replace("_", "-");
    set(id + "-last", fmt(k.last)); set(id + "-mean", fmt(k.mean)); set(id + "-count", fmt(k.count));
  }

  kvTable($("queues"), Object.entries(s.queues).map(([n, q]) => [n, q.size === null && q.error ? q.error : q.size]),
          "queue-", ["queue", "size"]);
  $("queue-charts").replaceChildren(...Object.entries(s.queues).map(([n, q]) => {
    const title = document.createElement("div"); title.className = "sub"; title.textContent = `${n} over time`;
    const chart = document.createElement("div"); chart.id = "chart-queue-" + safeId(n);
    lineChart(chart, q.history.map(([ts, size]) => ({ step: ts, size })), "size",
              { w: 360, h: 110, yMin: 0, xFmt: (x) => "t " + fmtDuration(x) });
    const box = document.createElement("div"); box.append(title, chart); return box;
  }));
  kvTable($("kv"), Object.entries(s.kv_cache_max_concurrency), "kv-engine-", ["engine", "max concurrency"]);
  kvTable($("startup"), (s.startup || []).map((p) => [p.phase, p.seconds, `${fmt(p.start_s)} -> ${fmt(p.end_s)} s`]),
          "startup-", ["phase", "seconds", "from -> to"]);
  set("metrics-step", s.latest_metrics.step === undefined ? "" : `(step ${s.latest_metrics.step})`);
  kvTable($("metrics"), Object.entries(s.latest_metrics).filter(([k]) => k !== "step"), "metric-",
          ["metric", "value"]);

  lineChart($("chart-reward_mean"), s.metrics_history, "reward_mean");
  lineChart($("chart-kl_ref"), s.metrics_history, "kl_ref");
  // on-policy distillation's KL to the teachers: shown when the run distils
  $("distill").hidden = !s.metrics_history.some((r) => typeof r.distill_kl === "number");
  lineChart($("chart-distill_kl"), s.metrics_history, "distill_kl");

  renderStaleness(s.staleness);
  set("busy-engine", pct(s.busy.engine)); set("busy-trainer", pct(s.busy.trainer));
  lineChart($("chart-busy"), s.busy.history.map(([step, engine, trainer]) => ({ step, engine, trainer })),
            ["engine", "trainer"], { w: 360, h: 140, yMin: 0, yMax: 1, yFmt: pct });
}

async function poll() {
  try {
    const r = await fetch("api/status", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (e) {  // keep the last numbers on screen; say the run is unreachable
    const state = $("run-state"); state.textContent = "disconnected"; state.className = "pill down";
  }
}
poll();
setInterval(poll, 2000);
</script>
</body>
</html>
"""
