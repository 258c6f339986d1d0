"""A run trace drawn as one self-contained HTML page (inline style and script; nothing is fetched).

The trace travels inside the page as JSON; the script builds every element from it: a summary, the waterfall of
calls (one bar per call from sent to done, the part before the first token darker), and each program's text with
every generated span marked by its call (fork branches side by side at their fork point, batch items one under
another). Hovering a span or a bar shows the call's details; a click pins them. Element ids and classes the tests
rely on: `#summary`, `#timeline .bar[data-call]`, `#program .span[data-call]`, `#details`, `.tok` (a token,
coloured by its probability).
"""

from __future__ import annotations

import html
import json

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{padding:12px 20px;background:#1d2330;color:#fff}header h1{font-size:18px;margin:0 0 4px}
header .sub{color:#aab3c5;font-size:12px}
main{display:grid;grid-template-columns:minmax(0,1fr) 380px;gap:16px;padding:16px 20px}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:12px;margin-bottom:16px}
section h2{font-size:14px;margin:0 0 8px;color:#4a5366;text-transform:uppercase;letter-spacing:.04em}
#summary{display:flex;flex-wrap:wrap;gap:8px}
.card{border:1px solid #dde1e8;border-radius:4px;padding:6px 10px;min-width:90px}
.card b{display:block;font-size:18px}.card span{font-size:11px;color:#6b7385}
#timeline{position:relative}
.row{display:flex;align-items:center;height:18px;margin:1px 0;cursor:pointer}
.row .label{width:170px;font-size:11px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;color:#4a5366}
.row .lane{position:relative;flex:1;height:14px;background:#f1f3f6}
.bar{position:absolute;top:1px;height:12px;border-radius:2px;min-width:2px;background:#7aa7e0}
.bar .wait{position:absolute;left:0;top:0;height:100%;background:rgba(0,0,0,.25);border-radius:2px 0 0 2px}
.bar.select{background:#e0a96d}.bar.prefill{background:#b9b9c9}.bar.error{background:#e06d6d}
.axis{display:flex;justify-content:space-between;margin-left:170px;font-size:10px;color:#6b7385}
.scope{border-left:3px solid #c9d3e3;padding-left:8px;margin:6px 0}
.scope>.title{font-size:12px;color:#6b7385;margin-bottom:2px}
.text{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12.5px;word-break:break-word}
.forks{display:flex;gap:8px;margin:6px 0}.forks>.scope{flex:1;min-width:0}
.span{border-bottom:2px solid #3b6fc2;background:#e8f0fc;cursor:pointer}
.span.select{border-color:#c27a3b;background:#fcefe3}.span.active,.bar.active{outline:2px solid #d43}
.tok{border-radius:2px}
#details{position:sticky;top:12px;max-height:calc(100vh - 40px);overflow:auto}
#details table{border-collapse:collapse;width:100%;font-size:12px}
#details td{border-top:1px solid #eef0f4;padding:2px 4px;vertical-align:top}
#details td:first-child{color:#6b7385;white-space:nowrap}
.toks{display:flex;flex-wrap:wrap;gap:2px;font-family:ui-monospace,monospace;font-size:12px;margin-top:6px}
.toks .tok{padding:0 2px;border:1px solid #dde1e8;white-space:pre}
.alt{font-size:11px;color:#4a5366}
.choice{display:flex;gap:6px;align-items:center;font-size:12px}
.choice .meter{height:8px;background:#e0a96d;border-radius:2px}.choice.won{font-weight:bold}
.err{color:#b22}
"""

_SCRIPT = r"""
(function(){
const T = JSON.parse(document.getElementById('trace-data').textContent);
const el = (tag, cls, text) => {const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text; return e;};
const fmt = (x, d) => x === null || x === undefined ? '—' : (typeof x === 'number' && !Number.isInteger(x) ? x.toFixed(d === undefined ? 3 : d) : String(x));
const ms = x => x === null || x === undefined ? '—' : (x * 1000).toFixed(1) + ' ms';
const probColor = lp => {const p = Math.exp(lp); return 'hsl(' + Math.round(p * 120) + ',75%,80%)';};
const scopes = new Map(T.scopes.map(s => [s.id, s]));
const children = new Map();
for (const s of T.scopes) { if (s.parent !== null) { if (!children.has(s.parent)) children.set(s.parent, []); children.get(s.parent).push(s); } }
const callsByScope = new Map();
for (const c of T.calls) { if (!callsByScope.has(c.scope)) callsByScope.set(c.scope, []); callsByScope.get(c.scope).push(c); }
const scopeName = s => s.kind === 'fork_branch' ? 'branch ' + s.index : s.kind === 'batch_item' || (s.kind === 'program' && s.index !== null) ? (s.name + ' [' + s.index + ']') : (s.name || s.kind);
const scopePath = id => {const parts = []; for (let s = scopes.get(id); s; s = s.parent === null ? null : scopes.get(s.parent)) parts.unshift(scopeName(s)); return parts.join(' › ');};
const callLabel = c => c.kind + (c.name ? ' ' + c.name : '') ;

// ---- summary
const S = T.summary || {};
const sum = document.getElementById('summary');
const cards = [['calls', S.calls], ['gens', S.gens], ['selects', S.selects], ['prompt tokens', S.prompt_tokens],
  ['completion tokens', S.completion_tokens], ['cached tokens', S.cached_tokens],
  ['cached share', S.cached_share === null || S.cached_share === undefined ? '—' : (100 * S.cached_share).toFixed(1) + '%'],
  ['wall time', ms(S.wall_s)], ['time in calls', ms(S.call_s)]];
for (const [k, v] of cards) { const c = el('div', 'card'); c.appendChild(el('b', null, v === null || v === undefined ? '—' : String(v))); c.appendChild(el('span', null, k)); sum.appendChild(c); }
document.getElementById('backend').textContent = (T.backend || 'unknown backend') + ' · ' + new Date(T.started_at * 1000).toISOString();

// ---- details panel
const details = document.getElementById('details-body');
let pinned = null;
function row(table, k, v) { const tr = el('tr'); tr.appendChild(el('td', null, k)); const td = el('td'); if (v instanceof Node) td.appendChild(v); else td.textContent = v; tr.appendChild(td); table.appendChild(tr); }
function tokenChip(t) {
  const chip = el('span', 'tok', t.text !== null && t.text !== undefined ? t.text : '#' + t.id);
  if (t.logprob !== null) chip.style.background = probColor(t.logprob);
  chip.title = 'p=' + (t.logprob === null ? '?' : Math.exp(t.logprob).toFixed(3)) + (t.top && t.top.length ? '  top: ' + t.top.map(a => JSON.stringify(a[0]) + ' ' + (a[1] === null ? '?' : Math.exp(a[1]).toFixed(3))).join(', ') : '');
  return chip;
}
function showCall(id) {
  const c = T.calls[id];
  details.replaceChildren();
  details.appendChild(el('h3', null, callLabel(c) + '  (call ' + c.id + ')'));
  const table = el('table'); details.appendChild(table);
  row(table, 'scope', scopePath(c.scope));
  if (c.error) row(table, 'error', el('span', 'err', c.error));
  row(table, 'text', c.text);
  if (c.constraint) row(table, 'constraint', c.constraint.type + ': ' + c.constraint.value);
  const args = Object.entries(c.args || {}).map(([k, v]) => k + '=' + JSON.stringify(v)).join(', ');
  if (args) row(table, 'arguments', args);
  if (c.method) row(table, 'method', c.method);
  row(table, 'sent', ms(c.t_sent));
  row(table, 'first token', c.t_first_token === null ? '— (not reported)' : ms(c.t_first_token) + ' (+' + ms(c.t_first_token - c.t_sent) + ')');
  row(table, 'done', c.t_done === null ? '—' : ms(c.t_done) + ' (took ' + ms(c.t_done - c.t_sent) + ')');
  row(table, 'prompt tokens', fmt(c.prompt_tokens));
  row(table, 'cached tokens', fmt(c.cached_tokens) + (c.prompt_tokens ? ' (' + (100 * (c.cached_tokens || 0) / c.prompt_tokens).toFixed(0) + '%)' : ''));
  row(table, 'completion tokens', fmt(c.completion_tokens));
  row(table, 'finish reason', fmt(c.finish_reason));
  if (c.speculated) row(table, 'speculated', 'cut from an earlier speculative call');
  if (c.choices) {
    const box = el('div');
    const finite = c.choices.map(ch => ch.score).filter(x => x !== null);
    const lo = Math.min(...finite, 0), hi = Math.max(...finite, 0);
    c.choices.forEach((ch, i) => {
      const line = el('div', 'choice' + (i === c.decision ? ' won' : ''));
      line.appendChild(el('span', null, JSON.stringify(ch.text)));
      const meter = el('span', 'meter'); meter.style.width = (ch.score === null ? 0 : 10 + 90 * (ch.score - lo) / ((hi - lo) || 1)) + 'px';
      line.appendChild(meter); line.appendChild(el('span', null, fmt(ch.score)));
      box.appendChild(line);
    });
    row(table, 'choices (score)', box);
  }
  if (c.tokens) {
    details.appendChild(el('h4', null, 'tokens (coloured by probability)'));
    const toks = el('div', 'toks');
    for (const t of c.tokens) toks.appendChild(tokenChip(t));
    details.appendChild(toks);
    const alts = c.tokens.filter(t => t.top && t.top.length);
    if (alts.length) {
      const at = el('table', 'alt'); details.appendChild(el('h4', null, 'top alternatives'));
      for (const t of alts) row(at, JSON.stringify(t.text), t.top.map(a => JSON.stringify(a[0]) + ' ' + (a[1] === null ? '?' : Math.exp(a[1]).toFixed(3))).join('  '));
      details.appendChild(at);
    }
  } else if (c.kind === 'gen') {
    details.appendChild(el('p', 'alt', 'The backend returned no token logprobs for this call.'));
  }
  document.querySelectorAll('.active').forEach(e => e.classList.remove('active'));
  document.querySelectorAll('[data-call="' + id + '"]').forEach(e => e.classList.add('active'));
}
function hook(node, id) {
  node.dataset.call = id;
  node.addEventListener('mouseenter', () => { if (pinned === null) showCall(id); });
  node.addEventListener('click', ev => { ev.stopPropagation(); pinned = pinned === id ? null : id; showCall(id); });
}

// ---- timeline
const tl = document.getElementById('timeline');
const total = Math.max(T.duration_s || 0, ...T.calls.map(c => c.t_done || 0), 1e-6);
const axis = el('div', 'axis'); for (let i = 0; i <= 4; i++) axis.appendChild(el('span', null, ms(total * i / 4))); tl.appendChild(axis);
const ordered = T.calls.slice().sort((a, b) => a.t_sent - b.t_sent);
for (const c of ordered) {
  const r = el('div', 'row'); r.appendChild(el('div', 'label', scopePath(c.scope) + ' · ' + callLabel(c)));
  const lane = el('div', 'lane'); r.appendChild(lane);
  const end = c.t_done === null ? total : c.t_done;
  const bar = el('div', 'bar ' + c.kind + (c.error ? ' error' : ''));
  bar.style.left = (100 * c.t_sent / total) + '%'; bar.style.width = (100 * Math.max(end - c.t_sent, 0) / total) + '%';
  if (c.t_first_token !== null && end > c.t_sent) { const w = el('div', 'wait'); w.style.width = (100 * (c.t_first_token - c.t_sent) / (end - c.t_sent)) + '%'; bar.appendChild(w); }
  bar.title = callLabel(c) + ': ' + ms(end - c.t_sent);
  lane.appendChild(bar); hook(bar, c.id); tl.appendChild(r);
}

// ---- program text
function spanNode(c, text) {
  const sp = el('span', 'span ' + c.kind);
  const toks = c.tokens && c.tokens.every(t => typeof t.text === 'string') && c.tokens.map(t => t.text).join('') === text ? c.tokens : null;
  if (toks) { for (const t of toks) { const k = el('span', 'tok', t.text); if (t.logprob !== null) k.style.background = probColor(t.logprob); sp.appendChild(k); } }
  else sp.textContent = text;
  hook(sp, c.id); return sp;
}
function renderScope(s) {
  const box = el('div', 'scope'); box.dataset.scope = s.id;
  box.appendChild(el('div', 'title', scopeName(s) + (s.kind === 'program' && Object.keys(s.arguments || {}).length ? '(' + Object.entries(s.arguments).map(([k, v]) => k + '=' + v).join(', ') + ')' : '') + (s.error ? '  — failed: ' + s.error : '')));
  const kids = children.get(s.id) || [];
  if (s.kind === 'batch') { for (const k of kids) box.appendChild(renderScope(k)); return box; }
  const text = s.text || '';
  const calls = (callsByScope.get(s.id) || []).filter(c => c.span && c.span[1] > c.span[0]).sort((a, b) => a.span[0] - b.span[0]);
  const forkGroups = new Map();
  for (const k of kids) { if (k.kind === 'fork_branch') { const at = k.fork_at || 0; if (!forkGroups.has(at)) forkGroups.set(at, []); forkGroups.get(at).push(k); } }
  const cuts = new Set([0, text.length, ...forkGroups.keys()]);
  for (const c of calls) { cuts.add(c.span[0]); cuts.add(c.span[1]); }
  const points = [...cuts].filter(x => x >= 0 && x <= text.length).sort((a, b) => a - b);
  let div = el('div', 'text'); box.appendChild(div);
  for (let i = 0; i < points.length; i++) {
    const at = points[i];
    if (forkGroups.has(at)) {
      const row = el('div', 'forks'); for (const k of forkGroups.get(at)) row.appendChild(renderScope(k));
      box.appendChild(row); div = el('div', 'text'); box.appendChild(div);
    }
    if (i + 1 >= points.length) break;
    const piece = text.slice(at, points[i + 1]);
    const c = calls.find(c => c.span[0] === at && c.span[1] === points[i + 1]);
    div.appendChild(c ? spanNode(c, piece) : document.createTextNode(piece));
  }
  for (const k of kids) if (k.kind !== 'fork_branch') box.appendChild(renderScope(k));
  return box;
}
const prog = document.getElementById('program');
for (const s of T.scopes) if (s.parent === null) prog.appendChild(renderScope(s));
document.body.addEventListener('click', () => { pinned = null; });
document.body.dataset.rendered = 'true';
})();
"""


def render_trace_page(trace: dict) -> str:
    # "<" escaped so that nothing in the data can end or re-open the script element
    data = json.dumps(trace, allow_nan=False, default=repr).replace("<", "\\u003c")
    title = "braid trace: " + ", ".join(sorted({s["name"] for s in trace["scopes"] if s.get("parent") is None
                                                and s.get("name")}) or ["run"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width,initial-scale=1">
<style>{_STYLE}</style></head>
<body>
<header><h1>{html.escape(title)}</h1><div class="sub" id="backend"></div></header>
<main><div>
<section><h2>Summary</h2><div id="summary"></div></section>
<section><h2>Time line</h2><div id="timeline"></div></section>
<section><h2>Program</h2><div id="program"></div></section>
</div>
<div><section id="details"><h2>Call</h2><div id="details-body"><p class="alt">Hover over a generated span or a
time-line bar for its call; click to keep it.</p></div></section></div></main>
<script type="application/json" id="trace-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
