"""The HTML template of ``bpo view`` (CSS and JS inline; :mod:`bpo.view` fills the ``{{...}}``
slots). The script reads the trees from the JSON block ``#bpo-data`` and draws them in SVG; it
writes text into the page only through ``textContent``.

DOM contract (the browser test relies on it): ``svg#tree`` holds one element with class
``node`` per tree node (``data-i`` = node index) and has ``data-nodes`` = the node count;
``#tree`` shows the tree selected by ``#tree=N`` in the URL, else the first tree of the last
iteration."""

from __future__ import annotations

PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
:root{--bg:#f4f5f7;--panel:#fff;--ink:#1d2330;--muted:#5f6b7a;--line:#d9dde3;--accent:#2563eb}
*{box-sizing:border-box}
html,body{height:100%}
body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
  color:var(--ink);background:var(--bg);display:flex;flex-direction:column}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:baseline;
  flex-wrap:wrap}
header h1{font-size:17px;margin:0;font-weight:600}
header .method{color:#b8c2d0;font-size:12px}
.cards{display:flex;gap:8px;flex-wrap:wrap;padding:8px 16px}
.card{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:4px 10px}
.card .v{font-size:16px;font-weight:600}.card .k{font-size:11px;color:var(--muted)}
main{flex:1;min-height:0;display:grid;grid-template-columns:minmax(0,1fr) 480px;gap:12px;
  padding:0 16px 12px}
section{background:var(--panel);border:1px solid var(--line);border-radius:6px;min-height:0;
  display:flex;flex-direction:column}
h2{font-size:13px;margin:0;padding:7px 10px;border-bottom:1px solid var(--line);color:var(--muted);
  text-transform:uppercase;letter-spacing:.04em}
.toolbar{display:flex;gap:8px;align-items:center;flex-wrap:wrap;padding:7px 10px;
  border-bottom:1px solid var(--line)}
.toolbar select,.toolbar button{font:inherit;padding:2px 6px}
#treeinfo{color:var(--muted);font-size:12px}
.legend{display:flex;gap:14px;flex-wrap:wrap;align-items:center;padding:6px 10px;font-size:12px;
  color:var(--muted);border-bottom:1px solid var(--line)}
.legend .bar{display:inline-block;width:90px;height:10px;border-radius:2px;vertical-align:middle;
  margin:0 4px;border:1px solid #999}
.legend svg{vertical-align:middle}
#canvas{flex:1;overflow:auto;min-height:0}
#tree{display:block;margin:0 auto}
#tree .edge{fill:none;stroke:#9aa3ad;stroke-width:1.2}
#tree .edge.sib{stroke:#5b6673;stroke-width:1.6}
#tree .edge.onpath{stroke:var(--accent);stroke-width:3}
#tree .adv{font-size:10.5px;font-weight:600;paint-order:stroke;stroke:#fff;stroke-width:3px;
  text-anchor:middle;dominant-baseline:middle}
#tree .adv.pos{fill:#15803d}#tree .adv.neg{fill:#b91c1c}#tree .adv.zero{fill:#6b7280}
#tree .ret{font-size:10px;fill:#374151;text-anchor:middle}
#tree .node{stroke:#1f2937;stroke-width:1;cursor:pointer}
#tree .node.chain{stroke:#8b95a1;fill:#e5e7eb}
#tree .node.root{stroke-width:2.5}
#tree .node:hover{stroke:var(--accent);stroke-width:3}
#tree .node.selected{stroke:var(--accent);stroke-width:3.5}
.side{display:grid;grid-template-rows:minmax(0,46%) minmax(0,1fr);gap:12px;min-height:0}
#details{overflow:auto;padding:8px 10px;font-size:13px}
#details table{border-collapse:collapse;margin-bottom:6px}
#details td{padding:1px 10px 1px 0;vertical-align:top}#details td:first-child{color:var(--muted)}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;border:1px solid var(--line);
  border-radius:4px;padding:6px;margin:2px 0 8px;font:12px/1.35 ui-monospace,"DejaVu Sans Mono",monospace;
  max-height:220px;overflow:auto}
ol.path{margin:2px 0 8px;padding-left:22px;font:12px ui-monospace,"DejaVu Sans Mono",monospace}
#plots{overflow:auto;padding:8px;text-align:center}
#plots figure{margin:0 0 10px}#plots img{max-width:100%}
.muted{color:var(--muted)}
#tip{position:fixed;pointer-events:none;background:#111827;color:#f9fafb;border-radius:5px;
  padding:7px 9px;font-size:12px;max-width:440px;box-shadow:0 4px 14px rgba(0,0,0,.3);display:none;
  z-index:10}
#tip b{color:#93c5fd}#tip .t{white-space:pre-wrap;word-break:break-word;margin-top:3px}
@media (max-width:1000px){main{grid-template-columns:1fr}}
</style></head>
<body>
<header><h1>{{TITLE}}</h1><span class="method">{{METHOD}}</span>
<span class="method">{{RUN}}</span></header>
<div class="cards">{{CARDS}}</div>
<main>
<section id="treepanel">
  <div class="toolbar">
    <label>iteration <select id="itsel"></select></label>
    <label>tree <select id="treesel"></select></label>
    <button id="prev" title="previous tree (left arrow)">&#9664;</button>
    <button id="next" title="next tree (right arrow)">&#9654;</button>
    <button id="zoomout" title="zoom out">&minus;</button>
    <button id="zoomin" title="zoom in">+</button>
    <span id="treeinfo"></span>
  </div>
  <div class="legend" id="legend"></div>
  <div id="canvas"><svg id="tree" xmlns="http://www.w3.org/2000/svg"></svg></div>
</section>
<div class="side">
  <section><h2>Selected node</h2><div id="details"></div></section>
  <section><h2>Run curves</h2><div id="plots">{{PLOTS}}</div></section>
</div>
</main>
<div id="tip"></div>
<script type="application/json" id="bpo-data">{{DATA}}</script>
<script>
(function () {
"use strict";
const DATA = JSON.parse(document.getElementById("bpo-data").textContent);
const TREES = DATA.trees;
const SVGNS = "http://www.w3.org/2000/svg";
const PAD = 34;
const VIRIDIS = [[68,1,84],[71,44,122],[59,81,139],[44,113,142],[33,144,141],[39,173,129],
  [92,200,99],[170,220,50],[253,231,37]];
const RDYLGN = [[215,48,39],[244,109,67],[253,174,97],[254,224,139],[217,239,139],
  [166,217,106],[102,189,99],[26,152,80]];
let current = -1, selected = -1, zoom = 1, L = null;

function ramp(stops, t) {
  t = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0));
  const s = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(s)), f = s - i;
  const c = stops[i].map((v, k) => Math.round(v + f * (stops[i + 1][k] - v)));
  return "rgb(" + c.join(",") + ")";
}
function unit(v, r) { return (v - r[0]) / (r[1] - r[0]); }
const entColor = e => ramp(VIRIDIS, unit(e, DATA.entropy_range));
const retColor = r => ramp(RDYLGN, unit(r, DATA.return_range));
function gradient(stops) {
  return "linear-gradient(to right," + stops.map((_, i) =>
    ramp(stops, i / (stops.length - 1))).join(",") + ")";
}
function fmt(v, d) {
  if (v === null || v === undefined) return "n/a";
  return Number.isInteger(v) ? String(v) : v.toFixed(d === undefined ? 3 : d);
}
function signed(v) { return (v > 0 ? "+" : "") + v.toFixed(2); }
function svg(tag, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function h(tag, text, parent, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}
function clip(s, n) { return s.length > n ? s.slice(0, n) + " \u2026" : s; }

function layout(tree, availW, availH) {
  const n = tree.nodes.length, kids = Array.from({length: n}, () => []);
  tree.nodes.forEach((d, i) => { if (d.parent >= 0) kids[d.parent].push(i); });
  const x = new Array(n).fill(0), depth = new Array(n).fill(0);
  let next = 0, maxDepth = 0;
  const stack = [[0, false]];
  while (stack.length) {  // iterative post-order: leaves left to right, parents centred
    const [u, done] = stack.pop(), ch = kids[u];
    if (ch.length === 0) { x[u] = next++; continue; }
    if (done) { x[u] = (x[ch[0]] + x[ch[ch.length - 1]]) / 2; continue; }
    stack.push([u, true]);
    for (let j = ch.length - 1; j >= 0; j--) {
      depth[ch[j]] = depth[u] + 1; maxDepth = Math.max(maxDepth, depth[ch[j]]);
      stack.push([ch[j], false]);
    }
  }
  // spread narrow trees over the panel; wide ones shrink a little, then scroll; the levels
  // fill the panel's height (within readable limits)
  const gap = Math.min(140, Math.max(46, (availW - 2 * PAD) / Math.max(1, next - 1)));
  const W = 2 * PAD + Math.max(1, next - 1) * gap, fit = Math.max(0.8, Math.min(1, availW / W));
  const level = Math.min(80, Math.max(40, (availH / fit - 2 * PAD - 14) / Math.max(1, maxDepth)));
  const px = i => PAD + x[i] * gap, py = i => PAD + depth[i] * level;
  return {kids, px, py, leaves: next, maxDepth, level, fit, W, H: 2 * PAD + maxDepth * level + 14};
}
const KIND = {leaf: "leaf", branch: "branch node", chain: "single-child node"};
function kind(i) {
  const k = L.kids[i].length;
  return k === 0 ? "leaf" : k >= 2 ? "branch" : "chain";
}

function render(ti) {
  current = ti; selected = -1;
  const tree = TREES[ti], root = document.getElementById("tree");
  const canvas = document.getElementById("canvas");
  const availW = canvas.clientWidth - 8, availH = canvas.clientHeight - 8;
  L = layout(tree, availW, availH);
  const LEVEL = L.level, W = L.W, H = L.H;
  while (root.firstChild) root.removeChild(root.firstChild);
  root.setAttribute("viewBox", "0 0 " + W + " " + H);
  root.dataset.nodes = String(tree.nodes.length);
  root.dataset.tree = String(ti);
  zoom = L.fit;
  applyZoom(W, H);
  canvas.scrollLeft = L.px(0) * zoom - availW / 2;  // the root in the middle
  canvas.scrollTop = 0;
  const gEdges = svg("g", {}, root), gLabels = svg("g", {}, root), gNodes = svg("g", {}, root);
  tree.nodes.forEach((d, i) => {
    if (d.parent < 0) return;
    const p = d.parent, x0 = L.px(p), y0 = L.py(p), x1 = L.px(i), y1 = L.py(i);
    const sib = L.kids[p].length > 1;
    svg("path", {d: "M" + x0 + "," + y0 + " C" + x0 + "," + (y0 + LEVEL / 2) + " " + x1 + "," +
      (y1 - LEVEL / 2) + " " + x1 + "," + y1, class: "edge" + (sib ? " sib" : ""),
      "data-i": i}, gEdges);
    if (sib && d.advantage !== null) {
      const t = 0.72, a = (1 - t) ** 3 + 3 * (1 - t) ** 2 * t, b = 1 - a;
      const ly = (1 - t) ** 3 * y0 + 3 * (1 - t) ** 2 * t * (y0 + LEVEL / 2) +
        3 * (1 - t) * t * t * (y1 - LEVEL / 2) + t ** 3 * y1;
      const cls = d.advantage > 1e-9 ? "pos" : d.advantage < -1e-9 ? "neg" : "zero";
      svg("text", {x: a * x0 + b * x1, y: ly, class: "adv " + cls}, gLabels, signed(d.advantage));
    }
  });
  tree.nodes.forEach((d, i) => {
    const k = kind(i), x = L.px(i), y = L.py(i);
    const cls = "node " + k + (i === 0 ? " root" : "");
    let e;
    if (k === "leaf") {
      e = svg("rect", {x: x - 8, y: y - 8, width: 16, height: 16, rx: 2, class: cls,
        fill: retColor(d.return)}, gNodes);
      svg("text", {x: x, y: y + 22, class: "ret"}, gLabels, fmt(d.return, 2));
    } else if (k === "branch") {
      e = svg("circle", {cx: x, cy: y, r: 10, class: cls,
        fill: d.entropy === null ? "#d1d5db" : entColor(d.entropy)}, gNodes);
    } else {
      e = svg("circle", {cx: x, cy: y, r: i === 0 ? 8 : 5, class: cls}, gNodes);
    }
    e.setAttribute("data-i", i);
    e.addEventListener("mouseenter", ev => showTip(i, ev));
    e.addEventListener("mousemove", moveTip);
    e.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    e.addEventListener("click", () => select(i));
  });
  const leaves = tree.nodes.filter((_, i) => L.kids[i].length === 0);
  const wins = leaves.filter(d => d.return > 0).length;
  document.getElementById("treeinfo").textContent = "task " + tree.task + " \u00b7 seed " +
    tree.seed + " \u00b7 " + tree.nodes.length + " nodes \u00b7 " + leaves.length +
    " leaves \u00b7 " + tree.nodes.filter((_, i) => L.kids[i].length > 1).length +
    " branch nodes \u00b7 " + wins + "/" + leaves.length + " leaves with return > 0";
  let best = 0;
  tree.nodes.forEach((d, i) => {
    if (L.kids[i].length === 0 && (L.kids[best].length > 0 || d.return > tree.nodes[best].return))
      best = i;
  });
  select(best);
}
function applyZoom(W, H) {
  const root = document.getElementById("tree");
  W = W || root.viewBox.baseVal.width; H = H || root.viewBox.baseVal.height;
  root.setAttribute("width", Math.round(W * zoom));
  root.setAttribute("height", Math.round(H * zoom));
}

function pathTo(i) {
  const out = [];
  for (let j = i; j >= 0; j = TREES[current].nodes[j].parent) out.push(j);
  return out.reverse();
}
function select(i) {
  selected = i;
  const onPath = new Set(pathTo(i));
  document.querySelectorAll("#tree .node").forEach(e =>
    e.classList.toggle("selected", Number(e.getAttribute("data-i")) === i));
  document.querySelectorAll("#tree .edge").forEach(e =>
    e.classList.toggle("onpath", onPath.has(Number(e.getAttribute("data-i")))));
  const d = TREES[current].nodes[i], box = document.getElementById("details");
  box.textContent = "";
  const tab = h("table", null, box);
  const row = (k, v) => { const r = h("tr", null, tab); h("td", k, r); h("td", v, r); };
  row("node", i + " (" + KIND[kind(i)] + (i === 0 ? ", root" : "") + "), step " + d.step +
    ", parent " + d.parent + ", " + L.kids[i].length + " children");
  if (d.action !== undefined) {
    row("reward", fmt(d.reward) + (d.terminated ? " (terminated)" : "") +
      (d.truncated ? " (truncated)" : ""));
    row("advantage", d.advantage === null ? "n/a" : signed(d.advantage) + " (edge into it)");
    row("action", d.tokens + " tokens, log-prob " + fmt(d.logprob, 2));
  }
  row("return so far", fmt(d.return));
  row("entropy here", fmt(d.entropy) + (d.branch_k > 1 ? " (branch rule asked k=" +
    d.branch_k + ")" : ""));
  if (d.action !== undefined) { h("b", "Action", box); h("pre", d.action, box); }
  h("b", "Observation", box); h("pre", d.observation || "(empty)", box);
  h("b", "Actions from the root", box);
  const ol = h("ol", null, box, "path");
  pathTo(i).slice(1).forEach(j => h("li", clip(TREES[current].nodes[j].action, 120), ol));
}

const tip = document.getElementById("tip");
function showTip(i, ev) {
  const d = TREES[current].nodes[i];
  tip.textContent = "";
  const head = h("div", null, tip);
  h("b", "node " + i + " \u00b7 " + KIND[kind(i)] + " \u00b7 step " + d.step, head);
  const parts = [];
  if (d.action !== undefined) parts.push("reward " + fmt(d.reward, 2));
  if (d.advantage !== null && d.action !== undefined) parts.push("adv " + signed(d.advantage));
  parts.push("return " + fmt(d.return, 2));
  if (d.entropy !== null) parts.push("entropy " + fmt(d.entropy, 2));
  h("div", parts.join(" \u00b7 "), tip);
  if (d.action !== undefined) h("div", "action: " + clip(d.action, 200), tip, "t");
  h("div", "observation: " + clip(d.observation || "(empty)", 360), tip, "t");
  tip.style.display = "block";
  moveTip(ev);
}
function moveTip(ev) {
  const w = tip.offsetWidth, hgt = tip.offsetHeight;
  tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - w - 8) + "px";
  tip.style.top = Math.min(ev.clientY + 14, window.innerHeight - hgt - 8) + "px";
}

function legend() {
  const lg = document.getElementById("legend"), er = DATA.entropy_range, rr = DATA.return_range;
  const item = (shape, text) => {
    const s = h("span", null, lg);
    const icon = svg("svg", {width: 18, height: 18}, s);
    shape(icon);
    s.appendChild(document.createTextNode(" " + text));
  };
  item(g => svg("circle", {cx: 9, cy: 9, r: 7, fill: entColor((er[0] + er[1]) / 2),
    stroke: "#1f2937"}, g), "branch node");
  item(g => svg("rect", {x: 2, y: 2, width: 14, height: 14, rx: 2, fill: retColor(rr[1]),
    stroke: "#1f2937"}, g), "leaf");
  item(g => svg("circle", {cx: 9, cy: 9, r: 4, fill: "#e5e7eb", stroke: "#8b95a1"}, g),
    "one child");
  const scale = (name, stops, r) => {
    const s = h("span", name + " " + fmt(r[0], 2), lg);
    h("span", null, s, "bar").style.background = gradient(stops);
    s.appendChild(document.createTextNode(fmt(r[1], 2)));
  };
  scale("entropy at branch", VIRIDIS, er);
  scale("leaf return", RDYLGN, rr);
  h("span", "edge label: sibling advantage", lg);
}

function fillSelectors(ti) {
  const its = [...new Set(TREES.map(t => t.iteration))];
  const itsel = document.getElementById("itsel"), tsel = document.getElementById("treesel");
  if (!itsel.options.length) its.forEach(it => h("option", String(it), itsel).value = it);
  itsel.value = String(TREES[ti].iteration);
  tsel.textContent = "";
  TREES.forEach((t, j) => {
    if (String(t.iteration) !== itsel.value) return;
    const o = h("option", "#" + j + " " + t.task + " (" + t.nodes.length + " nodes)", tsel);
    o.value = j;
  });
  tsel.value = String(ti);
}
function show(ti) {
  ti = Math.max(0, Math.min(TREES.length - 1, ti));
  fillSelectors(ti);
  render(ti);
  try { history.replaceState(null, "", "#tree=" + ti); } catch (err) { /* file:// limits */ }
}

if (!TREES.length) {
  h("p", "No sampled trees in this run (trees.jsonl is missing or empty; run.log_trees = 0?).",
    document.getElementById("canvas"), "muted");
  return;
}
legend();
document.getElementById("itsel").addEventListener("change", e => {
  show(TREES.findIndex(t => String(t.iteration) === e.target.value));
});
document.getElementById("treesel").addEventListener("change", e => show(Number(e.target.value)));
document.getElementById("prev").addEventListener("click", () => show(current - 1));
document.getElementById("next").addEventListener("click", () => show(current + 1));
document.getElementById("zoomin").addEventListener("click", () => { zoom *= 1.25; applyZoom(); });
document.getElementById("zoomout").addEventListener("click", () => { zoom /= 1.25; applyZoom(); });
document.addEventListener("keydown", e => {
  if (e.target.tagName === "SELECT") return;
  if (e.key === "ArrowLeft") show(current - 1);
  if (e.key === "ArrowRight") show(current + 1);
});
const m = /^#tree=(\d+)$/.exec(location.hash);
const last = TREES[TREES.length - 1].iteration;
show(m ? Number(m[1]) : TREES.findIndex(t => t.iteration === last));
})();
</script>
</body></html>
"""
