// The dashboard: polls GET /v1/stats every second and charts, over the last two minutes (or since
// the page opened, across the chart's width), what
// changed between two polls (rates, hit rates, latency percentiles from the histograms' new
// counts) and the gauges as they stand.
"use strict";

const POLL_MS = 1000;
const POINTS = 120;
const COLORS = ["#2b6cb0", "#c05621"];
const series = {};  // metric -> [[...values of line 1], [...line 2]]
let previous = null;

function push(metric, values) {
  const lines = series[metric] = series[metric] || values.map(() => []);
  values.forEach((v, i) => {
    lines[i].push(v);
    if (lines[i].length > POINTS) lines[i].shift();
  });
}

// The q-quantile of the observations counted in `counts` (per bucket, the last above every bound
// in `le`), interpolated within its bucket; null when there are none.
function quantile(le, counts, q) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return null;
  let seen = 0;
  for (let i = 0; i < counts.length; i++) {
    if (seen + counts[i] >= q * total && counts[i] > 0) {
      const lo = i === 0 ? 0 : le[i - 1];
      const hi = i < le.length ? le[i] : le[le.length - 1];
      return lo + (hi - lo) * ((q * total - seen) / counts[i]);
    }
    seen += counts[i];
  }
  return le[le.length - 1];
}

function sum(models, key) {
  return Object.values(models).reduce((a, m) => a + (m[key] || 0), 0);
}

// Counters only grow, but a server restarted (or, behind a router, a replica gone) between two
// polls takes its counts away: a rate is never below 0.
function delta(now, before, key) {
  return Math.max(0, sum(now.models, key) - sum(before.models, key));
}

function latency(now, before, name) {
  const h = now.latency[name], b = before.latency[name];
  if (!h) return [null, null];  // no server answered (a router with every replica down)
  const counts = h.counts.map((c, i) => Math.max(0, c - (b ? b.counts[i] : 0)));
  const ms = (q) => { const v = quantile(h.le, counts, q); return v === null ? null : 1000 * v; };
  return [ms(0.5), ms(0.99)];
}

function show(id, text) {
  document.getElementById(id).textContent = text;
}

function fmt(value, digits) {
  return value === null || Number.isNaN(value) ? "–" : value.toFixed(digits);
}

function draw(metric) {
  const canvas = document.querySelector(`[data-metric="${metric}"] canvas`);
  const ctx = canvas.getContext("2d");
  const lines = series[metric] || [];
  const values = lines.flat().filter((v) => v !== null);
  const top = Math.max(1e-9, ...values) * 1.1;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  lines.forEach((line, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let pen = false;
    const step = canvas.width / (Math.max(line.length, 2) - 1);  // the points so far fill the width
    line.forEach((v, x) => {
      if (v === null) { pen = false; return; }
      const px = x * step;
      const py = canvas.height - (v / top) * (canvas.height - 4) - 2;
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
    });
    ctx.stroke();
  });
}

function requestsTable(now, before, seconds) {
  const rows = [];
  for (const [model, adapters] of Object.entries(now.requests)) {
    for (const [adapter, count] of Object.entries(adapters)) {
      const was = (before.requests[model] || {})[adapter] || 0;
      const tr = document.createElement("tr");
      for (const text of [model, adapter || "(base)", String(count), (Math.max(0, count - was) / seconds).toFixed(2)]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      rows.push(tr);
    }
  }
  document.getElementById("requests").replaceChildren(...rows);
}

function update(now, before, seconds) {
  const throughput = delta(now, before, "generation_tokens") / seconds;
  const ttft = latency(now, before, "ttft"), itl = latency(now, before, "itl");
  const running = sum(now.models, "num_requests_running"), waiting = sum(now.models, "num_requests_waiting");
  const kv = 100 * Math.max(0, ...Object.values(now.models).map((m) => m.kv_cache_usage_perc));
  const queries = delta(now, before, "prefix_cache_queries");
  const prefix = queries ? 100 * delta(now, before, "prefix_cache_hits") / queries : null;
  const drafted = delta(now, before, "spec_decode_num_draft_tokens");
  const spec = drafted ? delta(now, before, "spec_decode_num_accepted_tokens") / drafted : null;
  push("throughput", [throughput]);
  push("ttft", ttft);
  push("itl", itl);
  push("queue", [running, waiting]);
  push("kv", [kv]);
  push("prefix", [prefix]);
  push("spec", [spec]);
  show("v-throughput", fmt(throughput, 1));
  show("v-ttft", fmt(ttft[0], 1) + " / " + fmt(ttft[1], 1));
  show("v-itl", fmt(itl[0], 1) + " / " + fmt(itl[1], 1));
  show("v-queue", running + " / " + waiting);
  show("v-kv", fmt(kv, 1));
  show("v-prefix", fmt(prefix, 1));
  show("v-spec", fmt(spec, 2));
  requestsTable(now, before, seconds);
  Object.keys(series).forEach(draw);
}

async function poll() {
  try {
    const response = await api("/v1/stats");
    if (!response.ok) throw new Error(await errorText(response));
    const now = {at: performance.now(), stats: await response.json()};
    if (previous) update(now.stats, previous.stats, Math.max(1e-3, (now.at - previous.at) / 1000));
    previous = now;
    show("status", "updated " + new Date().toLocaleTimeString() + " · " +
      Object.keys(now.stats.models).join(", "));
  } catch (e) {
    show("status", "cannot read /v1/stats: " + e.message);
  }
  setTimeout(poll, POLL_MS);
}

poll();
