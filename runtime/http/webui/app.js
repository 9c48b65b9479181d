// llamactor's built-in page (served at GET /): a chat playground and a live view of groups, slots and
// cohorts. Plain JavaScript, no build step, no third-party code.
//
// Every request carries the API key (when one was entered) as a Bearer header, /live included:
// the live stream is read with fetch() and a stream reader rather than EventSource, because
// EventSource cannot send headers and a key in the URL would land in logs and history.
// All URLs are relative, so the page also works where the app is mounted under a prefix.
"use strict";

const KEY_STORE = "llamactor.apiKey";
const RETRY_MS = 1500;
const $ = (id) => document.getElementById(id);

// ---- HTTP ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorOf(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON: keep the status text */ }
  return new ApiError(response.status, `${response.status}: ${message}`);
}

async function call(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const response = await fetch(path, opts);
  if (!response.ok) {
    const err = await errorOf(response);
    if (err.status === 401) needKey(err.message);
    throw err;
  }
  return response;
}

// Server-sent events from a fetch() response: calls onData(parsed JSON) per "data:" event
// until the stream ends, "[DONE]" arrives, or the signal aborts.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

// ---- API key ---------------------------------------------------------------------------

function banner(text) {
  const el = $("banner");
  el.textContent = text || "";
  el.hidden = !text;
}

function needKey(message) {
  $("key-message").textContent = apiKey()
    ? `The API key was refused (${message}). Enter the server's --api-key.`
    : `This server needs an API key (${message}). Enter the server's --api-key.`;
  banner(`Unauthorized: ${message}. Enter the API key to use this page.`);
  $("key-form").hidden = false;
  $("key-input").focus();
}

function setupKey() {
  $("key-button").addEventListener("click", () => {
    $("key-message").textContent = "API key sent as a Bearer header with every request (kept for this tab only).";
    $("key-form").hidden = false;
    $("key-input").focus();
  });
  $("key-cancel").addEventListener("click", () => { $("key-form").hidden = true; });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    $("key-input").value = "";
    $("key-form").hidden = true;
    banner("");
    loadProps();
    if (live.active) live.restart();
  });
}

// ---- server properties -------------------------------------------------------------------

let propsTimer = null;

async function loadProps() {
  clearTimeout(propsTimer);
  const dl = $("props");
  try {
    const props = await (await call("props")).json();
    const rows = [
      ["model", props.model_alias || props.model_path],
      ["slots", props.total_slots],
      ["pipeline groups", props.pipeline_groups],
      ["scheduler", props.scheduler],
      ["context per request", props.n_ctx],
      ["context total", props.n_ctx_total],
      ["KV", props.kv_unified ? "unified" : "split"],
      ...devices(props.engine && props.engine.build),
    ].filter(([, v]) => v !== undefined && v !== null && v !== "");
    dl.replaceChildren();
    for (const [k, v] of rows) {
      dl.append(el("dt", {}, k), el("dd", {}, String(v)));
    }
    $("server-info").textContent =
      `${props.model_alias || "model"} · ${props.total_slots} slots · ${props.pipeline_groups || 1} group(s) · ${props.scheduler || ""}`;
  } catch (err) {
    dl.replaceChildren(el("dt", {}, "status"), el("dd", {}, err.message));
    $("server-info").textContent = err.status === 401 ? "API key needed" : err.message;
    if (err.status === 503 || !err.status) propsTimer = setTimeout(loadProps, RETRY_MS);  // loading, or down
  }
}

// The engine's devices (GPUs, ggml-rpc workers, the CPU) with their memory, and the CPU
// features llama.cpp was built for: /props' engine.build.
function devices(build) {
  if (!build) return [];
  const gib = (n) => `${(n / 2 ** 30).toFixed(1)} GiB`;
  const rows = (build.devices || []).map((d) => [
    `device ${d.name}`,
    `${d.description} · ${d.type} · ${gib(d.memory_free)} free of ${gib(d.memory_total)}`,
  ]);
  rows.push(["backend", build.backend]);
  if (build.cpu_features && build.cpu_features.length) rows.push(["CPU features", build.cpu_features.join(" ")]);
  return rows;
}

// ---- small DOM helpers ---------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  const d = digits === undefined ? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 2) : digits;
  return x.toFixed(d);
}

function compact(x) {
  if (x >= 1e6) return `${+(x / 1e6).toFixed(1)}M`;
  if (x >= 1e4) return `${+(x / 1e3).toFixed(0)}k`;
  return String(+x.toFixed(1));
}

function fmtSeconds(s) {
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return m < 60 ? `${m}m ${Math.floor(s % 60)}s` : `${Math.floor(m / 60)}h ${m % 60}m`;
}

// ---- chat playground -----------------------------------------------------------------------

const chat = { history: [], controller: null };

function samplingFields() {
  const body = {};
  for (const name of ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed"]) {
    const raw = $("s-" + name).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(`${name} must be a number`);
    if (name === "max_tokens" && value < 0) continue;  // -1: up to the slot's context
    body[name] = value;
  }
  const extra = $("s-extra").value.trim();
  if (extra) {
    let parsed;
    try { parsed = JSON.parse(extra); } catch (e) { throw new Error(`more fields: not valid JSON (${e.message})`); }
    if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) {
      throw new Error("more fields: a JSON object is expected");
    }
    Object.assign(body, parsed);
  }
  return body;
}

function addMessage(role, text) {
  const node = el("div", { class: "msg " + role, "data-role": role });
  const body = el("span", { class: "text" });
  body.textContent = text;
  node.append(body);
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  let fields;
  try {
    fields = samplingFields();
  } catch (err) {
    addMessage("error", err.message);
    return;
  }
  chat.history.push({ role: "user", content: text });
  addMessage("user", text);
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(chat.history);
  const body = Object.assign({ messages, stream: true, stream_options: { include_usage: true } }, fields);
  const node = addMessage("assistant", "");
  const textNode = node.querySelector(".text");
  const stats = el("span", { class: "stats" });
  node.append(stats);
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const started = performance.now();
  let first = null, last = null, chunks = 0, usage = null, timings = null, content = "", finish = null, failure = null;
  try {
    const response = await call("v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: controller.signal,
      headers: { "Content-Type": "application/json" },
    });
    await readEvents(response, (data) => {
      if (data.error) { failure = data.error.message || "the stream failed"; return; }
      if (data.usage) usage = data.usage;
      if (data.timings) timings = data.timings;  // llama-server's own figures, when the server sends them
      for (const choice of data.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          chunks += 1;
          content += piece;
          textNode.textContent = content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
  } catch (err) {
    failure = err.name === "AbortError" ? null : err.message;
    if (err.name === "AbortError") finish = "stopped";
  } finally {
    chat.controller = null;
    setBusy(false);
  }
  if (content) chat.history.push({ role: "assistant", content });
  if (failure) {
    node.classList.add("error");
    if (!content) textNode.textContent = failure;
  }
  const tokens = usage ? usage.completion_tokens : chunks;
  node.dataset.tokens = String(tokens);
  node.dataset.chunks = String(chunks);
  node.dataset.finish = finish || (failure ? "error" : "");
  const parts = [`${tokens} tokens`];
  if (timings && timings.predicted_per_second) {
    parts.push(`${fmt(timings.predicted_per_second)} tok/s`);
  } else if (first !== null && last !== null && tokens > 1 && last > first) {
    parts.push(`${fmt((tokens - 1) / ((last - first) / 1000))} tok/s`);  // as this page received them
  }
  if (first !== null) parts.push(`first token ${Math.round(first - started)} ms`);
  if (usage) parts.push(`prompt ${usage.prompt_tokens} tokens`);
  if (finish) parts.push(finish === "stopped" ? "stopped" : `finish: ${finish}`);
  if (failure && content) parts.push(`error: ${failure}`);
  stats.textContent = parts.join(" · ");
}

function setupChat() {
  const input = $("input");
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || chat.controller) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    $("messages").replaceChildren();
  });
}

// ---- live view -----------------------------------------------------------------------------

const live = {
  active: false,
  controller: null,
  timer: null,
  frame: null,
  start() {
    this.active = true;
    if (!this.controller) this.connect();
  },
  stop() {
    this.active = false;
    clearTimeout(this.timer);
    if (this.controller) this.controller.abort();
    this.controller = null;
  },
  restart() {
    this.stop();
    this.start();
  },
  async connect() {
    const controller = new AbortController();
    this.controller = controller;
    const status = $("live-status");
    status.textContent = "connecting…";
    let retry = true;
    try {
      const response = await call("live", { signal: controller.signal });
      status.textContent = "live";
      await readEvents(response, (frame) => { this.frame = frame; renderLive(frame); });
      status.textContent = "the stream ended; reconnecting…";
    } catch (err) {
      if (err.name === "AbortError") return;
      retry = err.status !== 401;  // a refused key waits for a new one (the key form restarts us)
      status.textContent = err.status === 401
        ? `not connected: ${err.message}`
        : `not connected (${err.message}); retrying…`;
    } finally {
      if (this.controller === controller) this.controller = null;
    }
    if (retry && this.active) this.timer = setTimeout(() => { if (this.active && !this.controller) this.connect(); }, RETRY_MS);
  },
};

function figure(label, value, id) {
  return el("span", { class: "figure", "data-figure": id }, label, el("b", {}, value));
}

function renderLive(frame) {
  const s = frame.snapshot;
  const restarts = s.groups.reduce((a, g) => a + g.restarts, 0);
  const down = s.groups.filter((g) => !g.up).length;
  $("live-summary").replaceChildren(
    figure("state", s.state + (s.healthy ? "" : " (unhealthy)"), "state"),
    figure("scheduler", s.scheduler, "scheduler"),
    figure("queue", `${s.queue_depth} / ${s.queue_size}`, "queue"),
    figure("tok/s", fmt(frame.rates.tok_s), "tok_s"),
    figure("prompt tok/s", fmt(frame.rates.prompt_tok_s), "prompt_tok_s"),
    figure("group restarts", String(restarts) + (down ? ` (${down} down)` : ""), "restarts"),
    figure("uptime", fmtSeconds(s.uptime_s), "uptime"),
    figure("viewers", String(frame.clients), "viewers"),
  );
  renderGroups(s, frame.group_rates);
  renderRates(frame.series);
  const useRecent = $("hist-window").value === "recent";
  renderHistogram($("chart-ttft"), $("ttft-note"), s.ttft, useRecent ? frame.recent.ttft : null, frame.recent.window_s);
  renderHistogram($("chart-gap"), $("gap-note"), s.inter_token, useRecent ? frame.recent.inter_token : null,
                  frame.recent.window_s);
}

function renderGroups(s, rates) {
  const box = $("groups");
  if (s.groups.length === 0) {
    box.replaceChildren(el("p", { class: "muted" }, s.state === "ready" ? "no groups" : `runtime ${s.state}: no groups yet`));
    return;
  }
  const cards = new Map([...box.querySelectorAll(".group")].map((n) => [n.dataset.group, n]));
  const wanted = [];
  for (const g of s.groups) {
    let card = cards.get(String(g.id));
    if (!card) {
      card = el("div", { class: "group", "data-group": String(g.id) }, el("div", { class: "group-head" }),
                el("div", { class: "slots" }));
    }
    card.dataset.up = String(g.up);
    card.dataset.phase = g.phase;
    const rate = rates[g.id];
    card.querySelector(".group-head").replaceChildren(
      el("span", { class: "name" }, g.replica ? `replica ${g.replica} · group ${g.id}` : `group ${g.id}`),
      el("span", { class: "health" }, g.up ? "up" : "down"),
      el("span", { class: "phase", title: "the policy's phase" }, `${s.scheduler}: ${g.phase}`),
      el("span", {}, `cohort ${g.cohort}`),
      el("span", { title: "requests holding a slot that wait for a phase grant" }, `waiting ${g.waiting}`),
      el("span", {}, `restarts ${g.restarts}`),
      el("span", {}, rate ? `${fmt(rate.tok_s)} tok/s` : ""),
      g.requests_failed ? el("span", {}, `failed ${g.requests_failed}`) : "",
    );
    renderSlots(card.querySelector(".slots"), g.slots);
    wanted.push(card);
  }
  box.replaceChildren(...wanted);
}

function renderSlots(box, slots) {
  const tiles = new Map([...box.querySelectorAll(".slot")].map((n) => [n.dataset.slot, n]));
  const wanted = [];
  for (const slot of slots) {
    let tile = tiles.get(String(slot.id));
    if (!tile) tile = el("div", { class: "slot", "data-slot": String(slot.id) });
    tile.dataset.state = slot.state;
    tile.dataset.cohort = String(slot.cohort);
    tile.dataset.decoded = String(slot.n_decoded);
    const lines = [el("div", {}, el("span", { class: "slot-name" }, `slot ${slot.id}`), " · ",
                      el("span", { class: "slot-state" }, slot.state))];
    if (slot.task >= 0) {
      lines.push(el("div", {}, `task ${slot.task}` + (slot.cohort ? ` · cohort ${slot.cohort}` : "")));
      lines.push(el("div", {}, `prompt ${slot.n_prompt} · ${slot.n_decoded} generated`));
      lines.push(el("div", {}, `age ${fmtSeconds(slot.age_s)}`));
    }
    tile.replaceChildren(...lines);
    wanted.push(tile);
  }
  box.replaceChildren(...wanted);
}

const W = 420, H = 180, PAD_L = 44, PAD_R = 8, PAD_T = 10, PAD_B = 30;
const SERIES_SPAN_S = 180, SERIES_MIN_SPAN_S = 30;

function axes(node, yMax, yLabel) {
  node.append(
    svg("line", { class: "axis", x1: PAD_L, y1: H - PAD_B, x2: W - PAD_R, y2: H - PAD_B }),
    svg("line", { class: "axis", x1: PAD_L, y1: PAD_T, x2: PAD_L, y2: H - PAD_B }),
    svg("text", { x: PAD_L - 4, y: PAD_T + 8, "text-anchor": "end" }, yLabel(yMax)),
    svg("text", { x: PAD_L - 4, y: H - PAD_B, "text-anchor": "end" }, "0"),
  );
}

function niceMax(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (x <= m * p) return m * p;
  return 10 * p;
}

function renderRates(series) {
  const node = $("chart-rate");
  node.replaceChildren();
  if (!series || series.at.length < 2) {
    node.append(svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "collecting…"));
    return;
  }
  // the whole history once it covers three minutes; until then the time it does cover
  const t1 = series.at[series.at.length - 1];
  const span = Math.min(SERIES_SPAN_S, Math.max(SERIES_MIN_SPAN_S, t1 - series.at[0]));
  const yMax = niceMax(Math.max(1, ...series.tok_s, ...series.prompt_tok_s));
  axes(node, yMax, compact);
  const x = (t) => PAD_L + (W - PAD_L - PAD_R) * (1 - (t1 - t) / span);
  const y = (v) => H - PAD_B - (H - PAD_T - PAD_B) * (v / yMax);
  for (const [key, cls] of [["prompt_tok_s", "line-prompt"], ["tok_s", "line-gen"]]) {
    const pts = series.at.map((t, i) => [t, series[key][i]]).filter(([t]) => t1 - t <= span)
      .map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    node.append(svg("polyline", { class: cls, points: pts }));
  }
  node.append(
    svg("text", { x: PAD_L, y: H - 8 }, `−${Math.round(span)} s`),
    svg("text", { x: W - PAD_R, y: H - 8, "text-anchor": "end" }, "now"),
  );
}

function boundLabel(s) {
  return s < 1 ? `${Math.round(s * 1000 * 10) / 10}ms` : `${s}s`;
}

function renderHistogram(node, note, hist, recent, windowS) {
  node.replaceChildren();
  if (!hist) {
    note.textContent = "";
    node.append(svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "not available"));
    return;
  }
  const counts = recent || hist.counts;
  const total = counts.reduce((a, b) => a + b, 0);
  note.textContent = recent ? `(${total} in the last ${Math.round(windowS)} s)` : `(${total} since start)`;
  if (total === 0) {
    node.append(svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "no samples yet"));
    return;
  }
  const yMax = niceMax(Math.max(...counts));
  axes(node, yMax, compact);
  const n = counts.length, slot = (W - PAD_L - PAD_R) / n;
  counts.forEach((c, i) => {
    const h = (H - PAD_T - PAD_B) * (c / yMax);
    const bar = svg("rect", { class: "bar", x: PAD_L + i * slot + 1, y: H - PAD_B - h, width: Math.max(1, slot - 2), height: h });
    const label = i < hist.bounds_s.length ? `≤ ${boundLabel(hist.bounds_s[i])}` : `> ${boundLabel(hist.bounds_s[i - 1])}`;
    bar.append(svg("title", {}, `${label}: ${c}`));
    node.append(bar);
    if (i % 2 === 0 || n <= 8) {
      node.append(svg("text", { x: PAD_L + (i + 0.5) * slot, y: H - 12, "text-anchor": "middle" },
                      i < hist.bounds_s.length ? boundLabel(hist.bounds_s[i]) : "more"));
    }
  });
}

// ---- views ---------------------------------------------------------------------------------

function route() {
  const view = location.hash === "#live" ? "live" : "chat";
  $("chat-view").hidden = view !== "chat";
  $("live-view").hidden = view !== "live";
  $("tab-chat").classList.toggle("active", view === "chat");
  $("tab-live").classList.toggle("active", view === "live");
  if (view === "live") live.start(); else live.stop();  // the stream runs only while it is watched
}

function main() {
  setupKey();
  setupChat();
  $("hist-window").addEventListener("change", () => { if (live.frame) renderLive(live.frame); });
  window.addEventListener("hashchange", route);
  route();
  loadProps();
}

main();
