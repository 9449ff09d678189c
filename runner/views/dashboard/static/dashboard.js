// grpo-run dashboard: builds both pages from the JSON the server answers, polling it with
// If-None-Match (a 304 costs nothing). Storage's text only ever goes in as textContent.
"use strict";

const POLL_MS = 5000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
const usd = (v) => (v === null || v === undefined ? "-" : "$" + Number(v).toFixed(4));
const num = (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(3));
function duration(s) {
  s = Math.round(s);
  if (s >= 3600) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
  if (s >= 60) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return s + "s";
}

function showError(text) {
  const p = document.getElementById("error");
  p.hidden = !text;
  p.textContent = text || "";
}

// Poll `url` forever; `draw(body)` when it changed. One request in flight at a time.
function poll(url, draw) {
  let etag = null;
  async function once() {
    try {
      const r = await fetch(url, { headers: etag ? { "If-None-Match": etag } : {} });
      if (r.status !== 304) {
        const body = await r.json();
        etag = r.headers.get("ETag");
        showError(body.error);
        draw(body);
      }
      document.getElementById("updated").textContent = "checked " + new Date().toLocaleTimeString();
    } catch (e) {
      showError("the dashboard server did not answer (" + e.message + ")");
    }
    setTimeout(once, POLL_MS);
  }
  once();
}

// --- the jobs list --------------------------------------------------------------------------------

function drawJobs(body) {
  if (body.jobs === null) return;                // storage did not answer: keep what is shown
  document.getElementById("storage").textContent = body.storage;
  const tbody = document.querySelector("#jobs tbody");
  tbody.replaceChildren();
  for (const j of body.jobs) {
    const tr = el("tr");
    tr.dataset.job = j.name;
    const link = el("a", j.name);
    link.href = "/job/" + encodeURIComponent(j.name);
    const name = el("td"); name.append(link);
    const phase = el("td"); phase.append(el("span", j.phase, "phase " + j.phase));
    if (j.error) phase.append(" ", el("span", j.error, "error"));
    tr.append(name, phase,
      el("td", j.maxSteps ? j.step + " / " + j.maxSteps : "-"),
      el("td", usd(j.costUSD) + (j.maxCostUSD ? " of " + usd(j.maxCostUSD) : "")),
      el("td", j.baseline == null ? "-" : num(j.baseline) + " \u2192 " + num(j.final)),
      el("td", j.engine || "-"),
      el("td", (j.nodes || []).join(", ") || "-"));
    tbody.append(tr);
  }
  document.getElementById("empty").hidden = body.jobs.length > 0;
}

// --- one job --------------------------------------------------------------------------------------

function drawSummary(page) {
  const r = page.row, dl = document.getElementById("summary");
  document.getElementById("name").textContent = r.name;
  const phase = document.getElementById("phase");
  phase.textContent = r.phase;
  phase.className = "phase " + r.phase;
  dl.replaceChildren();
  const rows = [["step", r.maxSteps ? r.step + " of " + r.maxSteps : r.step],
    ["spent", usd(page.spend.costUSD) + (page.spend.maxCostUSD ? " of the cap " + usd(page.spend.maxCostUSD) : " (no cap)")],
    ["estimated", estimated(page.spend)],
    ["projection", page.spend.projection || "-"],
    ["held-out", num(r.baseline) + " \u2192 " + num(r.final)],
    ["sampler", r.engine || "-"], ["model", page.spec.model || "-"]];
  if (r.message) rows.push(["message", r.message]);
  for (const [k, v] of rows) dl.append(el("dt", k), el("dd", v));
}

// What apply estimated before anything was spent, and the spend so far as a share of it.
function estimated(spend) {
  const e = spend.estimate;
  if (!e) return "not recorded (the job was applied by an earlier grpo-run)";
  if (e.costToCompletionUSD == null) {
    return "no cost: the job names no spec.gpu" + (e.stepSeconds ? "; " + num(e.stepSeconds) + " s a step" : "");
  }
  let text = usd(e.costToCompletionUSD) + " to completion on " + (e.gpus > 1 ? e.gpus + " × " : "") + e.gpu +
    " (" + e.steps + " steps of " + num(e.stepSeconds) + " s, at " + usd(e.usdPerHour) + "/h)";
  if (spend.costUSD != null && e.costToCompletionUSD > 0) {
    text += "; spent so far " + Math.round(100 * spend.costUSD / e.costToCompletionUSD) + "% of it";
  }
  return text;
}

function drawTimeline(page) {
  const ol = document.getElementById("timeline");
  ol.replaceChildren();
  const total = Math.max(page.row.maxSteps || 0, ...page.attempts.map((a) => a.toStep || 0), 1);
  for (const a of page.attempts) {
    const li = el("li");
    li.dataset.reason = a.reason || "";
    const from = a.fromStep || 0, to = a.toStep === null ? from : a.toStep;
    let text = "attempt " + a.id + " on " + a.node + ": steps " + from + " \u2192 " + to + ", " +
      (a.reason === "Preempted" && a.notice ? "Preempted (" + a.notice + ")" : a.reason || "ended");
    if (a.lostSeconds !== null) text += "; " + duration(a.lostSeconds) + " until the next attempt began";
    const cut = page.boundaries.find((b) => b.attempt === a.id);
    if (cut && cut.redone) text += ", which redid " + cut.redone + " step" + (cut.redone === 1 ? "" : "s");
    if (a.message) text += " \u2014 " + a.message;
    const bar = el("div", null, "bar"), span = el("span", null, a.reason || "running");
    span.style.left = (100 * from / total) + "%";
    span.style.width = Math.max(0.5, 100 * (to - from) / total) + "%";
    bar.append(span);
    li.append(el("div", text), bar);
    ol.append(li);
  }
  if (!page.attempts.length) ol.append(el("li", "no attempt yet (waiting for a node)"));
}

// Each chart: a title and its series (key, label, scale); drawn when some step recorded one.
const CHARTS = [
  ["mean reward (train, sampled; held-out)", [["rewardMean", "train reward", "y"], ["heldOut", "held-out", "y"]]],
  ["groups with identical rewards", [["solvedGroups", "solved", "y"], ["noSignalGroups", "no signal", "y"],
                                     ["identicalGroups", "identical", "y"]]],
  ["completion length (tokens), truncated fraction", [["completionLength", "tokens", "y"],
                                                      ["truncatedFraction", "truncated", "f"]]],
  ["token entropy (nats)", [["tokenEntropy", "entropy", "y"]]],
  ["gradient norm, KL, clip ratio", [["gradNorm", "gradient norm", "y"], ["kl", "KL", "k"], ["clipRatio", "clip ratio", "k"]]],
  ["log-prob mismatch (sampler vs update)", [["logprobMismatch", "mismatch", "y"]]],
  ["episodes: turns, tool errors", [["episodeTurns", "turns", "y"], ["toolErrorRate", "tool errors", "f"]]],
  ["spend (USD) by step", [["costUSD", "spent", "y"]]],
];
const COLORS = ["#3b75c4", "#d0503a", "#3a9a4a", "#9a5ac4"];
const charts = [];

function drawCharts(page) {
  const box = document.getElementById("charts");
  for (const c of charts) c.destroy();
  charts.length = 0;
  box.replaceChildren();
  const cols = Object.assign({}, page.steps);
  // the held-out evaluations beside the train steps: the baseline at step 0, the periodic ones, the final one
  const held = new Map(page.heldOut.map((e) => [e.step, e.meanReward]));
  if (page.row.baseline !== undefined && page.row.baseline !== null) held.set(0, page.row.baseline);
  if (page.row.final !== undefined && page.row.final !== null)
    held.set(Math.max(0, ...(cols.step || [0])), page.row.final);
  const xs = Array.from(new Set([...(cols.step || []), ...held.keys()])).sort((a, b) => a - b);
  const at = new Map((cols.step || []).map((s, i) => [s, i]));
  const column = (key) => key === "heldOut" ? xs.map((x) => (held.has(x) ? held.get(x) : null))
    : cols[key] ? xs.map((x) => (at.has(x) ? cols[key][at.get(x)] : null)) : null;
  for (const [title, series] of CHARTS) {
    const drawn = series.map(([key, label, scale]) => [column(key), label, scale, key]).filter(([c]) => c && c.some((v) => v !== null));
    if (!drawn.length) continue;
    const div = el("div", null, "chart");
    div.dataset.chart = drawn.map((d) => d[3]).join(" ");
    div.append(el("h3", title));
    box.append(div);
    const scales = [...new Set(drawn.map((d) => d[2]))];
    const marks = page.boundaries.map((b) => b.step);
    const opts = {
      width: 560, height: 220,
      scales: { x: { time: false } },
      series: [{ label: "step" }, ...drawn.map(([, label, scale], i) => ({
        label, scale, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
        points: { show: label === "held-out" || xs.length < 40 } }))],
      axes: [{ label: "step" }, { scale: scales[0] }, ...(scales[1] ? [{ scale: scales[1], side: 1, grid: { show: false } }] : [])],
      hooks: { draw: [(u) => {                 // where an attempt ended: a dashed line at its last step
        const ctx = u.ctx;
        ctx.save(); ctx.strokeStyle = "#e0a23a"; ctx.setLineDash([4, 4]);
        for (const s of marks) {
          const x = u.valToPos(s, "x", true);
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        }
        ctx.restore();
      }] },
    };
    charts.push(new uPlot(opts, [xs, ...drawn.map((d) => d[0])], div));
  }
  if (!box.children.length) box.append(el("p", "no steps yet"));
}

function drawSamples(page) {
  const box = document.getElementById("samples");
  box.replaceChildren();
  const names = { step: "the newest training step's kept groups", final: "final evaluation", baseline: "baseline evaluation" };
  for (const kind of ["step", "final", "baseline"]) {
    const rows = page.samples[kind];
    if (!rows || !rows.length) continue;
    box.append(el("h3", names[kind] + (kind === "step" ? " (step " + rows[0].step + ")" : "")));
    for (const r of rows.slice(0, 24)) {
      const d = el("div", null, "sample");
      const rewards = Object.entries(r.rewards || {}).map(([k, v]) => k + " " + num(v)).join(", ");
      d.append(el("div", (r.group ? "group " + r.group : "task " + r.task) + ": reward " + num(r.reward) +
        (rewards ? " (" + rewards + ")" : "") + (r.mark ? " \u2014 " + r.mark : "") + (r.truncated ? ", truncated" : ""), "turn"));
      d.append(el("pre", r.prompt));
      if (r.exchange) {
        for (const t of r.exchange) {
          d.append(el("div", t.from === "model" ? "reply " + t.turn + (t.toolCall ? " (tool call)" : "") : t.from, "turn"));
          d.append(el("pre", t.text));
        }
      } else {
        d.append(el("pre", r.completion));
      }
      box.append(d);
    }
  }
  if (!box.children.length) box.append(el("p", "no samples kept yet"));
}

function drawLog(page) {
  document.getElementById("log-section").hidden = !page.log;
  if (page.log) document.getElementById("log").textContent = page.log.text;
}

function drawJob(page) {
  if (!page.row || !page.attempts) return;       // storage did not answer: keep what is shown
  drawSummary(page); drawTimeline(page); drawCharts(page); drawSamples(page); drawLog(page);
}

document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.page === "jobs") {
    poll("/api/jobs", drawJobs);
  } else {
    const name = decodeURIComponent(location.pathname.split("/").pop());
    document.title = name + " \u2014 grpo-run";
    poll("/api/jobs/" + encodeURIComponent(name), drawJob);
  }
});
