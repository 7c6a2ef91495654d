// kvtier dashboard: polls the server once a second and draws the cache with plain DOM, SVG and canvas.
// No framework, no build step, nothing loaded from elsewhere. Every number that /metrics also exposes is
// written into an element with data-metric="<sample name>" data-labels="k=v,..." data-value="<raw>",
// so a test (or a curious operator) can check the page against Prometheus.
"use strict";

const TIERS = ["device", "host", "disk", "remote"];
const COLORS = { device: "#3b6fb6", host: "#3a9a5b", disk: "#d9822b", remote: "#8e5ea2" };
const ORIGINS = { d: "device", h: "host", k: "disk", r: "remote" };
const FREE = "#e6e8ec";
const POLL_MS = 1000;
const ADVICE_EVERY = 5; // polls between two fetches of the miss-ratio curves
const HIT_WINDOW = 10; // history points (seconds) summed for the hit-rate chart
const SVG = "http://www.w3.org/2000/svg";
const KEY_ITEM = "kvtier-api-key";

const state = { key: takeKey(), polls: 0, advice: null, adviceError: null, canary: null, canaryError: null };

// ------------------------------------------------------------------------------------------- helpers
function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name === "class") node.className = value;
    else if (name === "style") node.style.cssText = value;
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

// Replace a node's children, skipping the null ones (a panel's optional parts).
function put(node, ...children) { node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined)); }

function int(n) { return n === null || n === undefined ? "–" : String(Math.round(n)); }
function pct(x, digits = 1) { return x === null || x === undefined ? "–" : (100 * x).toFixed(digits) + "%"; }
function ratio(num, den) { return den > 0 ? num / den : null; }
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}
function ago(seconds) {
  if (seconds < 60) return seconds.toFixed(0) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

// A number /metrics also has: the text shows it, data-* say which sample it is.
function metric(name, labels, value, text) {
  const attrs = { class: "metric", "data-metric": name, "data-value": String(value) };
  if (labels) attrs["data-labels"] = Object.entries(labels).sort().map(([k, v]) => k + "=" + v).join(",");
  return el("span", attrs, text === undefined ? int(value) : text);
}

// ------------------------------------------------------------------------------------- the API key
function takeKey() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("key");
  if (given !== null) {
    sessionStorage.setItem(KEY_ITEM, given);
    url.searchParams.delete("key");
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem(KEY_ITEM);
}

class NeedKey extends Error {}

async function getJSON(path) {
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) throw new NeedKey("this server needs an API key");
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message || message; } catch (e) { /* not JSON */ }
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function askForKey() {
  const form = $("keyform");
  form.hidden = false;
  form.onsubmit = (event) => {
    event.preventDefault();
    state.key = $("keyinput").value.trim();
    sessionStorage.setItem(KEY_ITEM, state.key);
    form.hidden = true;
    schedule(0);
  };
}

// ----------------------------------------------------------------------------------------- polling
let timer = null;
function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }

async function poll() {
  const cluster = document.body.dataset.mode === "cluster";
  try {
    if (cluster) renderCluster(await getJSON("router/state"));
    else await pollReplica();
    state.polls += 1;
    document.body.dataset.updates = String(state.polls);
    setStatus("live", "live");
  } catch (error) {
    if (error instanceof NeedKey) { setStatus("error", "API key needed"); askForKey(); return; }
    setStatus("error", error.status === 503 ? "loading / unavailable: " + error.message : String(error.message || error));
  }
  schedule(POLL_MS);
}

async function pollReplica() {
  const data = await getJSON("v1/kv/dashboard");
  const features = data.features || {};
  if (features.advice && (state.advice === null || state.polls % ADVICE_EVERY === 0)) {
    try { state.advice = await getJSON("v1/kv/advice"); state.adviceError = null; }
    catch (error) { if (error instanceof NeedKey) throw error; state.adviceError = error.message; }
  }
  if (features.canary) {
    try { state.canary = await getJSON("v1/kv/canary"); state.canaryError = null; }
    catch (error) { if (error instanceof NeedKey) throw error; state.canaryError = error.message; }
  }
  renderReplica(data, features);
}

function setStatus(kind, text) {
  const status = $("status");
  status.className = "status " + kind;
  status.textContent = text;
  if (kind === "live") $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// ----------------------------------------------------------------------------------- replica view
function renderReplica(data, features) {
  $("model").textContent = data.model;
  $("replica").textContent = "replica " + data.replica_id + " · up " + ago(data.uptime_s);
  renderTotals(data.totals);
  renderTiers(data.tiers);
  renderCharts(data.history, Object.keys(data.tiers));
  renderBlockMap(data.block_map);
  renderRequests(data.requests, data.block_size);
  renderPreemptions(data.totals, data.history);
  renderAdvice(features.advice);
  renderCanary(features.canary, (data.totals || {}).canary_checks || { match: {}, mismatch: {} });
}

function stat(label, value, detail) {
  return el("div", { class: "stat" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value),
    el("div", { class: "detail" }, detail || ""));
}

function renderTotals(t) {
  if (!t) { put($("totals"), stat("engine", "loading")); return; }
  const hit = ratio(t.prefix_cache_hits, t.prefix_cache_queries);
  const pre = t.num_preemptions || {};
  put($("totals"),
    stat("running", metric("kvtier:num_requests_running", null, t.num_requests_running), "sequences in the batch"),
    stat("waiting", metric("kvtier:num_requests_waiting", null, t.num_requests_waiting), "sequences queued"),
    stat("prefix-cache hit rate", pct(hit),
      [metric("kvtier:prefix_cache_hits_total", null, t.prefix_cache_hits), " of ",
        metric("kvtier:prefix_cache_queries_total", null, t.prefix_cache_queries), " prompt tokens"]),
    stat("device KV in use", metric("kvtier:kv_cache_usage_perc", null, t.kv_cache_usage, pct(t.kv_cache_usage)),
      "of the device pool"),
    stat("tokens", metric("kvtier:generation_tokens_total", null, t.generation_tokens),
      ["generated · ", metric("kvtier:prompt_tokens_total", null, t.prompt_tokens), " prompt"]),
    stat("preemptions", String((pre.swap || 0) + (pre.recompute || 0)),
      [metric("kvtier:num_preemptions_total", { mode: "swap" }, pre.swap || 0), " swap · ",
        metric("kvtier:num_preemptions_total", { mode: "recompute" }, pre.recompute || 0), " recompute"]),
    // prompt-cache retention (cache_control, prompt_cache_retention): keys kept now, and the prompt
    // tokens of retaining requests that were served from the cache
    stat("retained", [metric("kvtier:retained_keys", null, t.retained_keys || 0), " keys"],
      [metric("kvtier:retained_hit_tokens_total", null, t.retained_hit_tokens || 0), " prompt tokens hit"]),
  );
}

function renderTiers(tiers) {
  const cards = [];
  for (const name of TIERS) {
    const t = tiers[name];
    if (!t) continue;
    const label = { tier: name };
    const row = (dt, dd) => [el("dt", null, dt), el("dd", null, dd)];
    cards.push(el("div", { class: "card", style: "--tier: " + COLORS[name], "data-tier": name },
      el("h3", null, name),
      el("div", { class: "bar", title: pct(t.usage) }, el("span", { style: "width: " + (100 * t.usage).toFixed(2) + "%" })),
      el("dl", { class: "kv" },
        row("occupancy", [metric("kvtier:tier_usage_perc", label, t.usage, pct(t.usage)), " · ",
          metric("kvtier:tier_used_blocks", label, t.used_blocks), " / ",
          metric("kvtier:tier_capacity_blocks", label, t.capacity_blocks), " blocks"]),
        row("hit rate", [pct(t.hit_rate), " all time · ", pct(t.recent_hit_rate), " last min"]),
        row("hits / lookups", [metric("kvtier:tier_hit_blocks_total", label, t.hit_blocks), " / ",
          metric("kvtier:tier_lookups_total", label, t.lookups), " blocks"]),
        row("hit tokens", metric("kvtier:tier_hit_tokens_total", label, t.hit_tokens)),
        row("loaded · stored · evicted", [metric("kvtier:tier_blocks_loaded_total", label, t.blocks_loaded), " · ",
          metric("kvtier:tier_blocks_stored_total", label, t.blocks_stored), " · ",
          metric("kvtier:tier_blocks_evicted_total", label, t.blocks_evicted)]),
        row("retained", [metric("kvtier:tier_retained_blocks", label, t.retained_blocks || 0), " blocks · ",
          el("span", { class: "retained-bytes", "data-value": String(t.retained_bytes || 0) },
            bytes(t.retained_bytes || 0))]),
      )));
  }
  put($("tiers"), ...cards);
}

// ------------------------------------------------------------------------------------------ charts
// A line chart of series [{name, color, values: [[t, v or null], ...]}] over the last `span` seconds,
// y from 0 to 1 drawn as percent; a null breaks the line.
function lineChart(node, series, span, now) {
  const width = Math.max(node.clientWidth, 300), height = Math.max(node.clientHeight, 120);
  const m = { left: 40, right: 10, top: 8, bottom: 34 };
  const w = width - m.left - m.right, h = height - m.top - m.bottom;
  const x = (t) => m.left + w * (1 - (now - t) / span);
  const y = (v) => m.top + h * (1 - v);
  const parts = [];
  node.setAttribute("viewBox", "0 0 " + width + " " + height);
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    parts.push(svg("line", { class: v ? "grid" : "axis", x1: m.left, x2: m.left + w, y1: y(v), y2: y(v) }));
    parts.push(svg("text", { x: m.left - 6, y: y(v) + 4, "text-anchor": "end" }, (100 * v).toFixed(0) + "%"));
  }
  const tick = span > 120 ? 60 : span > 60 ? 30 : 15;
  for (let s = 0; s <= span; s += tick) {
    const label = s === 0 ? "now" : s % 60 ? "-" + s + " s" : "-" + s / 60 + " min";
    parts.push(svg("text", { x: x(now - s), y: m.top + h + 14, "text-anchor": "middle" }, label));
  }
  const legend = [];
  let lx = m.left;
  for (const line of series) {
    let d = "", pen = false;
    const dots = [];
    for (const [t, v] of line.values) {
      if (v === null || v === undefined || now - t > span) { pen = false; continue; }
      const px = x(t).toFixed(1), py = y(Math.min(1, Math.max(0, v))).toFixed(1);
      d += (pen ? "L" : "M") + px + "," + py;
      pen = true;
      if (line.values.length <= 90) dots.push(svg("circle", { cx: px, cy: py, r: 2, fill: line.color }));
    }
    if (d) parts.push(svg("path", { d, fill: "none", stroke: line.color, "stroke-width": 2, "stroke-linejoin": "round" }), ...dots);
    legend.push(svg("rect", { x: lx, y: height - 11, width: 10, height: 10, rx: 2, fill: line.color }));
    legend.push(svg("text", { x: lx + 14, y: height - 2 }, line.name));
    lx += 24 + 7 * line.name.length;
  }
  if (!series.length) parts.push(svg("text", { x: m.left + 8, y: m.top + 16 }, "no tier yet"));
  put(node, ...parts, ...legend);
}

function renderCharts(history, tiers) {
  const points = history.points;
  const now = points.length ? points[points.length - 1].t : Date.now() / 1000;
  // The last minute at first, growing with the history up to all of it (five minutes).
  const elapsed = points.length ? now - points[0].t : 0;
  const span = Math.min(history.seconds, Math.max(60, Math.ceil(elapsed / 60) * 60));
  const names = TIERS.filter((n) => tiers.includes(n));
  const usage = names.map((n) => ({ name: n, color: COLORS[n], values: points.map((p) => [p.t, p.usage[n]]) }));
  lineChart($("chart-usage"), usage, span, now);
  const hits = names.map((n) => ({ name: n, color: COLORS[n], values: points.map((p, i) => {
    let found = 0, asked = 0;
    for (const q of points.slice(Math.max(0, i - HIT_WINDOW + 1), i + 1)) {
      found += (q.hit_blocks || {})[n] || 0;
      asked += (q.lookups || {})[n] || 0;
    }
    return [p.t, ratio(found, asked)];
  }) }));
  lineChart($("chart-hits"), hits, span, now);
}

// --------------------------------------------------------------------------------------- block map
function lighter(hex, amount) {
  const n = parseInt(hex.slice(1), 16);
  const mix = (c) => Math.round(c + (255 - c) * amount);
  return "rgb(" + mix(n >> 16) + "," + mix((n >> 8) & 255) + "," + mix(n & 255) + ")";
}

function cellColor(c) {
  if (c === ".") return FREE;
  const origin = ORIGINS[c.toLowerCase()];
  return c === c.toUpperCase() ? COLORS[origin] : lighter(COLORS[origin], 0.6);
}

function renderBlockMap(map) {
  const canvas = $("blockmap");
  const cells = map.cells;
  const width = Math.max(canvas.clientWidth, 200);
  let size = 16;
  while (size > 3 && Math.ceil(cells.length / Math.floor(width / size)) * size > 240) size -= 1;
  const cols = Math.floor(width / size), rows = Math.ceil(cells.length / cols);
  const ratioPx = window.devicePixelRatio || 1;
  canvas.width = width * ratioPx;
  canvas.height = Math.max(rows * size, size) * ratioPx;
  canvas.style.height = Math.max(rows * size, size) + "px";
  const ctx = canvas.getContext("2d");
  ctx.scale(ratioPx, ratioPx);
  const gap = size >= 6 ? 1 : 0;
  for (let i = 0; i < cells.length; i++) {
    ctx.fillStyle = cellColor(cells[i]);
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
  }
  canvas.onmousemove = (event) => {
    const i = Math.floor(event.offsetY / size) * cols + Math.floor(event.offsetX / size);
    const c = cells[i];
    if (c === undefined) { canvas.title = ""; return; }
    const what = c === "." ? "free" : (c === c.toUpperCase() ? "in use" : "cached") + ", KV from " + ORIGINS[c.toLowerCase()];
    const first = i * map.blocks_per_cell;
    canvas.title = (map.blocks_per_cell > 1 ? "blocks " + first + "–" + (first + map.blocks_per_cell - 1) : "block " + first) + ": " + what;
  };
  const counts = map.counts;
  $("bm-caption").textContent = map.num_blocks + " blocks" + (map.blocks_per_cell > 1 ? ", " + map.blocks_per_cell + " per cell" : "");
  const items = [el("span", null, el("span", { class: "swatch", style: "background:" + FREE }), "free ",
    el("b", { id: "bm-free" }, counts.free))];
  for (const name of TIERS) {
    const n = (map.by_origin || {})[name];
    if (!n) continue;
    items.push(el("span", null, el("span", { class: "swatch", style: "background:" + COLORS[name] }),
      "in use, from " + name + " " + n.in_use + " · ",
      el("span", { class: "swatch", style: "background:" + lighter(COLORS[name], 0.6) }), "cached " + n.cached));
  }
  items.push(el("span", null, "in use ", el("b", { id: "bm-in-use" }, counts.in_use), " · cached idle ",
    el("b", { id: "bm-cached" }, counts.cached)));
  put($("bm-legend"), ...items);
}

// ---------------------------------------------------------------------------------------- requests
function cachedBar(byTier, prompt) {
  const bar = el("span", { class: "stack", title: "prompt tokens served from cache, by tier" });
  for (const name of TIERS) {
    const n = byTier[name] || 0;
    if (n && prompt) bar.append(el("span", { style: "background:" + COLORS[name] + ";width:" + (100 * n / prompt).toFixed(1) + "%" }));
  }
  return bar;
}

function requestRow(seq) {
  const byTier = seq.cached_tokens_by_tier || {};
  const parts = TIERS.filter((n) => byTier[n]).map((n) => byTier[n] + " " + n);
  const cached = seq.cached_tokens === null ? "not yet looked up" : parts.length ? parts.join(" · ") : "none";
  const status = seq.swapped ? "swapped out" : seq.status;
  return el("tr", null,
    el("td", { class: "mono" }, seq.seq_id.length > 18 ? "…" + seq.seq_id.slice(-17) : seq.seq_id),
    el("td", null, el("span", { class: "chip " + seq.status }, status)),
    el("td", { class: "num" }, seq.prompt_tokens), el("td", { class: "num" }, seq.output_tokens),
    el("td", null, cachedBar(byTier, seq.prompt_tokens), cached),
    el("td", { class: "num" }, seq.preemptions), el("td", { class: "num" }, ago(seq.age_s)));
}

function renderRequests(req) {
  $("req-caption").textContent = req.num_running + " running · " + req.num_waiting + " waiting";
  const rows = [...req.running, ...req.waiting].map(requestRow);
  if (!rows.length) { put($("requests"), el("p", { class: "na" }, "idle: no request running or waiting")); return; }
  const more = req.num_running + req.num_waiting - rows.length;
  put($("requests"), el("table", null,
    el("thead", null, el("tr", null, el("th", null, "sequence"), el("th", null, "status"), el("th", { class: "num" }, "prompt"),
      el("th", { class: "num" }, "output"), el("th", null, "cached prompt tokens by tier"), el("th", { class: "num" }, "preempted"),
      el("th", { class: "num" }, "age"))),
    el("tbody", null, rows)), more > 0 ? el("p", { class: "na" }, "… and " + more + " more") : null);
}

function renderPreemptions(totals, history) {
  const pre = (totals && totals.num_preemptions) || {};
  const points = history.points.slice(-120);
  const max = Math.max(1, ...points.map((p) => p.preemptions));
  const width = 280, height = 44, bw = width / 120;
  const bars = points.map((p, i) => svg("rect", { x: (i + 120 - points.length) * bw, y: height - (height - 4) * p.preemptions / max,
    width: Math.max(bw - 0.5, 0.5), height: (height - 4) * p.preemptions / max, fill: "#b7791f" }));
  put($("preemptions"),
    el("div", null, el("b", null, (pre.swap || 0) + (pre.recompute || 0)), " since start: ", pre.swap || 0, " by swap, ",
      pre.recompute || 0, " by recomputation"),
    svg("svg", { viewBox: "0 0 " + width + " " + height, width: "100%", height: height, role: "img" },
      svg("line", { x1: 0, x2: width, y1: height - 0.5, y2: height - 0.5, stroke: "#c4c9d3" }), ...bars),
    el("div", { class: "sub" }, "per second, last 2 min (peak " + max + ")"));
}

// ----------------------------------------------------------------------- miss-ratio curves, canary
function curveChart(name, tier) {
  const width = 340, height = 170, m = { left: 40, right: 14, top: 8, bottom: 30 };
  const w = width - m.left - m.right, h = height - m.top - m.bottom;
  const lo = Math.log2(0.25), hi = Math.log2(8);
  const x = (f) => m.left + w * (Math.log2(Math.max(f, 0.25)) - lo) / (hi - lo);
  const y = (v) => m.top + h * (1 - Math.min(1, Math.max(0, v)));
  const parts = [];
  for (const v of [0, 0.5, 1]) {
    parts.push(svg("line", { class: v ? "grid" : "axis", x1: m.left, x2: m.left + w, y1: y(v), y2: y(v) }));
    parts.push(svg("text", { x: m.left - 4, y: y(v) + 4, "text-anchor": "end" }, (100 * v) + "%"));
  }
  for (const f of [0.25, 0.5, 1, 2, 4, 8]) parts.push(svg("text", { x: x(f), y: m.top + h + 13, "text-anchor": "middle" }, f + "×"));
  const curve = (tier.curve || []).slice().sort((a, b) => a.size_factor - b.size_factor);
  const d = curve.map((p, i) => (i ? "L" : "M") + x(p.size_factor).toFixed(1) + "," + y(p.hit_ratio).toFixed(1)).join("");
  if (d) parts.push(svg("path", { d, fill: "none", stroke: COLORS[name] || "#444", "stroke-width": 2 }));
  for (const p of curve) {
    parts.push(svg("circle", { cx: x(p.size_factor), cy: y(p.hit_ratio), r: 2.5, fill: COLORS[name] || "#444",
      "data-size-factor": p.size_factor, "data-hit-ratio": p.hit_ratio }));
  }
  parts.push(svg("line", { x1: x(1), x2: x(1), y1: m.top, y2: m.top + h, stroke: "#1d2330", "stroke-dasharray": "3 3" }));
  parts.push(svg("text", { class: "now", x: x(1) + 4, y: m.top + 10 }, "now: " + int(tier.capacity_blocks) + " blocks"));
  if (tier.current_hit_ratio !== null && tier.current_hit_ratio !== undefined) {
    parts.push(svg("circle", { cx: x(1), cy: y(tier.current_hit_ratio), r: 4.5, fill: "none", stroke: "#1d2330", "stroke-width": 2 }));
  }
  parts.push(svg("text", { x: m.left + w / 2, y: height - 1, "text-anchor": "middle" }, "size × the configured capacity"));
  return el("div", { class: "curve", "data-tier": name },
    el("b", { style: "color:" + (COLORS[name] || "inherit") }, name), " ",
    el("span", { class: "sub" }, "hit ratio now " + pct(tier.current_hit_ratio)),
    svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img" }, ...parts));
}

function renderAdvice(served) {
  const box = $("advice");
  if (!served || (state.advice === null && state.adviceError)) {
    put(box, el("p", { class: "na" }, "not available on this server" +
      (state.adviceError ? " (" + state.adviceError + ")" : " (GET /v1/kv/advice is not served)")));
    return;
  }
  if (state.advice === null) return;
  const a = state.advice;
  const tiers = Object.entries(a.tiers || {});
  const charts = tiers.map(([name, tier]) => curveChart(name, tier));
  const notes = (a.advice || []).map((line) => el("li", null, line));
  const sampled = el("p", { class: "sub", style: "grid-column: 1 / -1; margin: 0" },
    int(a.sampled_accesses) + " sampled block accesses at rate " + a.sampling_rate);
  put(box, ...(charts.length ? charts : [el("p", { class: "na" }, "no lower tier to size yet")]),
    notes.length ? el("ul", null, notes) : sampled, notes.length ? sampled : null);
}

// The checks by tier come with the engine's snapshot (they equal /metrics); the state from v1/kv/canary.
function renderCanary(served, checks) {
  const box = $("canary");
  if (!served || (state.canary === null && state.canaryError)) {
    put(box, el("p", { class: "na" }, "not available on this server" +
      (state.canaryError ? " (" + state.canaryError + ")" : " (GET /v1/kv/canary is not served)")));
    return;
  }
  const c = state.canary;
  if (c === null) return;
  const total = c.checks || {};
  const quarantined = c.quarantined || [];
  const ok = !total.mismatch && !quarantined.length;
  const tiers = TIERS.filter((n) => n in checks.match || n in checks.mismatch);
  const rows = tiers.map((n) => el("tr", null, el("td", null, n),
    el("td", { class: "num" }, metric("kvtier:canary_checks_total", { result: "match", tier: n }, checks.match[n] || 0)),
    el("td", { class: "num" }, metric("kvtier:canary_checks_total", { result: "mismatch", tier: n }, checks.mismatch[n] || 0))));
  const last = c.last_mismatch;
  put(box,
    el("div", null, el("span", { class: "chip " + (ok ? "good" : "bad") }, ok ? "cache agrees with recomputation" : "MISMATCH"),
      " ", el("b", null, int(total.match)), " match · ", el("b", null, int(total.mismatch)), " mismatch · ",
      int(total.skipped), " skipped"),
    el("div", { class: "sub" }, "rechecks " + pct(c.rate, 1) + " of requests served from cache, when idle" +
      (c.tolerance !== undefined ? " (tolerance " + c.tolerance + ")" : "") + (c.pending ? " · " + c.pending + " pending" : "")),
    quarantined.length ? el("div", null, "quarantined (not loaded from): ",
      quarantined.map((q) => el("span", { class: "chip bad" }, String(q)))) : null,
    rows.length ? el("table", null, el("thead", null, el("tr", null, el("th", null, "served by"),
      el("th", { class: "num" }, "match"), el("th", { class: "num" }, "mismatch"))), el("tbody", null, rows))
      : el("p", { class: "na" }, "no check yet"),
    last ? el("div", { class: "sub mono" }, "last mismatch: " + last.tier + " tier, " + (last.block_keys || []).length +
      " block(s), max |diff| " + last.max_abs_diff + ", " + new Date(1000 * last.time).toLocaleTimeString()) : null);
}

// ----------------------------------------------------------------------------------- cluster view
// kvtier router's page: GET router/state (mode, policy, each replica), each replica linking its own page.
function scalar(v) { return v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v); }

function counts(v) {
  if (v === null || v === undefined || typeof v !== "object") return scalar(v);
  const parts = Object.entries(v).filter(([, n]) => n).map(([k, n]) => k + " " + n);
  return parts.length ? parts.join(" · ") : "0";
}

function replicaRow(r) {
  const base = String(r.url || "").replace(/\/+$/, "");
  const trouble = r.problem || r.last_error;
  return el("tr", { "data-url": base },
    el("td", null, el("a", { href: base + "/dashboard", target: "_blank", rel: "noopener" }, base),
      r.replica_id ? el("div", { class: "sub" }, r.replica_id) : null),
    el("td", null, el("span", { class: "chip " + (r.healthy ? "good" : "bad") }, r.healthy ? "healthy" : "down"),
      trouble ? el("div", { class: "sub" }, String(trouble)) : null),
    el("td", { class: "num" }, scalar(r.running)), el("td", { class: "num" }, scalar(r.waiting)),
    el("td", { class: "num" }, scalar(r.in_flight)), el("td", null, counts(r.routed)),
    el("td", null, counts(r.indexed_blocks), r.index_source ? el("div", { class: "sub" }, "from " + r.index_source) : null));
}

function renderCluster(s) {
  $("replica-view").hidden = true;
  $("cluster-view").hidden = false;
  $("model").textContent = "cluster router";
  $("replica").textContent = "mode " + scalar(s.mode) + " · policy " + scalar(s.policy);
  const replicas = Array.isArray(s.replicas) ? s.replicas : [];
  const healthy = replicas.filter((r) => r.healthy).length;
  const sum = (f) => replicas.reduce((a, r) => a + (Number(r[f]) || 0), 0);
  put($("cluster-totals"), stat("replicas", healthy + " / " + replicas.length, "healthy"),
    stat("running", sum("running"), "sequences, all replicas"), stat("waiting", sum("waiting"), "sequences queued"),
    stat("in flight", sum("in_flight"), "requests through the router"));
  const head = ["replica", "health", "running", "waiting", "in flight", "routed, by reason", "indexed blocks"];
  put($("replicas"), replicas.length ? el("table", null,
    el("thead", null, el("tr", null, head.map((h, i) => el("th", { class: i >= 2 && i <= 4 ? "num" : null }, h)))),
    el("tbody", null, replicas.map(replicaRow))) : el("p", { class: "na" }, "no replica"));
}

schedule(0);
