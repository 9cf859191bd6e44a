"use strict";
// otray dashboard: polls the JSON API of the Gateway every 2 s. No libraries.
const state = { key: localStorage.getItem("otray-key") || "", selected: null, step: null, auth: false };
// metric names as the server defines them (otray/metric_keys.py), from GET /api/info
let KEYS = { step: "step", reward: "", loss: "", accuracy: "" };

function headers() { return state.key ? { Authorization: "Bearer " + state.key } : {}; }

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  const body = await r.json();
  if (!r.ok) { throw new Error((body.error && body.error.message) || r.statusText); }
  return body;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

const fmt = (x, digits = 3) => (typeof x === "number" ? x.toFixed(digits) : "");
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
const live = (s) => s === "QUEUED" || s === "STARTING" || s === "RUNNING";

function setStatus(text, isError) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = isError ? "error" : "muted";
}

async function cancel(id, event) {
  event.stopPropagation();
  if (!confirm("Cancel job " + id + "?")) return;
  try { await api("/api/jobs/" + id + "/cancel", { method: "POST" }); setStatus("cancelled " + id); }
  catch (e) { setStatus("cancel failed: " + e.message, true); }
  refresh();
}

function renderJobs(jobs) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren(...jobs.map((j) => {
    const frac = j.total_steps ? Math.min(1, (j.step || 0) / j.total_steps) : 0;
    const bar = el("span", { class: "bar" }, el("span", { style: "width:" + Math.round(frac * 100) + "%" }));
    const progress = el("td", {}, bar, (j.step == null ? "-" : j.step) + " / " + (j.total_steps || "?"));
    const actions = el("td", {});
    if (live(j.state)) actions.append(el("button", { class: "cancel", "data-id": j.id, onclick: (e) => cancel(j.id, e) }, "cancel"));
    const row = el("tr", { "data-id": j.id, class: j.id === state.selected ? "selected" : "", onclick: () => select(j.id) },
      el("td", {}, j.id), el("td", {}, j.name), el("td", {}, j.owner),
      el("td", { class: "state state-" + j.state, title: j.error || "" }, j.state),
      progress, el("td", {}, fmt(j.reward)), el("td", {}, fmt(j.accuracy)), el("td", {}, when(j.created)), actions);
    return row;
  }));
}

const COLORS = ["#1760d6", "#c62828", "#18804b", "#a86b00", "#7b3fb8", "#00838f", "#555"];

// lines: [{name, points: [[step, value], ...]}, ...]; one line is drawn without a legend
function chart(svg, lines) {
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text != null) e.textContent = text;
    svg.append(e);
    return e;
  };
  add("line", { class: "axis", x1: 30, y1: 140, x2: 410, y2: 140 });
  add("line", { class: "axis", x1: 30, y1: 10, x2: 30, y2: 140 });
  const all = lines.flatMap((l) => l.points);
  if (!all.length) { add("text", { x: 40, y: 80 }, "no data yet"); return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => 30 + (x1 > x0 ? ((x - x0) / (x1 - x0)) * 380 : 190);
  const sy = (y) => 140 - (y1 > y0 ? ((y - y0) / (y1 - y0)) * 125 : 62);
  lines.forEach((l, i) => {
    const color = COLORS[i % COLORS.length];
    add("polyline", { class: "line", style: "stroke:" + color, "data-name": l.name,
                      points: l.points.map((p) => sx(p[0]) + "," + sy(p[1])).join(" ") });
    if (lines.length > 1) add("text", { x: 40 + 95 * (i % 4), y: 10 + 11 * Math.floor(i / 4), style: "fill:" + color }, l.name);
  });
  add("text", { x: 0, y: 24 }, fmt(y1, 2)); add("text", { x: 0, y: 140 }, fmt(y0, 2));
  add("text", { x: 30, y: 155 }, "step " + x0); add("text", { x: 360, y: 155 }, "step " + x1);
}

// every metric key of the rows that starts with `prefix`, as one line each (elo/<player> -> <player>)
function prefixedLines(rows, prefix) {
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r).filter((k) => k.startsWith(prefix))))].sort();
  return keys.map((k) => ({ name: k.slice(prefix.length),
    points: rows.filter((r) => typeof r[k] === "number" && r[KEYS.step] != null).map((r) => [r[KEYS.step], r[k]]) }));
}

// An episode's messages; each "<image>" marker in them shows the episode's next logged image (data URLs in
// the order the markers appear; a marker past the logged ones stays as text: its image was too large to log).
function turns(e) {
  const images = (e.images || []).filter((u) => typeof u === "string" && /^data:image\/(png|jpeg);base64,/.test(u));
  let next = 0;
  return e.messages.map((m) => {
    const pieces = String(m.content).split("<image>");
    const parts = [m.role + ": " + pieces[0]];
    pieces.slice(1).forEach((text) => {
      parts.push(next < images.length ? el("img", { class: "observation", src: images[next++], alt: "image" }) : "<image>", text);
    });
    return el("div", { class: "turn " + m.role }, ...parts);
  });
}

function renderEpisodes(data) {
  const select = document.getElementById("episode-step");
  const current = state.step == null ? data.steps[data.steps.length - 1] : state.step;
  select.replaceChildren(...data.steps.map((s) => el("option", { value: s }, "step " + s)));
  if (current != null) select.value = current;
  const box = document.getElementById("episodes");
  box.replaceChildren(...data.episodes.map((e) => el("div", { class: "episode" },
    el("div", { class: "meta" }, (e.agent ? e.agent + " · " : "") + e.env + " · task " + e.task + " · reward " + fmt(e.reward) +
      " · advantage " + (e.advantage == null ? "dropped" : fmt(e.advantage)) +
      (e.turn_rewards && e.turn_rewards.length ? " · turn rewards " + e.turn_rewards.map((r) => fmt(r, 2)).join(", ") : "")),
    ...(e.error ? [el("div", { class: "error" }, "error: " + e.error)] : []),
    ...turns(e))));
  if (!data.episodes.length) box.replaceChildren(el("p", { class: "muted" }, "no episodes logged yet"));
}

async function renderDetail() {
  const id = state.selected;
  if (!id) return;
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-id").textContent = id;
  const [rows, checkpoints, episodes] = await Promise.all([
    api("/api/jobs/" + id + "/metrics"), api("/api/jobs/" + id + "/checkpoints"),
    api("/api/jobs/" + id + "/episodes" + (state.step == null ? "" : "?step=" + state.step))]);
  const series = (key) => rows.filter((r) => typeof r[key] === "number" && r[KEYS.step] != null).map((r) => [r[KEYS.step], r[key]]);
  chart(document.getElementById("chart-reward"), [{ name: "reward", points: series(KEYS.reward).length ? series(KEYS.reward) : series(KEYS.loss) }]);
  chart(document.getElementById("chart-eval"), [{ name: "accuracy", points: series(KEYS.accuracy) }]);
  const elo = prefixedLines(rows, KEYS.elo_prefix);  // game jobs only
  document.getElementById("figure-elo").hidden = !elo.length;
  if (elo.length) chart(document.getElementById("chart-elo"), elo);
  document.getElementById("checkpoints").replaceChildren(...checkpoints.map((c) =>
    el("li", {}, "step " + c.step + " — model name ", el("code", {}, c.model))));
  renderEpisodes(episodes);
}

function select(id) { state.selected = id; state.step = null; refresh(); }

async function refresh() {
  try {
    renderJobs(await api("/api/jobs"));
    await renderDetail();
    setStatus("updated " + new Date().toLocaleTimeString());
  } catch (e) { setStatus(e.message, true); }
}

async function start() {
  const info = await api("/api/info");
  KEYS = info.metric_keys;
  const link = document.getElementById("ray-link");
  if (info.ray_dashboard) link.href = info.ray_dashboard; else { link.removeAttribute("href"); link.textContent = "Ray dashboard: not running"; }
  const keyBox = document.getElementById("key-box"), key = document.getElementById("key");
  keyBox.hidden = !info.auth;
  key.value = state.key;
  key.addEventListener("change", () => { state.key = key.value.trim(); localStorage.setItem("otray-key", state.key); refresh(); });
  document.getElementById("episode-step").addEventListener("change", (e) => { state.step = Number(e.target.value); refresh(); });
  await refresh();
  setInterval(refresh, 2000);
}

start().catch((e) => setStatus(e.message, true));
