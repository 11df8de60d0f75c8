// rollgym view: one page, routed by the URL hash. Every text from a rollout goes in via textContent.
"use strict";

const REFRESH_MS = 4000; // re-read the files while a run is still being written
const main = document.getElementById("main");
let timer = null;
let charts = [];
let shown = null; // what the current page was drawn from: a refresh that brings the same is not redrawn

// --- small DOM helpers -------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–"
  : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v));
const figure = (label, value) => el("div", { class: "figure" }, el("b", { text: value }), el("span", { text: label }));
const statusBadge = (s) => el("span", { class: `status ${s}`, text: s });

async function api(path) {
  const response = await fetch(path, { headers: { accept: "application/json" } });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.error && body.error.message) || `${response.status} ${path}`);
  return body;
}

function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren();
  parts.forEach(([label, href], i) => {
    if (i) nav.append(el("span", { class: "sep", text: "›" }));
    nav.append(href ? el("a", { href, text: label }) : el("span", { text: label }));
  });
}

function showError(error) {
  main.replaceChildren(el("p", { class: "error", text: `could not load: ${error.message}` }));
}

// --- charts (uPlot) ----------------------------------------------------------------------------
function chartBox(title, width = 400, height = 200) {
  const box = el("div", { class: "chart", "data-chart": title }, el("div", { class: "title", text: title }));
  return { box, width, height };
}

function barChart(target, title, edges, counts, xLabel) {
  const { box, width, height } = chartBox(title);
  target.append(box);
  if (!counts.length) { box.append(el("p", { class: "muted", text: "no values yet" })); return; }
  const mids = counts.map((_, i) => (edges[i] + edges[i + 1]) / 2);
  const step = edges[1] - edges[0];
  charts.push(new uPlot({
    width, height, legend: { show: false },
    scales: { x: { time: false, range: [edges[0] - step / 2, edges[edges.length - 1] + step / 2] } },
    axes: [{ label: xLabel }, { label: "rollouts", size: 56, values: (u, ticks) => ticks.map((v) => COMPACT.format(v)) }],
    series: [{}, { label: "rollouts", fill: "rgba(47,111,219,0.45)", stroke: "#2f6fdb",
                   paths: uPlot.paths.bars({ size: [0.9, Infinity] }), points: { show: false } }],
  }, [mids, counts], box));
}

const COMPACT = new Intl.NumberFormat("en", { notation: "compact" }); // 600K, not 600,000 over the axis label
const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];
const PALETTE = ["#2f6fdb", "#2e9d57", "#d98b2b", "#b06ad9", "#c23b3b", "#3aa6b9", "#7a828c"];
function lineChart(target, title, xs, named, xLabel, yLabel, yRange) {
  const { box, width, height } = chartBox(title, 420, 220);
  target.append(box);
  const names = Object.keys(named);
  if (!xs.length || !names.length) { box.append(el("p", { class: "muted", text: "no values yet" })); return; }
  charts.push(new uPlot({
    width, height, legend: { show: names.length > 1 }, scales: { x: { time: false }, ...(yRange ? { y: { range: yRange } } : {}) },
    axes: [{ label: xLabel, incrs: INTEGER_STEPS }, { label: yLabel }], // epochs and k are whole numbers
    series: [{ label: xLabel }, ...names.map((name, i) => ({
      label: name, stroke: PALETTE[i % PALETTE.length], width: 2, points: { show: true, size: 6 }, spanGaps: true }))],
  }, [xs, ...names.map((n) => named[n])], box));
}

// --- pages -------------------------------------------------------------------------------------
function unchanged(refreshing, data) {
  const signature = JSON.stringify(data);
  const same = refreshing && signature === shown;
  shown = signature;
  return same;
}

async function pageRuns(refreshing) {
  crumbs(["runs", null]);
  const data = await api("api/runs");
  if (unchanged(refreshing, data)) return;
  const parts = [];
  for (const run of data.runs) {
    const card = el("div", { class: "card run", "data-run": run.id });
    card.append(el("h2", {}, el("a", { href: `#/run/${run.id}`, text: run.label })));
    const passes = Object.entries(run.pass_at_k).map(([k, v]) => figure(`${k} (reward ≥ ${run.pass_threshold})`, fmt(v)));
    card.append(el("div", { class: "figures" },
      figure("rollouts", fmt(run.rollouts)), figure("groups", fmt(run.groups)),
      figure("mean reward", fmt(run.mean_reward)), figure("reward std", fmt(run.reward_std)), ...passes,
      figure("failed attempts", fmt(run.failed)),
      run.metrics_file && run.metrics_file.failed !== undefined ? figure("failed rollouts (metrics.json)", fmt(run.metrics_file.failed)) : null, figure("tokens / rollout (in / out)", `${fmt(run.tokens.input_mean, 0)} / ${fmt(run.tokens.output_mean, 0)}`),
      figure("latency p50 / p95 / p99 (s)", ["p50", "p95", "p99"].map((q) => fmt(run.latency_s[q], 2)).join(" / "))));
    const statuses = Object.entries(run.status_counts).map(([s, n]) => el("span", {}, statusBadge(s), ` ${n}  `));
    const failed = Object.entries(run.failure_status_counts).map(([s, n]) => el("span", {}, statusBadge(s), ` ${n}  `));
    card.append(el("div", {}, el("span", { class: "muted", text: "statuses: " }), statuses,
      failed.length ? el("span", { class: "muted", text: "  failures: " }) : null, failed));
    if (run.environments.length) card.append(el("div", { class: "muted", text: `environments: ${run.environments.join(", ")}` }));
    if (run.model_versions.length) card.append(el("div", { class: "muted", text: `model versions: ${run.model_versions.join(", ")}` }));
    if (!run.indexed_complete) card.append(el("div", { class: "muted", text: "indexing… (figures so far)" }));
    if (run.bad_lines) card.append(el("div", { class: "error", text: `${run.bad_lines} line(s) are not JSON rollouts (skipped)` }));
    const chartRow = el("div", { class: "charts" });
    card.append(chartRow);
    parts.push([card, run, chartRow]);
  }
  const trainingCards = data.trainings.map((t) => el("div", { class: "card training", "data-training": t.id },
    el("h2", {}, el("a", { href: `#/training/${t.id}`, text: `training: ${t.label}` }))));
  const evalCards = (data.evaluations || []).map((e) => el("div", { class: "card evaluation", "data-evaluation": e.id },
    el("h2", {}, el("a", { href: `#/eval/${e.id}`, text: `evaluation: ${e.label}` }))));
  destroyCharts();
  main.replaceChildren(...evalCards, ...trainingCards, ...parts.map(([card]) => card));
  if (!data.runs.length && !data.trainings.length) main.append(el("p", { class: "muted", text: "nothing to show" }));
  for (const [, run, chartRow] of parts) {
    const c = await api(`api/runs/${run.id}/charts`);
    barChart(chartRow, "reward histogram", c.reward.edges, c.reward.counts, "reward");
    const ks = Object.keys(run.pass_at_k);
    lineChart(chartRow, "pass@k", ks.map((k) => Number(k.slice(5))), { "pass@k": ks.map((k) => run.pass_at_k[k]) }, "k", "pass@k", [0, 1]);
    barChart(chartRow, "latency distribution", c.latency.edges, c.latency.counts, "latency (s)");
  }
  for (const t of data.trainings) {
    const card = trainingCards.find((c) => c.dataset.training === t.id);
    await renderTraining(card, t.id, true);
  }
  live(data.runs.some((r) => !r.indexed_complete) ? "indexing…" : "");
}

async function renderTraining(card, id, compact, fetched) {
  const t = fetched || await api(`api/trainings/${id}`);
  if (!compact) card.append(el("h2", { text: `training: ${t.label}` }));
  const h = t.history;
  const row = el("div", { class: "charts" });
  card.append(row);
  if (!h || !h.rows) {
    card.append(el("p", { class: "muted", text: "history.jsonl has no epochs yet" }));
  } else {
    const pick = (names) => Object.fromEntries(names.map((n) => [n, h.series[n]]));
    lineChart(row, "reward per epoch", h.x, pick(h.reward), "epoch", "reward");
    if (h.pass.length) lineChart(row, "pass@k per epoch", h.x, pick(h.pass), "epoch", "pass@k", [0, 1]);
    if (h.timings.length) lineChart(row, "phase timings per epoch", h.x, pick(h.timings), "epoch", "seconds");
    const fractions = h.trainer.filter((n) => n.endsWith("_fraction"));
    const optimizer = h.trainer.filter((n) => !fractions.includes(n));
    if (optimizer.length) lineChart(row, "trainer per step", h.x, pick(optimizer), "epoch", "value");
    if (fractions.length) lineChart(row, "clipped and masked tokens", h.x, pick(fractions), "epoch", "fraction", [0, 1]);
    if (!compact) {
      const texts = Object.keys(h.texts);
      const numbers = [...h.reward, ...h.pass, ...h.trainer, ...h.timings];
      const table = el("table", { class: "timings epochs" }, el("tr", {}, el("th", { text: "epoch" }),
        [...texts, ...numbers].map((n) => el("th", { text: n }))));
      h.x.forEach((x, i) => table.append(el("tr", {}, el("td", { class: "num", text: fmt(x) }),
        texts.map((n) => el("td", { text: fmt(h.texts[n][i]) })),
        numbers.map((n) => el("td", { class: "num", text: fmt(h.series[n][i], h.timings.includes(n) ? 2 : 3) })))));
      card.append(el("h3", { text: "epochs (history.jsonl)" }), el("div", { class: "scroll" }, table));
    }
    for (const bad of h.bad_lines) card.append(el("div", { class: "error", text: `history.jsonl ${bad}` }));
  }
  if (t.runs.length && !compact) card.append(el("h3", { text: "rollouts of its epochs" }), el("ul", {},
    t.runs.map((r) => el("li", {}, el("a", { href: `#/run/${r.id}`, text: r.label })))));
  if (t.plot && !compact) card.append(el("h3", { text: "reward.png" }),
    el("img", { class: "plot", src: `api/trainings/${id}/plot?t=${Date.now()}`, alt: "reward per epoch" }));
}

async function pageTraining(id, refreshing) {
  crumbs(["runs", "#/"], [`training ${id}`, null]);
  const t = await api(`api/trainings/${id}`);
  if (unchanged(refreshing, t)) return;
  const card = el("div", { class: "card training", "data-training": id });
  destroyCharts();
  main.replaceChildren(card);
  await renderTraining(card, id, false, t);
}

// --- an evaluation's report (rollgym eval): environments × models side by side, and the comparisons
const ci = (e) => !e ? "–" : (e.low === null ? (e.tasks < 2 ? "(1 task)" : "(no spread)") : `[${fmt(e.low)}, ${fmt(e.high)}]`);

async function pageEvaluation(id, refreshing) {
  crumbs(["runs", "#/"], [`evaluation ${id}`, null]);
  const data = await api(`api/evaluations/${id}`);
  if (unchanged(refreshing, data)) return;
  const report = data.report;
  const ks = [...new Set(report.environments.flatMap((e) => Object.values(e.results).flatMap((r) => Object.keys(r.pass_at_k))))]
    .sort((a, b) => Number(a.slice(5)) - Number(b.slice(5)));
  const table = el("table", { class: "evaluation" }, el("tr", {},
    ["environment", "model", "tasks", "rollouts", "failed", "mean reward", "95% CI", ...ks].map((h) => el("th", { text: h }))));
  for (const env of report.environments) {
    Object.entries(env.results).forEach(([label, r], i) => {
      const run = data.runs[`${env.name}/${label}`];
      const failed = Object.entries(r.failure_statuses).map(([s, n]) => el("span", {}, statusBadge(s), ` ${n} `));
      table.append(el("tr", {}, el("td", { text: i ? "" : env.name }),
        el("td", {}, run ? el("a", { href: `#/run/${run}`, text: label }) : label),
        el("td", { class: "num", text: fmt(r.tasks_scored) }), el("td", { class: "num", text: fmt(r.rollouts) }),
        el("td", {}, String(r.failed), " ", failed, r.missing ? ` +${r.missing} missing` : ""),
        el("td", { class: "num", text: fmt(r.mean_reward && r.mean_reward.value) }), el("td", { text: ci(r.mean_reward) }),
        ks.map((k) => el("td", { class: "num", text: fmt(r.pass_at_k[k] && r.pass_at_k[k].value) }))));
    });
  }
  const card = el("div", { class: "card evaluation", "data-evaluation": id },
    el("h2", { text: `evaluation${report.suite ? " " + report.suite : ""}: ${data.label}` }),
    el("ul", {}, report.models.map((m) => el("li", {}, el("b", { text: m.label }), `: ${m.adapter || m.request_model} `,
      el("span", { class: "muted", text: `(${m.model_version || "version not reported"})` })))),
    el("div", { class: "scroll" }, table));
  for (const pair of report.comparisons) {
    const rows = Object.entries(pair.environments).map(([env, c]) => el("tr", {}, el("td", { text: env }),
      el("td", { class: "num", text: c ? (c.difference >= 0 ? "+" : "") + fmt(c.difference) : "–" }),
      el("td", { text: c && c.low !== null ? `[${fmt(c.low)}, ${fmt(c.high)}]` : "–" }),
      el("td", { class: "num", text: c ? fmt(c.p_value) : "–" }),
      el("td", { class: c && c.beyond_noise ? "beyond" : "muted",
        text: !c ? "no shared task" : c.beyond_noise === null ? "too few tasks" : c.beyond_noise ? "beyond noise" : "within noise" })));
    card.append(el("h3", { text: `${pair.b} − ${pair.a}, paired over tasks` }), el("table", { class: "comparison" },
      el("tr", {}, ["environment", "difference", "95% CI", "p", ""].map((h) => el("th", { text: h }))), rows));
  }
  card.append(el("p", { class: "muted", text: `mean reward: ${report.method.mean_reward}; differences: ${report.method.comparison}; ${report.method.failures}` }));
  destroyCharts();
  main.replaceChildren(card);
  live("");
}

const COLUMNS = [
  ["line", "#", "line"], ["rollout_id", "rollout", null], ["group_id", "group", "group"], ["env", "environment", null],
  ["reward", "reward", "reward"], ["status", "status", "status"], ["prefix_ok", "prefix", null],
  ["model_version", "version", null], ["turns", "turns", "turns"], ["tool_calls", "tools", null],
  ["output_tokens", "out tok", "output_tokens"], ["latency_s", "latency s", "latency"], ["answer", "answer / error", null],
];

async function pageRollouts(runId, params, refreshing) {
  crumbs(["runs", "#/"], [runId, null]);
  const query = new URLSearchParams(params);
  if (!query.get("limit")) query.set("limit", "50");
  const data = await api(`api/runs/${runId}/rollouts?${query}`);
  const failures = await api(`api/runs/${runId}/failures?limit=50`);
  if (unchanged(refreshing, [data, failures])) return;
  const form = filterForm(runId, query, data.choices);
  const table = el("table", { class: "rollouts" });
  const sort = query.get("sort") || "line";
  const desc = query.get("desc") === "true";
  // environment and model version only when some rollout has one
  const columns = COLUMNS.filter(([field]) => (field !== "env" || data.choices.env.length) &&
                                              (field !== "model_version" || data.choices.version.length));
  table.append(el("tr", {}, columns.map(([, label, key]) => {
    const th = el("th", { class: key ? `sortable${key === sort ? " sorted" : ""}` : null,
                          text: label + (key === sort ? (desc ? " ▼" : " ▲") : "") });
    if (key) th.addEventListener("click", () => {
      query.set("sort", key); query.set("desc", key === sort ? String(!desc) : "false"); query.set("offset", "0");
      location.hash = `#/run/${runId}?${query}`;
    });
    return th;
  })));
  for (const row of data.rows) {
    const tr = el("tr", { class: "rollout", "data-line": row.line,
                          onclick: () => { location.hash = `#/run/${runId}/rollout/${row.line}`; } });
    for (const [field] of columns) {
      let cell;
      if (field === "status") cell = el("td", {}, statusBadge(row.status));
      else if (field === "group_id") cell = el("td", {}, el("a", { href: `#/run/${runId}/group/${encodeURIComponent(row.group_id)}`,
        text: row.group_id, onclick: (e) => e.stopPropagation() }));
      else if (field === "answer") cell = el("td", { class: row.error ? "answer error" : "answer", text: row.error || row.answer });
      else if (field === "line") cell = el("td", { class: "num", text: row.line + 1 });
      else if (field === "prefix_ok") cell = el("td", { text: row.prefix_ok === null || row.prefix_ok === undefined ? "–" : row.prefix_ok ? "ok" : "broken" });
      else cell = el("td", { class: typeof row[field] === "number" ? "num" : null, text: fmt(row[field]) });
      tr.append(cell);
    }
    table.append(tr);
  }
  const offset = Number(query.get("offset") || 0), limit = Number(query.get("limit"));
  const move = (to) => { query.set("offset", String(Math.max(0, to))); location.hash = `#/run/${runId}?${query}`; };
  const pager = () => el("div", { class: "pager" },
    el("button", { onclick: () => move(offset - limit), disabled: offset === 0 ? "disabled" : null, text: "‹ previous" }),
    el("span", { class: "count", text: (offset < data.total ? `${offset + 1}–${Math.min(offset + limit, data.total)}`
      : `none past ${data.total}`) + ` of ${data.total}` +
      (data.complete ? "" : ` (indexed ${data.indexed} lines so far)`) }),
    el("button", { onclick: () => move(offset + limit), disabled: offset + limit >= data.total ? "disabled" : null, text: "next ›" }));
  const failureTable = el("table", { class: "failures" },
    el("tr", {}, ["rollout", "group", "attempt", "final", "status", "cause"].map((h) => el("th", { text: h }))),
    failures.rows.map((f) => el("tr", {}, el("td", { text: fmt(f.rollout_id) }), el("td", { text: fmt(f.group_id) }),
      el("td", { class: "num", text: fmt(f.attempt) }), el("td", { text: f.final ? "yes" : "retried" }),
      el("td", {}, statusBadge(f.status || "?")), el("td", { class: "error", text: fmt(f.error) }))));
  const bad = data.bad_lines.map((b) => el("div", { class: "error", text: `line ${b.line}: ${b.message}` }));
  destroyCharts();
  main.replaceChildren(form, pager(), table, pager(), ...bad,
    el("h2", { text: `failures (${failures.total} attempts; never counted as reward)` }),
    failures.total ? failureTable : el("p", { class: "muted", text: "none" }));
  live(data.complete ? "" : "indexing…");
}

function filterForm(runId, query, choices) {
  const select = (name, values, label) => el("label", {}, label, el("select", { name },
    el("option", { value: "", text: "any" }),
    values.map((v) => el("option", { value: v, text: v, selected: query.getAll(name).includes(v) ? "selected" : null }))));
  const input = (name, label, attrs) => el("label", {}, label, el("input", { name, value: query.get(name) || "", ...attrs }));
  const form = el("form", { class: "filters" },
    select("status", choices.status, "status"),
    input("reward_min", "reward ≥", { type: "number", step: "any" }),
    input("reward_max", "reward ≤", { type: "number", step: "any" }),
    input("group", "group", { type: "text" }),
    choices.env.length ? select("env", choices.env, "environment / agent") : null,
    select("prefix_ok", ["true", "false", "none"], "prefix ok"),
    choices.version.length ? select("version", choices.version, "model version") : null,
    el("button", { type: "submit", text: "filter" }),
    el("a", { href: `#/run/${runId}`, text: "clear" }));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [key, value] of new FormData(form)) if (value !== "") next.append(key, value);
    for (const key of ["sort", "desc", "limit"]) if (query.get(key)) next.set(key, query.get(key));
    location.hash = `#/run/${runId}?${next}`;
  });
  return form;
}

// --- one rollout -------------------------------------------------------------------------------
function textOf(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && (p.text ?? p.refusal)) || "").join("");
  return content === null || content === undefined ? "" : JSON.stringify(content);
}

function prettyJson(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return String(text); }
}

function message(kind, label, body, extra) {
  return el("div", { class: `msg ${kind}` }, el("div", { class: "role" }, label, extra || null), body);
}

function conversation(row) {
  const box = el("div", { class: "conversation" });
  const params = row.responses_create_params || {};
  if (params.instructions) box.append(message("system", "instructions", el("pre", { text: params.instructions })));
  const input = typeof params.input === "string" ? [{ role: "user", content: params.input }]
    : Array.isArray(params.input) ? params.input : [];
  // A rollouts file's line has its output items at the top (`output`); /run's answer, and older lines, in `response`
  const output = Array.isArray(row.output) ? row.output
    : row.response && Array.isArray(row.response.output) ? row.response.output : [];
  for (const item of [...input, ...output]) box.append(renderItem(item && typeof item === "object" ? item : { type: "unknown", value: item }));
  return box;
}

// A rollout of several segments (sub-agents, a rewritten history): each segment under its own heading, each
// model call of it with the input items it sent (a continuing call: those it added) and what came back.
function segmentedConversation(view) {
  const box = el("div", { class: "conversation segmented" });
  view.segments.forEach((segment) => {
    const conversation = segment.conversation === null || segment.conversation === undefined ? "" : ` · conversation ${segment.conversation}`;
    const why = segment.index && segment.reason_text ? ` · began: ${segment.reason_text}` : "";
    const part = el("section", { class: "conv-segment" },
      el("div", { class: segment.index ? "segment" : "segment first", text: `segment ${segment.index + 1}${conversation}${why}` }));
    segment.calls.forEach((call, c) => {
      part.append(el("div", { class: "call-head muted", text: `model call ${c + 1} of ${segment.calls.length}: ${call.input.length} input item(s), ${call.output.length} output item(s)` }));
      const input = el("div", { class: "call-input" });
      for (const item of call.input) input.append(renderItem(item && typeof item === "object" ? item : { type: "unknown", value: item }));
      const output = el("div", { class: "call-output" });
      for (const item of call.output) output.append(renderItem(item && typeof item === "object" ? item : { type: "unknown", value: item }));
      part.append(input, output);
    });
    box.append(part);
  });
  return box;
}

function renderItem(item) {
  const version = item.model_version ? el("span", { class: "muted", text: `  · ${item.model_version}` }) : null;
  const type = item.type || (item.role ? "message" : "unknown");
  if (type === "message") {
    const role = item.role || "assistant";
    return message(role === "developer" ? "system" : role, role, el("pre", { text: textOf(item.content) }), version);
  }
  if (type === "function_call") {
    return message("tool_call", "tool call", el("div", {},
      el("span", { class: "tool-name", text: item.name }), el("span", { class: "muted", text: `  ${item.call_id || ""}` }),
      el("pre", { class: "arguments", text: prettyJson(item.arguments) })), version);
  }
  if (type === "function_call_output") {
    return message("tool_output", "tool output", el("div", {},
      el("span", { class: "muted", text: item.call_id || "" }), el("pre", { text: textOf(item.output) })));
  }
  if (type === "reasoning") {
    const text = [...(item.summary || []), ...(item.content || [])].map((p) => p.text || "").join("\n");
    return message("reasoning", "reasoning", el("pre", { text }), version);
  }
  return message("system", type, el("pre", { class: "json", text: JSON.stringify(item, null, 2) }));
}

// probability → colour: red (unlikely) through yellow to green (certain)
function tokenColour(logprob) {
  const p = Math.exp(Math.max(-20, Math.min(0, logprob)));
  return `hsl(${Math.round(120 * p)}, 75%, 80%)`;
}

function visible(piece) {
  return piece.replace(/\n/g, "↵\n").replace(/\t/g, "→");
}

function tokenSequences(tokens) {
  const box = el("div", { class: "token-view" });
  box.append(el("div", { class: "legend" }, "sampling probability:",
    el("span", { class: "swatch", style: `background:${tokenColour(Math.log(0.02))}` }), "low",
    el("span", { class: "swatch", style: `background:${tokenColour(Math.log(0.5))}` }), "0.5",
    el("span", { class: "swatch", style: `background:${tokenColour(0)}` }), "1",
    el("span", { class: "tok env", text: " environment (mask 0) " }), el("span", { class: "turn", text: "turn" }), "model turn starts"));
  if (tokens.note) box.append(el("p", { class: "muted", text: tokens.note }));
  const several = tokens.sequences.length > 1;
  tokens.sequences.forEach((seq, s) => {
    const name = several ? `segment ${s + 1}` : "sequence 1";
    if (several) box.append(segmentStart(seq.start || {}, name));
    const prompt = el("details", {}, el("summary", { text: `${name}: prompt, ${seq.prompt_ids.length} tokens` }),
      el("div", { class: "tokens" }, seq.prompt_ids.map((id, i) => el("span", { class: "tok prompt", title: `id ${id}`,
        text: seq.prompt_text ? visible(seq.prompt_text[i]) : `${id} ` }))));
    const starts = new Set(seq.turn_starts);
    let turn = 0;
    const completion = el("div", { class: "tokens completion" });
    seq.completion_ids.forEach((id, i) => {
      if (starts.has(i)) {
        const version = seq.model_versions && seq.model_versions[turn] ? ` ${seq.model_versions[turn]}` : "";
        completion.append(el("span", { class: "turn", text: `turn ${++turn}${version}` }));
      }
      const sampled = seq.mask[i] === 1;
      const piece = seq.completion_text ? visible(seq.completion_text[i]) : `${id} `;
      const logprob = seq.logprobs[i];
      completion.append(el("span", {
        class: sampled ? "tok sampled" : "tok env",
        style: sampled && typeof logprob === "number" ? `background:${tokenColour(logprob)}` : null,
        title: sampled ? `id ${id}  logprob ${fmt(logprob, 4)}  p ${fmt(Math.exp(logprob), 3)}` : `id ${id}  (environment)`,
        text: piece }));
    });
    box.append(prompt, el("h3", { text: `${name}: completion, ${seq.completion_ids.length} tokens` }), completion);
  });
  return box;
}

// Where a segment begins: its conversation, and why it is a new segment (the agent's label, what the tokens show)
function segmentStart(start, name) {
  const conversation = start.conversation === null || start.conversation === undefined ? "" : ` · conversation ${start.conversation}`;
  if (!start.index) return el("div", { class: "segment first", text: `${name}${conversation}` });
  const why = start.reason_text || start.tokens || "its prompt did not extend the tokens above";
  const box = el("div", { class: "segment" }, el("div", { class: "segment-head", text: `${name}${conversation} began: ${why}` }));
  if (start.reason_text && start.tokens) box.append(el("div", { class: "muted", text: `tokens: ${start.tokens}` }));
  if (start.divergence) box.append(el("pre", { class: "divergence",
    text: `at token ${start.divergence.index}\nabove: ${start.divergence.above}\nthis:  ${start.divergence.this}` }));
  return box;
}

async function pageRollout(runId, line) {
  crumbs(["runs", "#/"], [runId, `#/run/${runId}`], [`line ${Number(line) + 1}`, null]);
  const data = await api(`api/runs/${runId}/rollouts/${line}`);
  const row = data.rollout;
  const known = new Set(["responses_create_params", "response", "reward", "reward_components", "status", "error",
    "metrics", "sequences", "prefix_ok", "rollout_id", "group_id", "output"]);
  const details = Object.fromEntries(Object.entries(row).filter(([k]) => !known.has(k)));
  const components = row.reward_components || {};
  const head = el("div", { class: "card" },
    el("h2", { text: `rollout ${row.rollout_id || ""}` }),
    el("div", { class: "figures" }, figure("reward", fmt(row.reward)), el("div", { class: "figure" }, statusBadge(row.status || "ok"), el("span", { text: "status" })),
      ...Object.entries(components).map(([k, v]) => figure(`component: ${k}`, fmt(v))),
      figure("prefix", row.prefix_ok === undefined || row.prefix_ok === null ? "–" : row.prefix_ok ? "ok" : "broken")),
    el("div", {}, el("span", { class: "muted", text: "group " }),
      el("a", { href: `#/run/${runId}/group/${encodeURIComponent(row.group_id)}`, text: row.group_id || "–" })),
    row.error ? el("pre", { class: "error", text: row.error }) : null,
    el("div", { class: "kv metrics" }, Object.entries(row.metrics || {}).flatMap(([k, v]) => [el("div", { text: k }), el("div", { text: fmt(v, 4) })])),
    el("details", {}, el("summary", { text: "task and environment fields" }), el("pre", { class: "json", text: JSON.stringify(details, null, 2) })));
  destroyCharts();
  const panel = data.conversation && data.conversation.segments ? segmentedConversation(data.conversation) : conversation(row);
  main.replaceChildren(head, el("h2", { text: "conversation" }), panel,
    el("h2", { text: "tokens" }), tokenSequences(data.tokens));
  live("");
}

async function pageGroup(runId, groupId) {
  crumbs(["runs", "#/"], [runId, `#/run/${runId}`], [`group ${groupId}`, null]);
  const g = await api(`api/runs/${runId}/groups/${encodeURIComponent(groupId)}`);
  const prompt = g.prompt ? conversation({ responses_create_params: g.prompt }) : null;
  const grid = el("div", { class: "group-grid" }, g.rollouts.map((r) => el("div", { class: "card member" },
    el("h3", {}, el("a", { href: `#/run/${runId}/rollout/${r.line}`, text: r.rollout_id || `line ${r.line + 1}` })),
    el("div", { class: "figures" }, figure("reward", fmt(r.reward)), figure("advantage", fmt(r.advantage)),
      figure("r − mean", fmt(r.advantage_mean_only)), figure("turns", fmt(r.turns)), figure("tool calls", fmt(r.tool_calls)),
      el("div", { class: "figure" }, statusBadge(r.status), el("span", { text: "status" }))),
    r.error ? el("pre", { class: "error", text: r.error }) : null,
    el("pre", { text: r.answer }))));
  destroyCharts();
  main.replaceChildren(el("div", { class: "card" }, el("h2", { text: `group ${g.group_id}` }),
    el("div", { class: "figures" }, figure("rollouts", g.rollouts.length), figure("mean reward", fmt(g.reward_mean)),
      figure("reward std", fmt(g.reward_std))),
    g.reward_std === 0 ? el("p", { class: "muted", text: "every rollout got the same reward: all advantages are 0, so GRPO learns nothing from this group (export drops it)" }) : null),
    el("h3", { text: "prompt" }), prompt, el("h3", { text: "rollouts" }), grid);
  live("");
}

// --- routing and live refresh ------------------------------------------------------------------
function destroyCharts() { charts.forEach((c) => c.destroy()); charts = []; }
function live(text) { document.getElementById("live").textContent = text; }

async function route(refreshing) {
  clearTimeout(timer);
  refreshing = refreshing === true;
  const hash = location.hash.slice(1) || "/";
  const [path, queryString] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  if (!refreshing) delete document.body.dataset.rendered;
  try {
    if (!parts.length) await pageRuns(refreshing);
    else if (parts[0] === "training") await pageTraining(parts[1], refreshing);
    else if (parts[0] === "eval") await pageEvaluation(parts[1], refreshing);
    else if (parts[0] === "run" && parts[2] === "rollout") await pageRollout(parts[1], parts[3]);
    else if (parts[0] === "run" && parts[2] === "group") await pageGroup(parts[1], parts[3]);
    else if (parts[0] === "run") await pageRollouts(parts[1], queryString || "", refreshing);
    else main.replaceChildren(el("p", { class: "error", text: `no page ${hash}` }));
  } catch (error) {
    showError(error);
  }
  document.body.dataset.rendered = "#" + hash; // tells a reader (or a test) the page is drawn
  // Lists, summaries and training curves follow files still being written; a rollout does not change.
  if (!parts.length || parts[0] === "training" || (parts[0] === "run" && parts.length === 2)) {
    const tick = () => {
      if (document.hidden || document.activeElement.closest("form")) timer = setTimeout(tick, REFRESH_MS);
      else route(true);
    };
    timer = setTimeout(tick, REFRESH_MS);
  }
}

window.addEventListener("hashchange", () => route(false));
route(false);
