// Rollover run viewer: plain JS, inline SVG charts, no dependencies.
// Routes (in the hash): #/ metrics, #/timeline, #/rollouts?filters, #/group/ID, #/rollout/ID.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
const PHASE_COLORS = {
  "rollout wait": "#93c5fd", "drain": "#f59e0b", "update": "#8b5cf6", "weight sync": "#10b981",
  "evaluation": "#f472b6", "pause": "#ef4444",
};
const SEED_ASYNC = [
  "training/async/n_prev_carry_over_rollouts",
  "training/async/n_completed_rollouts",
  "training/async/n_new_carry_over_rollouts",
  "training/async/new_carry_over_age_max_steps",
  "training/async/proxy_inflight_at_pause",
  "training/async/proxy_drain_seconds",
];
const CHARTS = [
  { title: "reward", keys: ["critic/score/mean", "reward/accuracy", "val/reward_mean", "val/accuracy"] },
  ...SEED_ASYNC.map((key) => ({ title: key.replace("training/async/", ""), keys: [key], seed: true })),
  { title: "rollout time (s)", keys: ["timing/rollout_queue_wait_s/mean", "timing/rollout_run_duration_s/mean",
    "timing/rollout_run_duration_s/p90", "timing/rollout_total_s/max"] },
  { title: "step time (s)", keys: ["timing/step_s", "timing/rollout_wait_s", "timing/update_s",
    "timing/weight_sync_s", "timing/gateway_pause_s"] },
  { title: "staleness (policy versions)", keys: ["policy/version_lag_mean", "policy/version_lag_max",
    "training/async/n_completed_from_carry_over"] },
  { title: "policy loss", keys: ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss"] },
  { title: "entropy and filtered groups", keys: ["actor/entropy", "training/n_filtered_groups"] },
  { title: "rollout correction", keys: ["rollout_corr/is_mean", "rollout_corr/is_max",
    "rollout_corr/clipped_fraction", "rollout_corr/kl"] },
];

// pending: the view on screen shows rollouts that are not finished, so it is redrawn each tick
const state = { run: null, metrics: [], refreshing: false, lastUpdate: 0, picked: [], pending: false };

// -- small helpers -----------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS(SVGNS, tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs >= 1000) return value.toFixed(0);
  if (abs >= 10) return value.toFixed(1);
  return value.toFixed(digits);
}

function secs(value) {
  if (value === null || value === undefined) return "—";
  return value >= 100 ? `${value.toFixed(0)}s` : `${value.toFixed(2)}s`;
}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) throw new Error((body && (body.reason || body.error)) || `${response.status} ${response.statusText}`);
  return body;
}

function stateBadge(row) {
  const name = row.aborted ? "aborted" : row.state;
  return el("span", { class: `state ${name}`, title: row.error || "" }, name);
}

function parseRoute() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { name: parts[0] || "overview", arg: parts.slice(1).join("/"), params: new URLSearchParams(query || "") };
}

const tooltip = () => document.getElementById("tooltip");

function showTip(event, text) {
  const tip = tooltip();
  tip.textContent = text;
  tip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

function hideTip() { tooltip().hidden = true; }

function withTip(node, text) {
  node.addEventListener("mousemove", (event) => showTip(event, text));
  node.addEventListener("mouseleave", hideTip);
  return node;
}

// -- charts ------------------------------------------------------------------------------

function niceTicks(lo, hi, count) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toFixed(10));
  // enough decimals to tell neighbouring ticks apart (0.002 and 0.004, not 0.00 twice)
  ticks.decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9) + (step / mag === 2.5 ? 1 : 0));
  return ticks;
}

function tickLabel(value, ticks) {
  return Number.isInteger(value) ? String(value) : value.toFixed(Math.min(ticks.decimals, 6));
}

function seriesOf(rows, key) {
  return rows.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
}

function lineChart(title, keys, rows) {
  const series = keys.map((key, i) => ({ key, color: COLORS[i % COLORS.length], points: seriesOf(rows, key) }))
    .filter((s) => s.points.length > 0);
  const card = el("div", { class: "card chart", dataset: { chart: title, series: series.length } }, el("h3", {}, title));
  if (series.length === 0) {
    card.append(el("div", { class: "empty" }, "no data yet"));
    return card;
  }
  const W = 360, H = 180, L = 42, R = 10, T = 8, B = 22;
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const ys = series.flatMap((s) => s.points.map((p) => p[1]));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  if (x0 === x1) { x0 -= 0.5; x1 += 0.5; }
  let [y0, y1] = [Math.min(0, ...ys), Math.max(...ys)];
  if (y0 === y1) { y1 = y0 + 1; }
  const yt = niceTicks(y0, y1, 4);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  for (const t of yt) {
    svg.append(svgEl("line", { class: "gridline", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
    svg.append(svgEl("text", { x: L - 4, y: sy(t) + 3, "text-anchor": "end" }, tickLabel(t, yt)));
  }
  const xt = niceTicks(x0, x1, Math.min(6, Math.max(1, Math.round(x1 - x0)))).filter((t) => Number.isInteger(t));
  for (const t of xt) svg.append(svgEl("text", { x: sx(t), y: H - 6, "text-anchor": "middle" }, String(t)));
  svg.append(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.append(svgEl("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  series.forEach((s, i) => {
    const path = s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    // later series dashed, so one that lies on another (accuracy on a 0/1 reward) still shows
    svg.append(svgEl("polyline", { points: path, fill: "none", stroke: s.color, "stroke-width": 1.8,
      "stroke-dasharray": i % 2 ? "5 3" : null, dataset: { series: s.key, points: s.points.length } }));
    for (const [x, y] of s.points) {
      svg.append(withTip(svgEl("circle", { cx: sx(x), cy: sy(y), r: 2.6, fill: s.color, class: "point" }),
        `${s.key}\nstep ${x}: ${fmt(y, 4)}`));
    }
  });
  card.append(svg);
  card.append(el("div", { class: "legend" },
    series.map((s, i) => el("span", {}, el("i", { style: i % 2 ? `border-top:2px dashed ${s.color};height:0`
      : `background:${s.color}` }), s.key))));
  return card;
}

// -- views -------------------------------------------------------------------------------

function lastWith(rows, key) {
  for (let i = rows.length - 1; i >= 0; i--) if (typeof rows[i][key] === "number") return rows[i][key];
  return null;
}

function firstWith(rows, key) {
  for (const row of rows) if (typeof row[key] === "number") return row[key];
  return null;
}

function runFacts() {
  const run = state.run, rows = state.metrics;
  const steps = rows.filter((r) => "timing/step_s" in r).length;
  const window = run.async ? `async, window ${run.async_train_batch_size}` : "synchronous";
  const facts = [
    ["run folder", run.run_dir],
    ["steps", `${steps} / ${run.total_training_steps}`],
    ["batch", `${run.train_batch_size} groups × n=${run.n} (${window})`],
    ["estimator", run.adv_estimator],
    ["last reward", fmt(lastWith(rows, "critic/score/mean"))],
    ["held-out", `${fmt(firstWith(rows, "val/reward_mean"))} → ${fmt(lastWith(rows, "val/reward_mean"))}`],
  ];
  return el("div", { class: "card facts" },
    facts.map(([k, v]) => el("div", {}, el("b", {}, k), el("span", { class: k === "run folder" ? "mono" : "" }, v))),
    run.config_error ? el("div", { class: "error" }, run.config_error) : null);
}

function viewOverview() {
  const rows = state.metrics;
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))].filter((k) => k !== "step" && k !== "time").sort();
  const picker = el("select", { id: "metric-picker", multiple: true, size: 6, style: "min-width:380px",
    onchange: (event) => {
      state.picked = [...event.target.selectedOptions].map((o) => o.value);
      render();
    } }, keys.map((k) => el("option", { value: k, selected: state.picked.includes(k) }, k)));
  return el("div", {},
    runFacts(),
    el("h2", {}, "Metrics over steps"),
    el("div", { class: "grid", id: "charts" }, CHARTS.map((c) => lineChart(c.title, c.keys, rows))),
    el("h2", {}, "Any metric"),
    el("div", { class: "row2" }, el("div", {}, picker),
      state.picked.length ? lineChart(state.picked.join(", "), state.picked, rows) : el("p", { class: "muted" },
        "pick metrics on the left (ctrl/shift for several)")));
}

async function viewTimeline() {
  const data = await api("api/timeline");
  const root = el("div", {}, el("h2", {}, "Step timeline"));
  if (!data.steps.length && !data.evaluations.length) {
    root.append(el("p", { class: "muted" }, "no finished step yet"));
    return root;
  }
  const origin = data.origin;
  const rowsByStep = new Map();
  for (const s of data.steps) rowsByStep.set(s.step, { step: s.step, train: s, evals: [] });
  for (const e of data.evaluations) {
    if (!rowsByStep.has(e.step)) rowsByStep.set(e.step, { step: e.step, train: null, evals: [] });
    rowsByStep.get(e.step).evals.push(e);
  }
  const rows = [...rowsByStep.values()].sort((a, b) => a.step - b.step);
  const end = Math.max(...data.steps.map((s) => Math.max(s.end, s.pause ? s.pause.end : s.end)),
    ...data.evaluations.map((e) => e.end)) - origin;
  const W = 1100, L = 62, R = 14, RH = 26, T = 8, B = 26;
  const H = T + rows.length * RH + B;
  const sx = (t) => L + ((t - origin) / Math.max(end, 1e-9)) * (W - L - R);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, id: "timeline", role: "img", "aria-label": "step timeline" });
  const xticks = niceTicks(0, end, 8);
  for (const t of xticks) {
    const x = sx(origin + t);
    svg.append(svgEl("line", { class: "gridline", x1: x, x2: x, y1: T, y2: H - B }));
    svg.append(svgEl("text", { x, y: H - 8, "text-anchor": "middle" }, `${tickLabel(t, xticks)}s`));
  }
  rows.forEach((row, i) => {
    const y = T + i * RH;
    svg.append(svgEl("text", { x: L - 6, y: y + 13, "text-anchor": "end" }, `step ${row.step}`));
    const bar = (phase, start, stop, dy, h, label) => {
      const width = Math.max(sx(stop) - sx(start), 0.8);
      return withTip(svgEl("rect", { x: sx(start), y: y + dy, width, height: h, fill: PHASE_COLORS[phase], rx: 2,
        class: "segment", dataset: { phase, step: row.step } }), `${label || phase}\n${secs(stop - start)}`);
    };
    if (row.train) {
      for (const seg of row.train.segments) {
        if (seg.end > seg.start) svg.append(bar(seg.phase, seg.start, seg.end, 2, 14, `step ${row.step}: ${seg.phase}`));
      }
      if (row.train.pause) svg.append(bar("pause", row.train.pause.start, row.train.pause.end, 18, 4,
        `step ${row.step}: gateway paused (agents held off)`));
    }
    for (const e of row.evals) svg.append(bar("evaluation", e.start, e.end, 2, 14, `held-out evaluation after step ${row.step}`));
  });
  root.append(el("div", { class: "card" }, svg, el("div", { class: "legendrow" },
    Object.entries(PHASE_COLORS).map(([phase, color]) => el("span", {}, el("span", { class: "swatch", style: `background:${color}` }),
      phase === "pause" ? "gateway paused (what agents saw)" : phase)))));
  const table = el("table", { id: "timeline-table" }, el("tr", {}, ["step", "rollout wait", "drain", "update",
    "weight sync", "pause agents saw", "step total"].map((h) => el("th", {}, h))));
  for (const s of data.steps) {
    const seg = Object.fromEntries(s.segments.map((g) => [g.phase, g.end - g.start]));
    table.append(el("tr", {}, el("td", {}, s.step), ["rollout wait", "drain", "update", "weight sync"].map((p) =>
      el("td", { class: "num" }, secs(seg[p]))), el("td", { class: "num" }, s.pause ? secs(s.pause.end - s.pause.start) : "—"),
      el("td", { class: "num" }, secs(s.end - s.start))));
  }
  root.append(el("h2", {}, "Per step"), table);
  return root;
}

const FILTERS = ["step", "state", "mode", "group", "reward_min", "reward_max"];
const PAGE = 500;

// A group the zero-variance filter took out (every member scored alike) has no advantage.
function advantageText(row) {
  return row.filtered ? "filtered: no signal" : fmt(row.advantage);
}

function rolloutRow(row) {
  return el("tr", { class: "clickable", dataset: { rollout: row.rollout_id },
    onclick: () => { location.hash = `#/rollout/${encodeURIComponent(row.rollout_id)}`; } },
  el("td", { class: "mono" }, row.rollout_id),
  el("td", { class: "mono" }, el("a", { href: `#/group/${encodeURIComponent(row.group)}`,
    onclick: (event) => event.stopPropagation() }, row.group)),
  el("td", {}, row.mode), el("td", { class: "num" }, fmt(row.step)), el("td", {}, stateBadge(row)),
  el("td", { class: "num reward" }, fmt(row.reward)), el("td", { class: "num" }, advantageText(row)),
  el("td", { class: "num" }, row.n_attempts), el("td", { class: "num" }, secs(row.queue_s)),
  el("td", { class: "num" }, secs(row.run_s)));
}

function rolloutTable(rows, id) {
  return el("table", { id }, el("tr", {}, ["rollout", "group", "mode", "step", "state", "reward", "advantage",
    "attempts", "queued", "ran"].map((h) => el("th", {}, h))), rows.map(rolloutRow));
}

async function viewRollouts(params) {
  const query = new URLSearchParams();
  for (const name of FILTERS) if (params.get(name)) query.set(name, params.get(name));
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  query.set("limit", String(PAGE));
  query.set("offset", String(offset));
  const data = await api(`api/rollouts?${query}`);
  state.pending = data.rollouts.some((r) => !r.terminal);
  const field = (name, label, input) => el("label", {}, label, input);
  const text = (name, attrs) => el("input", { name, value: params.get(name) || "", ...attrs });
  const select = (name, options) => el("select", { name }, options.map((o) =>
    el("option", { value: o, selected: (params.get(name) || "") === o }, o || "any")));
  const form = el("form", { class: "filters", id: "filters", onsubmit: (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [k, v] of new FormData(event.target)) if (String(v).trim()) next.set(k, String(v).trim());
    location.hash = `#/rollouts?${next}`;
  } },
  field("step", "enqueued by step", text("step", { type: "number", min: 0, style: "width:90px" })),
  field("state", "state", select("state", ["", "queuing", "running", "succeeded", "failed", "aborted"])),
  field("mode", "mode", select("mode", ["", "train", "val"])),
  field("group", "group (data id)", text("group", {})),
  field("reward_min", "reward ≥", text("reward_min", { type: "number", step: "any", style: "width:90px" })),
  field("reward_max", "reward ≤", text("reward_max", { type: "number", step: "any", style: "width:90px" })),
  el("button", { class: "primary", type: "submit" }, "filter"),
  el("button", { type: "button", onclick: () => { location.hash = "#/rollouts"; } }, "clear"));
  const shown = data.rollouts.length < data.total
    ? ` (${offset + 1}–${offset + data.rollouts.length} shown)` : "";
  const page = (to) => {
    const next = new URLSearchParams(params);
    next.set("offset", String(to));
    return `#/rollouts?${next}`;
  };
  const pager = el("p", { class: "muted", id: "rollout-count" }, `${data.total} rollout${data.total === 1 ? "" : "s"}${shown} `,
    offset > 0 ? el("a", { href: page(Math.max(0, offset - PAGE)) }, "◀ previous") : null, " ",
    offset + data.rollouts.length < data.total ? el("a", { href: page(offset + PAGE) }, "next ▶") : null);
  return el("div", {}, el("h2", {}, "Rollouts"), form, pager, rolloutTable(data.rollouts, "rollouts"));
}

function lastAnswer(row) {
  return row.final_response || "";
}

function siblingCards(siblings, current) {
  return el("div", { class: "siblings", id: "siblings" }, siblings.map((s) => el("div", {
    class: `card sibling${s.rollout_id === current ? " current" : ""}`, dataset: { rollout: s.rollout_id } },
  el("div", {}, el("a", { class: "mono", href: `#/rollout/${encodeURIComponent(s.rollout_id)}` }, s.rollout_id)),
  el("div", { class: "facts" }, el("div", {}, el("b", {}, "state"), stateBadge(s)),
    el("div", {}, el("b", {}, "reward"), el("span", { class: "reward" }, fmt(s.reward))),
    el("div", {}, el("b", {}, "advantage"), el("span", { class: "advantage" }, advantageText(s))),
    el("div", {}, el("b", {}, "ran"), secs(s.run_s))),
  s.final_response !== undefined ? el("div", { class: "answer" }, lastAnswer(s) || "(no reply)") : null)));
}

async function viewGroup(group) {
  const data = await api(`api/groups/${encodeURIComponent(group)}`);
  state.pending = data.rollouts.some((r) => !r.terminal);
  const rewards = data.rollouts.map((r) => r.reward).filter((r) => r !== null);
  const flat = rewards.length > 1 && rewards.every((r) => r === rewards[0]);
  return el("div", {}, el("h2", {}, "Group ", el("span", { class: "mono" }, group)),
    flat ? el("p", { class: "muted" }, "every sibling has the same reward: this group has no learning signal") : null,
    siblingCards(data.rollouts, null));
}

// A message's content: its text, with each recorded image (an image_url part whose URL is the
// record's reference "rollover-image:<sha256>") shown as the picture the model got.
const IMAGE_REF = "rollover-image:";

function imageView(sha256, title) {
  return el("a", { href: `/api/images/${sha256}`, target: "_blank", title: title || sha256 },
    el("img", { class: "call-image", src: `/api/images/${sha256}`, alt: `image ${sha256.slice(0, 12)}` }));
}

function contentView(content) {
  if (typeof content === "string") return content;
  if (content === null || content === undefined) return "";
  if (!Array.isArray(content)) return JSON.stringify(content, null, 1);
  return content.map((part) => {
    const url = part && part.image_url && (typeof part.image_url === "string" ? part.image_url : part.image_url.url);
    if (typeof url === "string" && url.startsWith(IMAGE_REF)) return imageView(url.slice(IMAGE_REF.length));
    if (part && part.type === "text") return part.text;
    return JSON.stringify(part, null, 1);
  });
}

function messageView(message, cls) {
  const role = message.role || "?";
  const content = contentView(message.content);
  const calls = (message.tool_calls || []).map((c) => el("div", { class: "toolcall" },
    `${(c.function && c.function.name) || c.type}(${(c.function && c.function.arguments) || ""})`));
  return el("div", { class: `msg ${cls || ""}` }, el("div", { class: "role" }, role,
    message.tool_call_id ? el("div", { class: "muted mono" }, message.tool_call_id) : null),
  el("div", {}, el("div", { class: "content" }, content), calls));
}

// "policy v3" ("planner v3" for a run of several policies: the one the call asked for), or for
// a call that went on across weight loads (partial rollout) each version and the response
// token it took over at: "policy v3 → v4 at token 17".
function versionsText(call) {
  const name = call.policy || "policy";
  const spans = call.version_spans || [];
  if (spans.length < 2) return `${name} v${fmt(call.policy_version)}`;
  return `${name} ` + spans.map(([start, version], i) => i ? `v${version} at token ${start}` : `v${version}`).join(" → ");
}

function callView(call, index) {
  const meta = [
    `call ${index + 1}`, `attempt ${call.attempt_id}`, versionsText(call),
    `${call.mode || ""} ${call.endpoint || ""}${call.api ? ` (via ${call.api})` : ""}`, `latency ${secs(call.latency_s)}`,
    `${call.n_prompt_tokens} prompt + ${call.n_response_tokens} response tokens`,
    call.finish_reason ? `finish: ${call.finish_reason}` : null, call.status_code !== 200 ? `HTTP ${call.status_code}` : null,
  ].filter(Boolean);
  const body = [];
  if (call.messages) body.push(...call.messages.map((m) => messageView(m)));
  else if (call.prompt !== null && call.prompt !== undefined) body.push(messageView({ role: "prompt", content: call.prompt }));
  if (call.response_message) body.push(messageView(call.response_message, "response"));
  else if (call.response_text !== null && call.response_text !== undefined) {
    body.push(messageView({ role: "completion", content: call.response_text }, "response"));
  }
  if (call.error) body.push(el("div", { class: "error" }, JSON.stringify(call.error)));
  const reward = call.reward === null || call.reward === undefined ? null
    : el("span", { class: "reward-marker", title: "the rewards posted for this turn" }, `reward ${fmt(call.reward)}`);
  const images = (call.images || []).length ? el("div", { class: "call-images", title: "the images of this turn, in prompt order" },
    call.images.map((i) => el("figure", {}, imageView(i.sha256, `${i.media_type} ${i.width}x${i.height}, ${i.bytes} bytes`),
      el("figcaption", { class: "muted mono" }, `${i.width}x${i.height}`)))) : null;
  return el("div", { class: "card call", dataset: { call: call.event_id } },
    el("div", { class: "meta" }, meta.map((m) => el("span", {}, m)), reward), images, body,
    call.tools ? el("details", {}, el("summary", {}, "tools offered"), el("pre", { class: "json" }, JSON.stringify(call.tools, null, 1))) : null,
    el("details", {}, el("summary", {}, "request parameters"), el("pre", { class: "json" }, JSON.stringify(call.params, null, 1))));
}

function tokenView(sample, index) {
  const tokens = el("div", { class: "tokens", dataset: { sample: index } });
  let lastVersion = null;
  for (const tok of sample.tokens) {
    if (tok.mask && tok.version !== lastVersion) {
      tokens.append(el("span", { class: "vbadge", title: "policy version that sampled the tokens that follow" }, `v${tok.version}`));
      lastVersion = tok.version;
    }
    if (!tok.mask) lastVersion = null;
    const text = tok.text === null ? `⟨${tok.id}⟩` : tok.text;
    const tip = [`token ${tok.id} ${JSON.stringify(tok.text)}`, tok.mask ? "trained (loss mask 1)" : "context (loss mask 0)",
      tok.mask ? `engine logprob ${fmt(tok.logprob, 4)}` : null,
      tok.mask ? `trainer logprob ${sample.trainer_logprobs ? fmt(sample.trainer_logprobs[index], 4) : "not recorded"}` : null,
      tok.mask ? `policy version ${fmt(tok.version)}` : null].filter(Boolean).join("\n");
    tokens.append(withTip(el("span", { class: `tok ${tok.mask ? "trained" : "context"}`,
      dataset: { mask: tok.mask, logprob: tok.logprob === null ? "" : tok.logprob, version: tok.version === null ? "" : tok.version } }, text), tip));
  }
  const logprobs = sample.tokens.filter((t) => t.mask && t.logprob !== null).map((t) => t.logprob);
  const mean = logprobs.length ? logprobs.reduce((a, b) => a + b, 0) / logprobs.length : null;
  return el("div", { class: "card", style: "margin-bottom:10px" },
    el("div", { class: "facts" },
      el("div", {}, el("b", {}, "sample"), index + 1),
      sample.policy ? el("div", {}, el("b", {}, "policy"), sample.policy) : null,
      el("div", {}, el("b", {}, "tokens"), `${sample.n_tokens} (${sample.n_loss_tokens} trained)`),
      el("div", {}, el("b", {}, "reward"), fmt(sample.reward)),
      el("div", {}, el("b", {}, "advantage"), fmt(sample.advantage)),
      el("div", {}, el("b", {}, "mean engine logprob"), fmt(mean, 3)),
      el("div", {}, el("b", {}, "trainer logprobs"), sample.trainer_logprobs ? "recorded" : "not recorded")),
    el("div", { class: "legendrow" },
      el("span", {}, el("span", { class: "swatch", style: "background:var(--trained);box-shadow:inset 0 -2px 0 var(--trained-edge)" }), "trained (loss mask 1)"),
      el("span", {}, el("span", { class: "swatch", style: "background:var(--context)" }), "prompt / tool output (mask 0)"),
      el("span", {}, el("span", { class: "vbadge" }, "v3"), "policy version that sampled them"),
      el("span", {}, "hover a token for its id and logprobs")),
    tokens);
}

async function viewRollout(rolloutId) {
  const r = await api(`api/rollouts/${encodeURIComponent(rolloutId)}`);
  state.pending = r.siblings.some((s) => !s.terminal);
  const attempts = el("table", { id: "attempts" }, el("tr", {}, ["attempt", "state", "started", "ran", "error"].map((h) => el("th", {}, h))),
    r.attempts.map((a) => el("tr", {}, el("td", { class: "mono" }, a.attempt_id), el("td", {}, stateBadge({ state: a.state })),
      el("td", {}, new Date(a.started_at * 1000).toLocaleTimeString()), el("td", { class: "num" }, secs(a.duration_s)),
      el("td", { class: a.error_message ? "error" : "" }, a.error_message || ""))));
  const events = r.events.length ? el("table", { id: "events" }, el("tr", {}, ["event", "attempt", "data"].map((h) => el("th", {}, h))),
    r.events.map((e) => el("tr", {}, el("td", {}, e.event_type), el("td", { class: "mono" }, e.attempt_id),
      el("td", { class: "mono" }, JSON.stringify(e.data))))) : el("p", { class: "muted" }, "none");
  return el("div", {},
    el("h2", {}, "Rollout ", el("span", { class: "mono" }, r.rollout_id)),
    el("div", { class: "card facts" },
      el("div", {}, el("b", {}, "state"), stateBadge(r)),
      el("div", {}, el("b", {}, "mode"), r.mode),
      el("div", {}, el("b", {}, "group"), el("a", { class: "mono", href: `#/group/${encodeURIComponent(r.group)}` }, r.group)),
      el("div", {}, el("b", {}, r.mode === "val" ? "after step" : "enqueued by step"), fmt(r.step)),
      el("div", {}, el("b", {}, "reward"), el("span", { id: "reward" }, fmt(r.reward))),
      el("div", {}, el("b", {}, "advantage"), el("span", { id: "advantage" }, advantageText(r))),
      el("div", {}, el("b", {}, "queued"), secs(r.queue_s)),
      el("div", {}, el("b", {}, "ran"), secs(r.run_s)),
      r.error ? el("div", {}, el("b", {}, "error"), el("span", { class: "error" }, r.error)) : null),
    el("h3", {}, "Group siblings"), siblingCards(r.siblings, r.rollout_id),
    el("h3", {}, "Input"), el("pre", { class: "json card" }, JSON.stringify(r.input, null, 1)),
    el("h3", {}, "Attempts"), attempts,
    el("h2", {}, `Model calls (${r.calls.length})`),
    el("div", { id: "calls" }, r.calls.length ? r.calls.map(callView) : el("p", { class: "muted" }, "no recorded call")),
    el("h2", {}, "Trained sequence"),
    el("p", { class: "muted" }, `built from attempt ${r.trained_attempt || "—"}'s calls by the trainer's own build_samples; tokenizer: ${r.tokenizer}`),
    el("div", { id: "samples" }, r.samples.length ? r.samples.map(tokenView) : el("p", { class: "muted" }, "no trained tokens")),
    el("h3", {}, "Other events"), events);
}

// -- the loop ----------------------------------------------------------------------------

async function refreshMetrics() {
  const data = await api(`api/metrics?since=${state.metrics.length}`);
  if (data.total < state.metrics.length) {
    state.metrics = (await api("api/metrics")).rows;  // the file was replaced
  } else {
    state.metrics = state.metrics.concat(data.rows);
  }
}

async function render() {
  const route = parseRoute();
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active",
    a.dataset.nav === route.name || (a.dataset.nav === "rollouts" && ["rollout", "group"].includes(route.name))));
  const main = document.getElementById("main");
  let view;
  state.pending = false;
  try {
    if (route.name === "timeline") view = await viewTimeline();
    else if (route.name === "rollouts") view = await viewRollouts(route.params);
    else if (route.name === "rollout") view = await viewRollout(route.arg);
    else if (route.name === "group") view = await viewGroup(route.arg);
    else view = viewOverview();
  } catch (error) {
    view = el("p", { class: "error" }, `could not load: ${error.message}`);
  }
  const scroll = window.scrollY;
  main.replaceChildren(view);
  window.scrollTo(0, scroll);
  document.body.dataset.route = route.name;
  document.body.dataset.rendered = String(Date.now());
}

async function tick(full) {
  if (state.refreshing) return;
  state.refreshing = true;
  try {
    if (!state.run) {
      state.run = await api("api/run");
      document.getElementById("run-name").textContent = state.run.name;
      document.title = `${state.run.name} · Rollover`;
    }
    const before = state.metrics.length;
    await refreshMetrics();
    state.lastUpdate = Date.now();
    // While live, redraw when metric rows arrive, and views of unfinished rollouts every tick.
    const route = parseRoute().name;
    const typing = document.activeElement && ["INPUT", "SELECT"].includes(document.activeElement.tagName);
    const moved = state.metrics.length !== before && ["overview", "timeline", "rollouts"].includes(route);
    if (full || (!typing && (moved || state.pending))) {
      await render();
    }
  } catch (error) {
    document.getElementById("main").replaceChildren(el("p", { class: "error" }, `could not load: ${error.message}`));
  } finally {
    state.refreshing = false;
  }
}

function showUpdated() {
  const ago = state.lastUpdate ? Math.round((Date.now() - state.lastUpdate) / 1000) : null;
  document.getElementById("updated").textContent = ago === null ? "" : `updated ${ago}s ago`;
}

window.addEventListener("hashchange", () => { hideTip(); render(); });
window.addEventListener("load", () => {
  tick(true);
  setInterval(() => { if (document.getElementById("auto-refresh").checked) tick(false); }, 5000);
  setInterval(showUpdated, 1000);
});
