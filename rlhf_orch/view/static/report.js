// The run page (rlhf_orch.view). Everything it shows is in this file: the runs' data in
// #rlhf-data, each dumped step's sequences in its own gzip+base64 block, decoded only when the step
// is opened (a 1000-step run opens at once). The page's state lives in location.hash, so a reload
// (the --serve refresh) and a link keep what is shown.
"use strict";

const DATA = JSON.parse(document.getElementById("rlhf-data").textContent);
// Served by `python -m rlhf_orch.view --serve`: refreshed while the run goes on (its /__version
// answers with the X-Rlhf-Orch-Version header; anything else -- a file, another server -- stops the
// polling at the first answer). Opened from disk or an artifact: as written.
const LIVE = location.protocol === "http:" || location.protocol === "https:";
let served = false;  // /__version answered as rlhf_orch.view's server answers
const RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const state = {
  topic: null, keys: {}, keyFilter: "",
  run: 0, step: null, open: null, field: "mask",
  rmin: "", rmax: "", src: "", trunc: "", err: "", tmin: "", tmax: "", q: "", sort: "i", asc: true,
};
const stepCache = new Map();
const tip = el("div", { class: "tip" });

// ------------------------------------------------------------------ small helpers
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}
function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toFixed(digits === undefined ? 3 : digits);
}
function showTip(event, text) {
  tip.textContent = text;
  tip.style.display = "block";
  const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  tip.style.left = x + "px";
  tip.style.top = (event.clientY + 14) + "px";
}
function hideTip() { tip.style.display = "none"; }

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const [k, v] of params) {
    if (k === "keys") state.keys = Object.fromEntries(v.split(",").filter(Boolean).map((x) => [x, true]));
    else if (k in state) state[k] = ["run", "step", "open"].includes(k) ? (v === "" ? null : Number(v)) : (k === "asc" ? v !== "0" : v);
  }
}
function writeHash() {
  const params = new URLSearchParams();
  for (const k of ["topic", "run", "step", "open", "field", "rmin", "rmax", "src", "trunc", "err", "tmin", "tmax", "q", "sort"]) {
    if (state[k] !== null && state[k] !== "" && state[k] !== undefined) params.set(k, state[k]);
  }
  if (!state.asc) params.set("asc", "0");
  const chosen = Object.keys(state.keys).filter((k) => state.keys[k]);
  if (chosen.length) params.set("keys", chosen.join(","));
  history.replaceState(null, "", "#" + params.toString());
}

// ------------------------------------------------------------------ header, runs, notes
function liveBadge() {
  return el("span", { class: "live", title: "rlhf_orch.view --serve: refreshes while the run goes on" }, "live");
}

function header() {
  const runs = DATA.runs;
  const title = runs.length === 1 ? runs[0].name : `${runs.length} runs compared`;
  const h = el("header", {},
    el("h1", {}, title, served ? liveBadge() : ""),
    el("div", { class: "sub" }, `${runs.map((r) => r.dir).join(" · ")} — page written ${DATA.generated}`));
  return h;
}

function notes() {
  const lines = [];
  for (const [k, r] of DATA.runs.entries()) {
    for (const n of r.notes) lines.push(DATA.runs.length > 1 ? `${r.label}: ${n}` : n);
  }
  if (!lines.length) return "";
  return el("div", { class: "notes", id: "notes" }, lines.map((t) => el("div", {}, t)));
}

function runsTable() {
  const rows = DATA.runs.map((r, k) => {
    const s = r.summary || {};
    return el("tr", {},
      el("td", {}, el("span", { class: "swatch", style: `background:${RUN_COLORS[k % RUN_COLORS.length]}` }), r.label),
      el("td", { class: `status-${r.status}` }, r.status),
      el("td", { class: "num" }, fmt(s.steps ?? (r.metrics.steps.length ? r.metrics.steps[r.metrics.steps.length - 1] : ""))),
      el("td", { class: "num" }, fmt(s.reward_first)),
      el("td", { class: "num" }, fmt(s.reward_last)),
      el("td", { class: "num" }, s.wall_s !== undefined ? fmt(s.wall_s, 1) + " s" : ""),
      el("td", {}, r.reason || ""),
      el("td", { class: "muted" }, r.overrides.join(" ")));
  });
  const table = el("table", { id: "runs" },
    el("tr", {}, ["run", "status", "steps", "reward (first)", "reward (last)", "wall", "why it ended so", "overrides"].map((h) => el("th", {}, h))),
    rows);
  const configs = DATA.runs.map((r) => el("details", {}, el("summary", {}, `config of ${r.label} (.hydra/config.yaml)`), el("pre", {}, r.config || "(none)")));
  return el("section", { id: "summary" }, el("h2", {}, DATA.runs.length > 1 ? "Runs" : "Run"), table, configs);
}

// ------------------------------------------------------------------ curves
function allTopics() {
  const order = [];
  const keysOf = {};
  for (const r of DATA.runs) {
    for (const t of r.topics) {
      if (!(t.name in keysOf)) { order.push(t.name); keysOf[t.name] = []; }
      for (const k of t.keys) if (!keysOf[t.name].includes(k)) keysOf[t.name].push(k);
    }
  }
  return order.map((name) => ({ name, keys: keysOf[name] }));
}

function curves() {
  const topics = allTopics();
  const sec = el("section", { id: "curves" }, el("h2", {}, "Curves"));
  if (!topics.length) { sec.append(el("div", { class: "empty" }, "no finished step: no curve yet")); return sec; }
  if (!topics.some((t) => t.name === state.topic)) state.topic = topics[0].name;
  const buttons = el("div", { class: "bar", id: "topics" }, topics.map((t) =>
    el("button", { class: "topic" + (t.name === state.topic ? " on" : ""), "data-topic": t.name, onclick: () => { state.topic = t.name; state.keys = {}; render(); } }, `${t.name} (${t.keys.length})`)));
  const topic = topics.find((t) => t.name === state.topic);
  const chosen = Object.keys(state.keys).filter((k) => state.keys[k] && topic.keys.includes(k));
  const shown = chosen.length ? chosen : topic.keys.slice(0, 8);
  const keyBoxes = el("div", { class: "keys", id: "keys" }, topic.keys.map((k) => el("label", {},
    el("input", { type: "checkbox", value: k, ...(shown.includes(k) ? { checked: "" } : {}), onchange: (e) => {
      for (const x of shown) state.keys[x] = true;
      state.keys[k] = e.target.checked;
      render();
    } }), " " + k)));
  const legend = DATA.runs.length > 1 ? el("div", { class: "legend" }, DATA.runs.map((r, k) => el("span", {}, el("span", { class: "swatch", style: `background:${RUN_COLORS[k % RUN_COLORS.length]}` }), r.label))) : "";
  const grid = el("div", { class: "charts" }, shown.map(chart));
  sec.append(buttons, keyBoxes, legend, grid);
  return sec;
}

function chart(key) {
  const W = 430, H = 190, L = 52, R = 10, T = 8, B = 26;
  const lines = [];
  const marks = [];
  let xs = [], ys = [];
  for (const [k, r] of DATA.runs.entries()) {
    const values = r.metrics.series[key];
    if (values) {
      const pts = r.metrics.steps.map((s, i) => [s, values[i]]).filter((p) => p[1] !== null);
      lines.push({ k, pts, label: r.label });
      xs = xs.concat(pts.map((p) => p[0])); ys = ys.concat(pts.map((p) => p[1]));
    }
    for (const rec of r.superseded) if (rec[key] !== undefined && rec[key] !== null) { marks.push({ k, s: rec.step, v: rec[key] }); xs.push(rec.step); ys.push(rec[key]); }
  }
  const box = el("div", { class: "chart", "data-key": key }, el("div", { class: "title" }, key));
  if (!xs.length) { box.append(el("div", { class: "empty" }, "no value")); return box; }
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = (s) => L + (s - x0) / (x1 - x0) * (W - L - R);
  const Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, style: "width:100%;height:auto" });
  for (let i = 0; i <= 4; i++) {
    const v = y0 + (y1 - y0) * i / 4, y = Y(v);
    g.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#e6e9ec" }));
    const t = svg("text", { x: L - 4, y: y + 4, "text-anchor": "end", "font-size": 10, fill: "#5f6b76" }); t.textContent = fmt(v, 3); g.append(t);
  }
  const ticks = [...new Set([0, 1, 2, 3, 4].map((i) => Math.round(x0 + (x1 - x0) * i / 4)))].filter((s) => s >= x0 && s <= x1);
  for (const s of ticks) {
    const t = svg("text", { x: X(s), y: H - 8, "text-anchor": "middle", "font-size": 10, fill: "#5f6b76" }); t.textContent = String(s); g.append(t);
  }
  for (const [k, r] of DATA.runs.entries()) {
    for (const m of r.restarts) {
      if (m.step === null || m.step < x0 || m.step > x1) continue;
      const line = svg("line", { x1: X(m.step), x2: X(m.step), y1: T, y2: H - B, stroke: "#e07b00", "stroke-dasharray": "4 3", class: "restart" });
      const title = svg("title", {}); title.textContent = `step ${m.step}: ${m.what}`; line.append(title);
      g.append(line);
    }
  }
  for (const line of lines) {
    const color = RUN_COLORS[line.k % RUN_COLORS.length];
    const d = line.pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    g.append(svg("path", { d, fill: "none", stroke: color, "stroke-width": 1.8 }));
    if (line.pts.length <= 40) for (const p of line.pts) g.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color }));
  }
  for (const m of marks) g.append(svg("circle", { cx: X(m.s), cy: Y(m.v), r: 3, fill: "none", stroke: "#888", class: "superseded" }));
  g.addEventListener("mousemove", (e) => {
    const rect = g.getBoundingClientRect();
    const s = Math.round(x0 + (e.clientX - rect.left - L) / (W - L - R) * (x1 - x0));
    const parts = [`${key} @ step ${s}`];
    for (const line of lines) {
      const p = line.pts.find((q) => q[0] === s);
      if (p) parts.push(`${DATA.runs.length > 1 ? line.label + ": " : ""}${fmt(p[1], 4)}`);
    }
    for (const m of marks) if (m.s === s) parts.push(`superseded (run again): ${fmt(m.v, 4)}`);
    showTip(e, parts.join("\n"));
  });
  g.addEventListener("mouseleave", hideTip);
  box.append(g);
  return box;
}

// ------------------------------------------------------------------ trajectories
async function stepRecords(run, step) {
  const id = `t-${run}-${step}`;
  if (stepCache.has(id)) return stepCache.get(id);
  const block = document.getElementById(id);
  if (!block) return null;
  const bytes = Uint8Array.from(atob(block.textContent.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  const records = JSON.parse(await new Response(stream).text());
  for (const t of records) {
    if (t.tok && t.prompt === undefined) {  // (the file holds the pieces only: see trajectories.py)
      const first = t.tok.mask.indexOf(1) < 0 ? t.tok.s.length : t.tok.mask.indexOf(1);
      t.prompt = t.tok.s.slice(0, first).join("");
      t.response = t.tok.s.slice(first).join("");
    }
  }
  stepCache.set(id, records);
  return records;
}

function passes(t) {
  const num = (v) => (v === "" || v === null ? null : Number(v));
  const rmin = num(state.rmin), rmax = num(state.rmax), tmin = num(state.tmin), tmax = num(state.tmax);
  if (rmin !== null && !(t.reward >= rmin)) return false;
  if (rmax !== null && !(t.reward <= rmax)) return false;
  if (tmin !== null && !(t.turns >= tmin)) return false;
  if (tmax !== null && !(t.turns <= tmax)) return false;
  if (state.src && t.src !== state.src) return false;
  if (state.trunc && String(Boolean(t.trunc)) !== state.trunc) return false;
  if (state.err && String((t.err || 0) > 0) !== state.err) return false;
  if (state.q) {
    const q = state.q.toLowerCase();
    if (!(t.prompt + "\n" + t.response).toLowerCase().includes(q)) return false;
  }
  return true;
}

const COLUMNS = [
  ["i", "index"], ["traj", "trajectory"], ["src", "source"], ["turns", "turns"], ["reward", "reward"],
  ["adv", "advantage"], ["len", "tokens"], ["trunc", "truncated"], ["err", "errors"], ["ver", "version"], ["response", "response"],
];

function trajectories() {
  const sec = el("section", { id: "trajectories" }, el("h2", {}, "Trajectories"));
  const run = DATA.runs[state.run] || DATA.runs[0];
  if (!run || !run.rollout_steps.length) { sec.append(el("div", { class: "empty" }, "no dumped step (rollouts/step_*.jsonl)")); return sec; }
  if (!run.rollout_steps.includes(state.step)) state.step = run.rollout_steps[0];
  const control = (label, node) => el("label", {}, label + " ", node);
  const input = (key, attrs) => el("input", { ...attrs, value: state[key], "data-filter": key, onchange: (e) => { state[key] = e.target.value; state.open = null; renderTrajectories(); } });
  const select = (key, options) => el("select", { "data-filter": key, onchange: (e) => { state[key] = e.target.value; state.open = null; renderTrajectories(); } },
    options.map(([v, t]) => el("option", { value: v, ...(String(state[key]) === String(v) ? { selected: "" } : {}) }, t)));
  const bar = el("div", { class: "bar", id: "filters" },
    DATA.runs.length > 1 ? control("run", el("select", { id: "run", onchange: (e) => { state.run = Number(e.target.value); state.step = null; state.open = null; render(); } },
      DATA.runs.map((r, k) => el("option", { value: k, ...(k === state.run ? { selected: "" } : {}) }, r.label)))) : "",
    control("step", el("select", { id: "step", onchange: (e) => { state.step = Number(e.target.value); state.open = null; renderTrajectories(); } },
      run.rollout_steps.map((s) => el("option", { value: s, ...(s === state.step ? { selected: "" } : {}) }, String(s))))),
    control("reward ≥", input("rmin", { type: "number", step: "any" })),
    control("≤", input("rmax", { type: "number", step: "any" })),
    control("source", el("span", { id: "src-holder" })),
    control("truncated", select("trunc", [["", "any"], ["true", "yes"], ["false", "no"]])),
    control("errored", select("err", [["", "any"], ["true", "yes"], ["false", "no"]])),
    control("turns ≥", input("tmin", { type: "number", min: 0 })),
    control("≤", input("tmax", { type: "number", min: 0 })),
    control("search", input("q", { type: "search", placeholder: "text in prompt or response" })));
  sec.append(bar, el("div", { id: "traj-count", class: "muted" }), el("div", { id: "traj-table" }), el("div", { id: "traj-detail" }));
  return sec;
}

let renderSerial = 0;  // a step still decoding must not draw over the one opened after it

async function renderTrajectories() {
  const serial = ++renderSerial;
  writeHash();
  const holder = document.getElementById("traj-table");
  if (!holder) return;
  const records = await stepRecords(state.run, state.step);
  if (serial !== renderSerial) return;
  if (!records) { holder.replaceChildren(el("div", { class: "empty" }, `step ${state.step}: not in this page`)); return; }
  const sources = [...new Set(records.map((t) => t.src).filter((s) => s !== null && s !== undefined))].sort();
  const srcSelect = el("select", { "data-filter": "src", onchange: (e) => { state.src = e.target.value; state.open = null; renderTrajectories(); } },
    [["", "any"], ...sources.map((s) => [s, s])].map(([v, t]) => el("option", { value: v, ...(state.src === v ? { selected: "" } : {}) }, t)));
  document.getElementById("src-holder").replaceChildren(srcSelect);
  const shown = records.filter(passes);
  const key = state.sort;
  const sign = state.asc ? 1 : -1;
  shown.sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return a.i - b.i;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * sign;
  });
  document.getElementById("traj-count").textContent = `step ${state.step}: ${shown.length} of ${records.length} dumped sequences shown`;
  const head = el("tr", {}, COLUMNS.map(([k, label]) => el("th", {
    class: "sortable" + (k === key ? " sorted" + (state.asc ? " asc" : "") : ""), "data-sort": k,
    onclick: () => { state.asc = state.sort === k ? !state.asc : true; state.sort = k; renderTrajectories(); },
  }, label)));
  const rows = shown.map((t) => el("tr", { class: "row" + (t.i === state.open ? " open" : ""), "data-index": t.i, onclick: () => { state.open = t.i; renderTrajectories(); } },
    el("td", { class: "num" }, t.i), el("td", { class: "num" }, t.traj), el("td", {}, t.src ?? ""), el("td", { class: "num" }, fmt(t.turns)),
    el("td", { class: "num reward" }, fmt(t.reward)), el("td", { class: "num" }, fmt(t.adv)), el("td", { class: "num" }, fmt(t.len)),
    el("td", {}, t.trunc ? "yes" : ""), el("td", { class: "num" }, t.err ? t.err : ""), el("td", { class: "num" }, fmt(t.ver)),
    el("td", { class: "preview response" }, t.response)));
  holder.replaceChildren(shown.length ? el("table", {}, head, rows) : el("div", { class: "empty" }, "no sequence passes the filters"));
  const open = records.find((t) => t.i === state.open);
  document.getElementById("traj-detail").replaceChildren(open ? detail(open) : "");
}

// ------------------------------------------------------------------ one trajectory
const THINK = /(<think>[\s\S]*?(?:<\/think>|$))/;
const TOOL_CALL = /(<tool_call>[\s\S]*?(?:<\/tool_call>|$))/;

function turnBody(text, model) {
  // Reasoning and tool calls are set apart in what the model wrote only (a system prompt that
  // mentions <think> is an instruction, not reasoning).
  const body = el("div", { class: "body" });
  if (!model) { body.append(text); return body; }
  for (const part of text.split(THINK)) {
    if (!part) continue;
    if (THINK.test(part) && part.startsWith("<think>")) {
      body.append(el("details", { class: "think" }, el("summary", {}, `reasoning (${part.length} characters)`), part));
      continue;
    }
    for (const piece of part.split(TOOL_CALL)) {
      if (!piece) continue;
      body.append(piece.startsWith("<tool_call>") ? el("span", { class: "toolcall", title: "tool call" }, piece) : piece);
    }
  }
  return body;
}

function conversation(t) {
  const box = el("div", { class: "conversation" }, el("h3", {}, `sequence ${t.i}: conversation`));
  const turns = t.seg
    ? t.seg.map((s) => ({ role: s.role, model: s.model, env: s.env, text: t.tok.s.slice(s.start, s.end).join("") }))
    : [{ role: "user", model: false, env: false, text: t.prompt }, { role: "assistant", model: true, env: false, text: t.response }];
  for (const turn of turns) {
    const label = turn.model ? `${turn.role}: the model's turn (trained on)`
      : turn.env ? `${turn.role}: the environment's answer (context, not trained on)` : `${turn.role} (prompt)`;
    const cls = `turn ${turn.role}${turn.env ? " observation" : ""}`;
    box.append(el("div", { class: cls }, el("div", { class: "role" }, label), turnBody(turn.text, turn.model)));
  }
  const facts = [`reward ${fmt(t.reward)}`, `advantage ${fmt(t.adv)}`, `${t.len} model tokens`, `${t.turns} model turn(s)`, `weight version ${t.ver}`];
  if (t.trunc) facts.push("truncated");
  if (t.intr) facts.push("a weight update reached it while it generated");
  if (t.err) facts.push(`${t.err} environment error(s)`);
  box.append(el("div", { class: "muted" }, facts.join(" · ")));
  if (t.env) box.append(el("details", {}, el("summary", {}, "environment counters"), el("pre", {}, JSON.stringify(t.env, null, 1))));
  return box;
}

const FIELDS = {
  mask: "loss mask (model vs context tokens)",
  adv: "advantage",
  gap: "engine − trainer log-prob",
  ver: "weight version",
};

function tokenColor(field, t, k, scale) {
  const tok = t.tok;
  const model = tok.mask[k] === 1;
  if (field === "mask") return model ? "#c8e6c9" : "#eceff1";
  if (!model) return "transparent";
  if (field === "adv") {
    const v = tok.adv ? tok.adv[k] : 0;
    const a = Math.min(1, Math.abs(v) / scale);
    return v >= 0 ? `rgba(44,160,44,${0.1 + 0.75 * a})` : `rgba(214,39,40,${0.1 + 0.75 * a})`;
  }
  if (field === "gap") {
    if (!tok.elp || !tok.tlp) return "transparent";
    const a = Math.min(1, Math.abs(tok.elp[k] - tok.tlp[k]) / scale);
    return `rgba(255,127,14,${0.05 + 0.85 * a})`;
  }
  if (field === "ver") {
    const v = tok.ver ? tok.ver[k] : t.ver;
    return RUN_COLORS[((v - scale) % RUN_COLORS.length + RUN_COLORS.length) % RUN_COLORS.length] + "55";
  }
  return "transparent";
}

function tokenView(t) {
  const box = el("div", { class: "token-view" }, el("h3", {}, "tokens"));
  if (!t.tok) { box.append(el("div", { class: "empty" }, "this dump has no per-token fields (written before they existed)")); return box; }
  const tok = t.tok;
  const pick = el("select", { id: "field", onchange: (e) => { state.field = e.target.value; renderTrajectories(); } },
    Object.entries(FIELDS).map(([k, label]) => el("option", { value: k, ...(k === state.field ? { selected: "" } : {}) }, label)));
  const field = state.field in FIELDS ? state.field : "mask";
  let scale = 1, note = "";
  const model = tok.mask.map((m, k) => (m === 1 ? k : -1)).filter((k) => k >= 0);
  if (field === "adv") { scale = Math.max(1e-6, ...model.map((k) => Math.abs(tok.adv ? tok.adv[k] : 0))); note = `green > 0 > red, full colour at |A| = ${fmt(scale)}`; }
  if (field === "gap") {
    if (!tok.elp || !tok.tlp) note = "no engine or trainer log-probs in this dump";
    else { scale = Math.max(0.01, ...model.map((k) => Math.abs(tok.elp[k] - tok.tlp[k]))); note = `full colour at |gap| = ${fmt(scale, 4)} nats`; }
  }
  if (field === "ver") { const vs = tok.ver || [t.ver]; scale = Math.min(...vs); note = `versions ${[...new Set(vs)].join(", ")}`; }
  if (field === "mask") note = "green: model tokens (trained on); grey: prompt and observations";
  const text = el("div", { class: "tokens" });
  tok.s.forEach((piece, k) => {
    const span = el("span", { class: "tk", style: `background:${tokenColor(field, t, k, scale)}` }, piece);
    span.addEventListener("mousemove", (e) => {
      const lines = [`token ${k}  id ${tok.id ? tok.id[k] : "?"}  ${JSON.stringify(piece)}`, tok.mask[k] === 1 ? "model token (trained on)" : "context (not trained on)"];
      if (tok.mask[k] === 1) {
        if (tok.adv) lines.push(`advantage ${fmt(tok.adv[k], 4)}`);
        if (tok.elp) lines.push(`engine log-prob ${fmt(tok.elp[k], 4)}`);
        if (tok.tlp) lines.push(`trainer log-prob ${fmt(tok.tlp[k], 4)}`);
        if (tok.elp && tok.tlp) lines.push(`gap ${fmt(tok.elp[k] - tok.tlp[k], 5)}`);
      }
      lines.push(`weight version ${tok.ver ? tok.ver[k] : t.ver}`);
      showTip(e, lines.join("\n"));
    });
    span.addEventListener("mouseleave", hideTip);
    text.append(span);
  });
  box.append(el("div", { class: "bar" }, el("label", {}, "colour by ", pick), el("span", { class: "muted" }, note)), text);
  return box;
}

function detail(t) {
  return el("div", { class: "detail", id: "open-trajectory" }, conversation(t), tokenView(t));
}

// ------------------------------------------------------------------ page
function render() {
  if (!(Number.isInteger(state.run) && state.run >= 0 && state.run < DATA.runs.length)) state.run = 0;
  writeHash();
  const body = el("main", {}, notes(), runsTable(), curves(), trajectories());
  document.getElementById("app").replaceChildren(header(), body, tip);
  return renderTrajectories();
}

let polling = null;

async function poll() {
  try {
    const answer = await fetch("/__version", { cache: "no-store" });
    const version = (await answer.text()).trim();
    if (!answer.ok || !answer.headers.get("X-Rlhf-Orch-Version") || !/^[0-9a-f]{16}$/.test(version)) {
      clearInterval(polling);  // not rlhf_orch.view's server: the page stays as it is
      return;
    }
    if (version !== DATA.version) { location.reload(); return; }
    if (!served) {
      served = true;
      document.querySelector("header h1").append(liveBadge());
    }
  } catch (e) {
    // the server went away (the run ended and --serve was stopped): keep the page as it is
  }
}

readHash();
window.rlhfReady = render().then(() => { document.body.setAttribute("data-ready", "1"); });
if (LIVE) { polling = setInterval(poll, 2000); poll(); }
