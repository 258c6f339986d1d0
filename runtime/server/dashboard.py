"""GET /dashboard: a live page of the server, self-contained (inline style and script; no external assets).

The page polls the server's own /get_server_info (JSON) and /metrics (Prometheus text) once a second with the
browser's credentials, keeps the last `HISTORY_S` seconds of samples, and draws them: running and waiting requests,
KV use and the radix-cached share, generated / prompt tokens per second, mean TTFT and TPOT per interval (from the
histograms' sums and counts), and the grammar compile pool's counters. Element ids the tests rely on: `#running`,
`#waiting`, `#kv`, `#grammar`, `svg.plot` (one per chart, its `polyline` points the samples).
"""

from __future__ import annotations

HISTORY_S = 300
POLL_MS = 1000

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{padding:12px 20px;background:#1d2330;color:#fff}header h1{font-size:18px;margin:0}
header .sub{color:#aab3c5;font-size:12px}
main{padding:16px 20px}
#cards{display:flex;flex-wrap:wrap;gap:8px;margin-bottom:16px}
.card{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:22px}.card span{font-size:11px;color:#6b7385}
#charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:16px}
.chart{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 12px}
.chart h2{font-size:13px;margin:0 0 4px;color:#4a5366}
.legend{font-size:11px;color:#4a5366}.legend i{display:inline-block;width:10px;height:3px;margin:0 4px 2px 10px}
svg.plot{width:100%;height:150px;background:#fafbfc}
svg.plot text{font-size:10px;fill:#6b7385}
#grammar table{border-collapse:collapse;font-size:12px}#grammar td{padding:1px 8px 1px 0}
.err{color:#b22}
"""

_SCRIPT = r"""
(function(){
const HISTORY_S = %(history)d, POLL_MS = %(poll)d;
const samples = [];
let prev = null;
const $ = id => document.getElementById(id);
const SERIES = {
  requests: [['running', '#3b6fc2'], ['waiting', '#c27a3b']],
  kv: [['kv_use', '#3b6fc2'], ['cached_share', '#3bc27a']],
  throughput: [['gen_tps', '#3b6fc2'], ['prompt_tps', '#8a6fc2']],
  latency: [['ttft_ms', '#c27a3b'], ['tpot_ms', '#3b6fc2']],
};
function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line[0] === '#') continue;
    const m = line.match(/^([^\s{]+)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const v = parseFloat(m[3]);
    if (!isNaN(v)) out[m[1]] = (out[m[1]] || 0) + v;  // summed over label sets
  }
  return out;
}
const per = (now, before, key, dt) => before && dt > 0 ? Math.max(0, (now[key] || 0) - (before[key] || 0)) / dt : 0;
function meanOver(now, before, name) {
  if (!before) return null;
  const n = (now[name + '_count'] || 0) - (before[name + '_count'] || 0);
  return n > 0 ? 1000 * ((now[name + '_sum'] || 0) - (before[name + '_sum'] || 0)) / n : null;
}
function card(id, value, label) { const c = $(id); c.querySelector('b').textContent = value; c.querySelector('span').textContent = label; }
function draw(svgId, keys) {
  const svg = $(svgId), W = 400, H = 150, P = 28;
  // the x axis covers the samples so far (at least 30 s), up to HISTORY_S
  const t1 = samples.length ? samples[samples.length - 1].t : 0;
  const span = samples.length ? Math.min(HISTORY_S, Math.max(30, t1 - samples[0].t)) : HISTORY_S, t0 = t1 - span;
  let hi = 0; for (const s of samples) for (const [k] of keys) if (s[k] !== null && s[k] > hi) hi = s[k];
  hi = hi > 0 ? hi * 1.1 : 1;
  svg.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
  svg.replaceChildren();
  const NS = 'http://www.w3.org/2000/svg';
  const mk = (tag, attrs, text) => { const e = document.createElementNS(NS, tag); for (const a in attrs) e.setAttribute(a, attrs[a]); if (text) e.textContent = text; svg.appendChild(e); return e; };
  mk('line', {x1: P, y1: H - 14, x2: W, y2: H - 14, stroke: '#ccd'});
  mk('text', {x: 2, y: 10}, hi >= 100 ? hi.toFixed(0) : hi.toPrecision(2));
  mk('text', {x: 2, y: H - 16}, '0');
  mk('text', {x: P, y: H - 2}, '-' + Math.round(span) + ' s');
  mk('text', {x: W - 24, y: H - 2}, 'now');
  for (const [k, color] of keys) {
    const pts = samples.filter(s => s[k] !== null).map(s => (P + (W - P) * (s.t - t0) / span).toFixed(1) + ',' + (H - 14 - (H - 24) * s[k] / hi).toFixed(1));
    mk('polyline', {points: pts.join(' '), fill: 'none', stroke: color, 'stroke-width': 1.5, 'data-series': k});
  }
}
async function poll() {
  try {
    const [infoResp, metricsResp] = await Promise.all([fetch('/get_server_info'), fetch('/metrics')]);
    if (!infoResp.ok || !metricsResp.ok) throw new Error('HTTP ' + infoResp.status + ' / ' + metricsResp.status);
    const info = await infoResp.json(), metrics = parseMetrics(await metricsResp.text());
    const t = performance.now() / 1000, dt = prev ? t - prev.t : 0;
    const total = info.kv_total_tokens || 0;
    const sample = {t,
      running: info.num_running_reqs || 0, waiting: info.num_waiting_reqs || 0,
      kv_use: total ? (info.kv_used_tokens || 0) / total : 0, cached_share: info.cache_hit_rate || 0,
      gen_tps: per(metrics, prev && prev.m, 'braid:generation_tokens_total', dt),
      prompt_tps: per(metrics, prev && prev.m, 'braid:prompt_tokens_total', dt),
      ttft_ms: meanOver(metrics, prev && prev.m, 'braid:time_to_first_token_seconds'),
      tpot_ms: meanOver(metrics, prev && prev.m, 'braid:time_per_output_token_seconds')};
    prev = {t, m: metrics};
    samples.push(sample);
    while (samples.length && samples[0].t < t - HISTORY_S) samples.shift();
    card('running', sample.running, 'running requests');
    card('waiting', sample.waiting, 'waiting requests');
    card('kv', (100 * sample.kv_use).toFixed(1) + '%%', 'KV in use (' + (info.kv_used_tokens || 0) + ' / ' + total + ' tokens)');
    card('radix', (info.kv_cached_tokens || 0) + '', 'tokens held by the radix cache');
    card('hit', (100 * sample.cached_share).toFixed(1) + '%%', 'prompt tokens served from cache');
    card('gen', sample.gen_tps.toFixed(1), 'generated tokens / s');
    $('model').textContent = (info.model_path || '') + ' · braid ' + (info.version || '') + ' · ' + (info.num_requests_total || 0) + ' requests so far';
    const g = info.grammar, box = $('grammar');
    box.replaceChildren();
    if (g && typeof g === 'object') {
      const table = document.createElement('table');
      for (const [k, v] of Object.entries(g)) { const tr = table.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = v; }
      box.appendChild(table);
    } else box.textContent = 'not started (no request with a grammar yet)';
    for (const name in SERIES) draw('plot-' + name, SERIES[name]);
    $('status').textContent = '';
    document.body.dataset.samples = samples.length;
  } catch (e) { $('status').textContent = 'poll failed: ' + e.message; }
}
poll(); setInterval(poll, POLL_MS);
})();
"""

_CHARTS = (("requests", "Requests", "running · waiting"), ("kv", "KV cache", "in use · radix-cached share of prompts"),
           ("throughput", "Throughput (tokens/s)", "generated · prompt"),
           ("latency", "Latency (ms, mean per interval)", "TTFT · TPOT"))


def dashboard_html() -> str:
    cards = "".join(f'<div class="card" id="{i}"><b>–</b><span></span></div>'
                    for i in ("running", "waiting", "kv", "radix", "hit", "gen"))
    charts = "".join(f'<div class="chart"><h2>{title}</h2><div class="legend">{legend}</div>'
                     f'<svg class="plot" id="plot-{name}"></svg></div>' for name, title, legend in _CHARTS)
    script = _SCRIPT % {"history": HISTORY_S, "poll": POLL_MS}
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>braid server</title>
<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_STYLE}</style></head>
<body><header><h1>braid server</h1><div class="sub"><span id="model"></span> <span id="status" class="err"></span>
</div></header>
<main><div id="cards">{cards}</div><div id="charts">{charts}
<div class="chart"><h2>Grammar compile pool</h2><div id="grammar">–</div></div></div></main>
<script>{script}</script></body></html>
"""
