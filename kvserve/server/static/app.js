// kvserve's page: a chat on sessions and a live view of the engine, over the server's own API
// (the OpenAI-compatible and session routes, and the status routes: /v1/engine/events,
// /v1/requests/{id}/events). Plain JavaScript, no build step. Text from the model or from other
// callers is only ever set as text (textContent), never parsed as markup.
"use strict";

const $ = (selector) => document.querySelector(selector);
const KEY_STORAGE = "kvserve-api-key";
const MAX_EVENTS_SHOWN = 150;

const state = {
  key: sessionStorage.getItem(KEY_STORAGE),
  info: null,
  sessionId: null,
  messages: [], // the open session's history: {role, content}
  turns: new Map(), // session id -> its turns streaming or queued, oldest first: {requestId, item}
  view: 0, // counts the times the messages were drawn from a history: a turn's end knows if they were
  sending: false, // a message on its way: Enter again sends nothing twice
  cells: [],
  series: new Map(), // the engine's per-second figures by second
  engineStream: null, // the engine view's stream: {controller}, replaced when the key changes
};

// ----- the API ------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || (options.body !== undefined ? "POST" : "GET"),
    headers,
    body: options.body !== undefined ? JSON.stringify(options.body) : undefined,
    signal: options.signal,
  });
  if (response.status === 401) {
    askForKey(state.key ? "That key was not accepted." : null);
    throw new ApiError(401, "An API key is needed.");
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      message = (body.error && body.error.message) || message;
    } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, message);
  }
  return response;
}

async function apiJson(path, options) {
  return (await api(path, options)).json();
}

// Server-sent events from a fetch response: {name, data} for each event.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { name, data: data.join("\n") };
    }
  }
}

// ----- the key ------------------------------------------------------------------------------------
function askForKey(error) {
  const dialog = $("#key-dialog");
  $("#key-error").hidden = !error;
  $("#key-error").textContent = error || "";
  $("#key-button").hidden = false;
  if (!dialog.open) dialog.showModal();
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  if (key !== state.key && state.sessionId) showNoSession(); // another caller: the last key's conversation goes
  if (key !== state.key) $("#events").replaceChildren(); // and the events its view named
  state.key = key;
  sessionStorage.setItem(KEY_STORAGE, state.key);
  $("#key-dialog").close();
  start();
});
$("#key-button").addEventListener("click", () => askForKey(null));

// ----- start --------------------------------------------------------------------------------------
async function start() {
  try {
    state.info = await apiJson("/v1/engine");
  } catch (error) {
    if (error.status !== 401) {
      $("#model-name").textContent = `not ready: ${error.message}`;
      setTimeout(start, 2000);
    }
    return;
  }
  showInfo(state.info);
  await refreshSessions();
  watchEngine();
}

function showInfo(info) {
  $("#model-name").textContent = info.model;
  const weights = info.weights || {};
  $("#model-settings").textContent = [
    info.architecture,
    `${weights.mode || "?"} weights`,
    weights.activations ? `${weights.activations} activations` : null,
    info.dtype,
    `KV ${info.num_kv_blocks} blocks x ${info.block_size} tokens (${info.kv_cache_dtype})`,
    `context ${info.max_model_len}`,
    `${info.max_num_seqs} sequences`,
    info.device,
  ].filter(Boolean).join(" · ");
  const recommended = info.recommended_sampling || {};
  const fields = { temperature: "#temperature", top_p: "#top-p", top_k: "#top-k", min_p: "#min-p" };
  for (const [name, selector] of Object.entries(fields)) {
    if (recommended[name] !== undefined && $(selector).value === "") $(selector).value = recommended[name];
  }
  const named = Object.entries(recommended).map(([k, v]) => `${k} ${v}`).join(", ");
  $("#sampling-source").textContent = named
    ? `${named}: the model's recommended values. An empty field takes the server's default.`
    : "An empty field takes the server's default.";
}

// ----- sessions -----------------------------------------------------------------------------------
async function refreshSessions() {
  let list;
  try {
    list = (await apiJson("/v1/sessions")).data;
  } catch (error) {
    return showError(error);
  }
  const ul = $("#session-list");
  ul.replaceChildren();
  for (const session of list) {
    const li = document.createElement("li");
    li.dataset.id = session.id;
    li.classList.toggle("current", session.id === state.sessionId);
    li.title = session.id;
    li.textContent = session.title || "(no message yet)";
    const meta = document.createElement("span");
    meta.className = "meta";
    const where = session.is_live ? `${session.state}, ${session.kv_blocks} blocks` : "stored";
    meta.textContent = `${session.num_messages} messages · ${where}`;
    li.append(meta);
    li.addEventListener("click", () => openSession(session.id));
    ul.append(li);
  }
}

async function openSession(id) {
  let info;
  try {
    info = await apiJson(`/v1/sessions/${encodeURIComponent(id)}`);
  } catch (error) {
    return showError(error);
  }
  state.sessionId = info.id;
  state.messages = info.messages.map((m) => ({ role: m.role, content: m.content }));
  renderMessages();
  await refreshSessions();
}

async function newSession(messages) {
  const system = $("#system").value.trim();
  const body = messages ? { messages } : system ? { system } : {};
  const info = await apiJson("/v1/sessions", { body });
  state.sessionId = info.id;
  state.messages = info.messages.map((m) => ({ role: m.role, content: m.content }));
  renderMessages();
  await refreshSessions();
}

// No session on screen: the next message starts one.
function showNoSession() {
  state.sessionId = null;
  state.messages = [];
  renderMessages();
}

$("#new-session").addEventListener("click", () => {
  showNoSession();
  refreshSessions();
});

// Fork at message `index`: the whole session through the fork route (the child shares every pinned
// block at once); an earlier message starts a session with the history up to it, whose first turn
// finds the shared prefix's blocks in the prefix cache.
async function forkAt(index) {
  try {
    if (index === state.messages.length - 1 && !ownTurn()) {
      const child = await apiJson(`/v1/sessions/${encodeURIComponent(state.sessionId)}/fork`, { body: {} });
      await openSession(child.id);
    } else {
      await newSession(state.messages.slice(0, index + 1));
    }
  } catch (error) {
    showError(error);
  }
}

function renderMessages() {
  state.view += 1;
  const ol = $("#messages");
  ol.replaceChildren();
  state.messages.forEach((message, index) => ol.append(messageItem(message.role, message.content, index)));
  for (const turn of state.turns.get(state.sessionId) || []) ol.append(turn.item); // still streaming or queued
  $("#session-header").textContent = state.sessionId
    ? `Session ${state.sessionId}`
    : "No session yet: the first message starts one.";
  showStop();
}

function messageItem(role, content, index) {
  const li = document.createElement("li");
  li.className = role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const text = document.createElement("div");
  text.className = "text";
  text.textContent = content;
  li.append(label, text);
  if (index !== undefined) li.append(forkButton(index));
  return li;
}

function forkButton(index) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "fork";
  button.textContent = "fork here";
  button.title = "A new session with the conversation up to this message";
  button.addEventListener("click", () => forkAt(index));
  return button;
}

// ----- a turn -------------------------------------------------------------------------------------
function samplingBody() {
  const body = { stream: true, stream_options: { include_usage: true } };
  const number = (selector) => ($(selector).value === "" ? undefined : Number($(selector).value));
  body.max_tokens = number("#max-tokens");
  for (const [name, selector] of [["temperature", "#temperature"], ["top_p", "#top-p"], ["top_k", "#top-k"],
    ["min_p", "#min-p"], ["seed", "#seed"]]) {
    const value = number(selector);
    if (value !== undefined) body[name] = value;
  }
  return body;
}

async function send() {
  const text = $("#prompt").value.trim();
  if (!text || state.sending) return;
  state.sending = true;
  $("#prompt").value = ""; // at once: a second Enter finds nothing to send
  showError(null);
  let posted = false;
  try {
    if (!state.sessionId) await newSession(null);
    const sessionId = state.sessionId;
    const view = state.view;
    const interrupting = ownTurn() && $("#interrupt").checked;
    await api(`/v1/sessions/${encodeURIComponent(sessionId)}/messages`, { body: { role: "user", content: text } });
    posted = true;
    state.sending = false; // in the session: the next message may go (its turn waits behind this one)
    if (state.view === view) { // else its history was drawn again (from the server, with this message)
      state.messages.push({ role: "user", content: text });
      $("#messages").append(messageItem("user", text, state.messages.length - 1));
    }
    await runTurn(sessionId, interrupting);
  } catch (error) {
    if (!posted && !$("#prompt").value) $("#prompt").value = text; // not sent: back for another try
    showError(error);
  } finally {
    if (!posted) state.sending = false;
  }
}

// Whether the session on screen has a turn streaming or queued: Stop, interrupting and forking its
// whole history belong to it, never to another session's turns.
function ownTurn() {
  return (state.turns.get(state.sessionId) || []).length > 0;
}

function showStop() {
  $("#stop").disabled = !ownTurn();
}

async function runTurn(sessionId, interrupting) {
  const session = encodeURIComponent(sessionId);
  const requestId = `page-${crypto.getRandomValues(new Uint32Array(2)).join("")}`;
  const item = messageItem("assistant", "");
  item.dataset.requestId = requestId;
  const lifecycle = document.createElement("div");
  lifecycle.className = "lifecycle";
  item.append(lifecycle);
  const view = state.view;
  if (state.sessionId === sessionId) $("#messages").append(item);
  const turn = { requestId, item };
  const turns = state.turns.get(sessionId) || [];
  turns.push(turn);
  state.turns.set(sessionId, turns);
  showStop();
  const body = { ...samplingBody(), interrupt: interrupting };
  let reply = "";
  let finish = null;
  let numTokens = 0;
  let firstAt = null;
  try {
    const response = await api(`/v1/sessions/${session}/completions`, {
      body,
      headers: { "X-Request-Id": requestId },
    });
    followLifecycle(requestId, lifecycle);
    for await (const event of serverEvents(response)) {
      if (event.data === "[DONE]") break;
      const chunk = JSON.parse(event.data);
      if (chunk.error) throw new ApiError(500, chunk.error.message);
      if (chunk.usage) numTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          reply += delta.content;
          item.querySelector(".text").textContent = reply;
          numTokens += 1;
          firstAt = firstAt || performance.now();
          showRate(numTokens, firstAt);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (error) {
    showError(error);
  } finally {
    turns.splice(turns.indexOf(turn), 1);
    if (!turns.length && state.turns.get(sessionId) === turns) state.turns.delete(sessionId);
    showStop();
  }
  if (firstAt) showRate(numTokens, firstAt, true);
  item.dataset.finish = finish || "error";
  if (finish === "stop" || finish === "length") {
    // Kept in its session's history on the server. Added to the page's copy only if that was not
    // drawn again meanwhile (another session opened, or this one again, which may already hold it):
    // then the session on screen, if it is this one, is read from the server once more.
    if (state.view === view) {
      state.messages.push({ role: "assistant", content: reply });
      item.append(forkButton(state.messages.length - 1));
    } else if (state.sessionId === sessionId) {
      await openSession(sessionId);
    }
  } else {
    item.classList.add("stopped");
    const note = document.createElement("div");
    note.className = "lifecycle";
    note.textContent = "(stopped: not kept in the session's history)";
    item.append(note);
  }
  refreshSessions();
}

function showRate(numTokens, firstAt, final = false) {
  const seconds = (performance.now() - firstAt) / 1000;
  const rate = numTokens > 1 && seconds > 0 ? ((numTokens - 1) / seconds).toFixed(1) : "-";
  $("#rate").textContent = `${numTokens} tokens · ${rate} tok/s${final ? "" : "..."}`;
}

// The turn's lifecycle, as the engine reports it: queued -> prefill -> decoding -> finished -> freed.
// The steps come from its events; the live part (prefill progress, decoding rate) from its status.
async function followLifecycle(requestId, line) {
  const steps = [];
  let live = "";
  let current = "queued";
  const show = () => {
    line.dataset.state = current;
    line.textContent = [...steps, live].filter(Boolean).join(" → ");
  };
  const step = (text, next) => {
    steps.push(text);
    current = next;
  };
  try {
    const response = await api(`/v1/requests/${encodeURIComponent(requestId)}/events`);
    for await (const event of serverEvents(response)) {
      const data = JSON.parse(event.data);
      if (event.name === "status") {
        const choice = data.choices[0];
        if (current === "freed" || ["finished", "aborted", "failed"].includes(choice.state)) {
          live = "";
        } else if (choice.state === "prefill") {
          live = `prefill ${choice.num_computed_tokens}/${choice.num_prompt_tokens}`;
          current = "prefill";
        } else if (choice.state === "decoding") {
          const rate = choice.timings.tokens_per_s;
          live = `decoding${rate ? ` at ${rate.toFixed(1)} tok/s` : ""}`;
          current = "decoding";
        } else {
          live = choice.state;
        }
      } else if (event.name === "queued") {
        step(`queued (${data.num_prompt_tokens} tokens)`, "queued");
      } else if (event.name === "scheduled") {
        step(data.num_cached_tokens ? `${data.num_cached_tokens} from the prefix cache` : "scheduled", "prefill");
      } else if (event.name === "first_token") {
        step(`first token ${(data.ttft_s * 1000).toFixed(0)} ms`, "decoding");
      } else if (event.name === "preempted") {
        step("preempted", "preempted");
      } else if (event.name === "finished") {
        live = "";
        step(data.reason === "abort" ? "aborted" : `finished (${data.reason})`, data.reason === "abort" ? "aborted" : "finished");
      } else if (event.name === "freed") {
        step(`${data.num_blocks} blocks freed` + (data.num_kept ? `, ${data.num_kept} kept by the session` : ""), "freed");
      }
      show();
    }
  } catch (error) {
    if (error.status !== 404) line.textContent = `(status: ${error.message})`;
  }
}

$("#composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("#prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
$("#stop").addEventListener("click", async () => {
  const turns = [...(state.turns.get(state.sessionId) || [])]; // the streaming one and any queued behind it
  if (!turns.length) return;
  $("#stop").disabled = true;
  for (const turn of turns) {
    try {
      await api(`/v1/requests/${encodeURIComponent(turn.requestId)}`, { method: "DELETE" });
    } catch (error) {
      if (error.status !== 404) showError(error); // 404: it had ended already
    }
  }
});

function showError(error) {
  const p = $("#chat-error");
  p.hidden = !error;
  p.textContent = error ? error.message : "";
}

// ----- the engine view ----------------------------------------------------------------------------
// One stream at a time: a new key (start() again) ends the last key's and opens its own.
async function watchEngine() {
  if (state.engineStream) state.engineStream.controller.abort();
  const stream = { controller: new AbortController() };
  state.engineStream = stream;
  const signal = stream.controller.signal;
  while (!signal.aborted) {
    try {
      const response = await api("/v1/engine/events", { signal });
      $("#connection").textContent = "live";
      for await (const event of serverEvents(response)) {
        if (signal.aborted) return;
        if (event.name === "engine") renderEngine(JSON.parse(event.data));
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error.status === 401) {
        if (state.engineStream === stream) state.engineStream = null;
        return;
      }
    }
    $("#connection").textContent = "reconnecting...";
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function hue(text, from, span) {
  let h = 0;
  for (const c of text) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return from + (h % span);
}

function colourOf(holder) {
  return holder.kind === "session"
    ? `hsl(${hue(holder.id, 95, 70)} 55% 42%)`
    : `hsl(${hue(holder.id, 185, 80)} 70% 50%)`;
}

function short(id) {
  return id.length > 14 ? `…${id.slice(-10)}` : id;
}

function describe(code, holders) {
  if (code === 0) return { kind: "free", owners: "", label: "free" };
  if (code === 1) return { kind: "cached", owners: "", label: "prefix cache (reusable, evictable)" };
  if (code === 2) return { kind: "other", owners: "", label: "in use by another key" };
  const holder = holders[code - 3];
  if (holder.kind === "shared") {
    const members = holder.members.map((i) => holders[i]);
    return {
      kind: "shared",
      owners: members.map((m) => m.id).join(" "),
      colour: colourOf(members[0]),
      label: `shared by ${members.map((m) => `${m.kind} ${m.id}`).join(", ")}`,
    };
  }
  return { kind: holder.kind, owners: holder.id, colour: colourOf(holder), label: `${holder.kind} ${holder.id}` };
}

function renderMap(view) {
  const map = $("#block-map");
  const total = view.pool.num_blocks;
  if (state.cells.length !== total) {
    state.cells = Array.from({ length: total }, (_, i) => {
      const cell = document.createElement("div");
      cell.className = "b free";
      cell.dataset.block = i;
      cell.dataset.kind = "free";
      cell.dataset.owner = "";
      return cell;
    });
    map.replaceChildren(...state.cells);
  }
  let block = 0;
  for (const [code, count] of view.map) {
    const what = describe(code, view.holders);
    const key = `${what.kind}|${what.owners}`;
    for (let i = 0; i < count; i += 1, block += 1) {
      const cell = state.cells[block];
      if (cell.dataset.key === key) continue;
      cell.dataset.key = key;
      cell.dataset.kind = what.kind;
      cell.dataset.owner = what.owners;
      cell.className = `b ${what.kind}`;
      cell.style.background = what.colour || "";
      cell.title = `block ${block}: ${what.label}`;
    }
  }
  const pool = view.pool;
  $("#pool-figures").textContent =
    `${pool.num_used} in use · ${pool.num_cached} cached · ${pool.num_free} free of ${pool.num_blocks} blocks ` +
    `(${pool.block_size} tokens each)`;
}

function renderQueue(selector, ids) {
  const ol = $(selector);
  ol.replaceChildren(...ids.map((id) => {
    const li = document.createElement("li");
    li.textContent = id ? short(id) : "another key's";
    li.className = id ? "" : "other";
    if (id) li.title = id;
    return li;
  }));
}

function renderRequests(requests) {
  const tbody = $("#requests tbody");
  const rows = requests.map((r) => {
    const tr = document.createElement("tr");
    tr.className = r.state;
    if (r.id) tr.dataset.id = r.id;
    const timings = r.timings || {};
    const cells = r.id
      ? [
        r.internal ? `${short(r.id)} (session prefill)` : short(r.id),
        r.state + (r.finish_reason && r.state === "finished" ? ` (${r.finish_reason})` : ""),
        r.num_computed_tokens !== null && r.num_computed_tokens !== undefined
          ? `${Math.min(r.num_computed_tokens, r.num_prompt_tokens)}/${r.num_prompt_tokens}`
          : `${r.num_prompt_tokens}/${r.num_prompt_tokens}`,
        `${r.num_output_tokens}${r.max_tokens ? `/${r.max_tokens}` : ""}`,
        timings.tokens_per_s ? timings.tokens_per_s.toFixed(1) : "",
        timings.ttft_s !== null && timings.ttft_s !== undefined ? `${(timings.ttft_s * 1000).toFixed(0)} ms` : "",
        r.state === "finished" || r.state === "aborted" || r.state === "failed"
          ? `${r.num_blocks_freed ?? 0} freed`
          : `${r.kv_blocks}`,
      ]
      : ["another key's request", r.state, "", "", "", "", `${r.kv_blocks}`];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 0) {
        td.className = "id";
        if (r.id) td.title = r.id;
      }
      tr.append(td);
    });
    return tr;
  });
  tbody.replaceChildren(...rows);
}

function chart(selector, values) {
  const svg = $(selector);
  const max = Math.max(1e-9, ...values.filter((v) => v !== null));
  const lines = [];
  let points = [];
  values.forEach((v, i) => {
    if (v === null) {
      if (points.length) lines.push(points);
      points = [];
    } else {
      points.push(`${i},${(58 - (v / max) * 54).toFixed(1)}`);
    }
  });
  if (points.length) lines.push(points);
  svg.replaceChildren(...lines.map((line) => {
    const element = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    element.setAttribute("points", line.length === 1 ? `${line[0]} ${line[0].replace(/^(\d+)/, (m) => Number(m) + 1)}` : line.join(" "));
    return element;
  }));
}

function renderSeries(view) {
  // The whole five minutes come now and then; in between, the last seconds, merged in here.
  if (view.series_full) state.series = new Map();
  for (const bucket of view.series) state.series.set(bucket[0], bucket);
  const series = [...state.series.values()].sort((a, b) => a[0] - b[0]).slice(-300);
  state.series = new Map(series.map((bucket) => [bucket[0], bucket]));
  const end = series.length ? series[series.length - 1][0] : 0;
  const tokens = new Array(300).fill(0);
  const step = new Array(300).fill(null);
  const ttft = new Array(300).fill(null);
  for (const [second, numTokens, numSteps, stepSeconds, ttftSeconds, numTtft] of series) {
    const i = 299 - (end - second);
    if (i < 0) continue;
    tokens[i] = numTokens;
    step[i] = numSteps ? (stepSeconds / numSteps) * 1000 : null;
    ttft[i] = numTtft ? (ttftSeconds / numTtft) * 1000 : null;
  }
  chart("#chart-tokens", tokens);
  chart("#chart-step", step);
  chart("#chart-ttft", ttft);
  const last = (values) => values.filter((v) => v !== null).slice(-1)[0];
  const recent = series.length ? series[series.length - 1][1] : 0;
  $("#now-tokens").textContent = `(${recent} in the last second)`;
  $("#now-step").textContent = view.step_time_s ? `(${(view.step_time_s * 1000).toFixed(1)} now)` : "";
  const lastTtft = last(ttft);
  $("#now-ttft").textContent = lastTtft !== undefined ? `(${lastTtft.toFixed(0)} last)` : "";
  const c = view.counters;
  $("#counters").textContent =
    `${c.steps_total} steps · ${c.generation_tokens_total} tokens · ${c.num_preemptions_total} preemptions · ` +
    `${c.num_evictions_total} evictions · ${c.num_aborted_total} aborted`;
}

function eventText(event) {
  if (!event.request_id && !["evicted", "reclaimed"].includes(event.kind)) {
    const done = { finished: "ended", freed: "gave its blocks back", first_token: "sent its first token" };
    return `another key's request ${done[event.kind] || event.kind}`;
  }
  const who = event.request_id ? short(event.request_id) : "";
  switch (event.kind) {
    case "queued": return `${who} queued (${event.num_prompt_tokens ?? "?"} prompt tokens)`;
    case "scheduled": return `${who} scheduled` + (event.num_cached_tokens ? `, ${event.num_cached_tokens} tokens from the prefix cache` : "");
    case "first_token": return `${who} first token` + (event.ttft_s !== undefined ? ` after ${(event.ttft_s * 1000).toFixed(0)} ms` : "");
    case "preempted": return `${who} preempted: its blocks freed, back to the queue`;
    case "finished": return `${who} ${event.reason === "abort" ? "aborted" : `finished (${event.reason ?? "?"})`}`;
    case "freed": return `${who} freed ${event.num_blocks ?? "its"} blocks` + (event.num_kept ? ` (${event.num_kept} kept by their session)` : "");
    case "evicted": return `evicted ${event.num_blocks} cached blocks for new work`;
    case "reclaimed": return `sessions released ${event.num_blocks} blocks`;
    default: return `${who} ${event.kind}`;
  }
}

function renderEvents(events) {
  const ol = $("#events");
  for (const event of events) {
    if (event.internal) continue;
    const li = document.createElement("li");
    li.className = event.kind === "finished" && event.reason === "abort" ? "aborted" : event.kind;
    const time = new Date(event.t * 1000).toLocaleTimeString();
    li.textContent = `${time} ${eventText(event)}`;
    ol.prepend(li);
  }
  while (ol.children.length > MAX_EVENTS_SHOWN) ol.lastChild.remove();
}

function renderEngine(view) {
  renderMap(view);
  renderQueue("#running", view.running);
  renderQueue("#waiting", view.waiting);
  renderRequests(view.requests);
  renderSeries(view);
  renderEvents(view.events);
}

start();
