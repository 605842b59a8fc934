// verispec live page: streams /v1/chat/completions and /v1/verispec/race as server-sent events and
// colours every token by how the engine produced it (the "verispec" extension of each chunk carries
// the step's token kinds and per-token text pieces). document.body.dataset.state is "idle", "running"
// or "done"/"error" so automated tests can wait on it.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const state = { info: null, history: [], controller: null };

function setState(s) { document.body.dataset.state = s; }

function showError(message) {
  const box = $("#error");
  box.textContent = message;
  box.hidden = !message;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function speculation() {
  return { method: $("#method").value, draft_length: parseInt($("#draft-length").value, 10) || 5 };
}

// POST a JSON body and call onEvent(obj) for every SSE data line; throws with the server's message.
async function streamSSE(url, body, onEvent, signal) {
  const resp = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!resp.ok) {
    let message = `HTTP ${resp.status}`;
    try { message = (await resp.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        onEvent(obj);
      }
    }
  }
}

// Append one step's tokens to `container` as coloured spans inside a step group.
function renderStep(container, ext) {
  const step = document.createElement("span");
  step.className = "step";
  step.dataset.step = ext.step;
  ext.pieces.forEach((piece, i) => {
    const tok = document.createElement("span");
    tok.className = "tok tok-" + ext.kinds[i];
    tok.textContent = piece;
    tok.title = `step ${ext.step} · ${ext.kinds[i]} · token ${ext.token_ids[i]}`;
    step.appendChild(tok);
  });
  container.appendChild(step);
}

// Live counters from the steps seen so far; replaced by the server's statistics at the end.
class Tally {
  constructor() { this.t0 = performance.now(); this.tokens = 0; this.steps = 0; this.accepted = 0; }
  add(ext) {
    this.steps += 1;
    this.tokens += ext.token_ids.length;
    this.accepted += ext.kinds.filter((k) => k === "accepted").length;
  }
  seconds() { return (performance.now() - this.t0) / 1000; }
}

function fill(root, values) {
  for (const [k, v] of Object.entries(values)) {
    const el = root.querySelector(`[data-k="${k}"]`);
    if (el) el.textContent = v;
  }
}

// ---------------------------------------------------------------- chat
function addMessage(role, text) {
  const msg = document.createElement("div");
  msg.className = "msg " + role;
  msg.innerHTML = `<div class="who"></div><div class="body"></div><div class="meta"></div>`;
  $(".who", msg).textContent = role;
  if (text) $(".body", msg).textContent = text;
  $("#log").appendChild(msg);
  return msg;
}

async function sendChat(ev) {
  ev.preventDefault();
  const text = $("#prompt").value.trim();
  if (!text || state.controller) return;
  showError("");
  $("#prompt").value = "";
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  const body = $(".body", msg);
  const stats = $("#chat-stats");
  const tally = new Tally();
  let content = "";
  state.controller = new AbortController();
  $("#send").disabled = true;
  $("#stop").disabled = false;
  setState("running");
  const request = {
    model: state.info.model, messages: state.history, stream: true,
    max_tokens: parseInt($("#max-tokens").value, 10) || 96,
    temperature: parseFloat($("#temperature").value) || 0,
    verispec: speculation(),
  };
  try {
    await streamSSE("/v1/chat/completions", request, (chunk) => {
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) content += choice.delta.content;
      const ext = chunk.verispec;
      if (ext && ext.pieces) {
        renderStep(body, ext);
        tally.add(ext);
        const s = tally.seconds();
        fill(stats, { tps: (tally.tokens / s).toFixed(1), tau: (tally.tokens / tally.steps).toFixed(2),
                      steps: tally.steps, accepted: tally.accepted });
        $("#log").scrollTop = $("#log").scrollHeight;
      }
      if (ext && ext.stats) {
        const st = ext.stats;
        fill(stats, { tps: st.tokens_per_second.toFixed(1), tau: st.mean_accepted_length.toFixed(2),
                      steps: st.steps, drafted: st.drafted, accepted: st.accepted });
        $(".meta", msg).textContent = `${st.method} · ${chunk.usage.completion_tokens} tokens in ` +
          `${st.total_time.toFixed(2)} s · ${st.steps} target forwards · finish: ${choice.finish_reason}`;
      }
    }, state.controller.signal);
    state.history.push({ role: "assistant", content });
    setState("done");
  } catch (err) {
    if (err.name === "AbortError") { setState("done"); state.history.push({ role: "assistant", content }); }
    else { showError(err.message); setState("error"); state.history.pop(); }
  } finally {
    state.controller = null;
    $("#send").disabled = false;
    $("#stop").disabled = true;
  }
}

// ---------------------------------------------------------------- race
async function runRace(ev) {
  ev.preventDefault();
  const text = $("#race-prompt").value.trim();
  if (!text || state.controller) return;
  showError("");
  const spec = speculation();
  if (spec.method === "ar") spec.method = state.info.methods.includes("ngram") ? "ngram" : "ar";
  const lanes = [0, 1].map((i) => $("#lane-" + i));
  lanes.forEach((lane) => { $(".text", lane).textContent = ""; lane.classList.remove("finished");
                            fill(lane, { time: "–", tokens: "–", tps: "–", steps: "–", tau: "–" }); });
  $(".method", lanes[1]).textContent = `${spec.method}, k=${spec.draft_length}`;
  $("#race-result").textContent = "";
  const tallies = [new Tally(), new Tally()];
  const ids = [[], []];
  const done = [null, null];
  state.controller = new AbortController();
  $("#race-go").disabled = true;
  $("#race-stop").disabled = false;
  setState("running");
  const request = {
    messages: [{ role: "user", content: text }],
    max_tokens: parseInt($("#max-tokens").value, 10) || 96,
    temperature: parseFloat($("#temperature").value) || 0,
    lanes: [{ method: "ar" }, spec],
  };
  try {
    await streamSSE("/v1/verispec/race", request, (e) => {
      if (e.lane === undefined) return;
      const lane = lanes[e.lane];
      if (e.done) {
        done[e.lane] = e;
        lane.classList.add("finished");
        fill(lane, { time: e.elapsed.toFixed(2), tokens: e.usage.completion_tokens,
                     tps: (e.usage.completion_tokens / e.elapsed).toFixed(1), steps: e.stats.steps,
                     tau: e.stats.mean_accepted_length.toFixed(2) });
        return;
      }
      renderStep($(".text", lane), e);
      const t = tallies[e.lane];
      t.add(e);
      ids[e.lane].push(...e.token_ids);
      fill(lane, { time: e.elapsed.toFixed(2), tokens: t.tokens, tps: (t.tokens / e.elapsed).toFixed(1),
                   steps: t.steps, tau: (t.tokens / t.steps).toFixed(2) });
    }, state.controller.signal);
    if (done[0] && done[1]) {
      const speedup = done[0].elapsed / done[1].elapsed;
      const same = ids[0].length === ids[1].length && ids[0].every((v, i) => v === ids[1][i]);
      const temp = parseFloat($("#temperature").value) || 0;
      $("#race-result").innerHTML = `<b>${speedup.toFixed(2)}×</b> speed of plain decoding · ` +
        (temp === 0 ? (same ? "outputs identical token for token (greedy: lossless)" : "outputs DIFFER")
                    : "sampling: outputs follow the same distribution, not the same tokens");
    }
    setState("done");
  } catch (err) {
    if (err.name === "AbortError") setState("done");
    else { showError(err.message); setState("error"); }
  } finally {
    state.controller = null;
    $("#race-go").disabled = false;
    $("#race-stop").disabled = true;
  }
}

// ---------------------------------------------------------------- setup
function switchTab(name) {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.dataset.tab === name));
  $("#chat").hidden = name !== "chat";
  $("#race").hidden = name !== "race";
}

async function init() {
  try {
    const resp = await fetch("/verispec/info");
    state.info = await resp.json();
  } catch (err) {
    showError("cannot reach the server: " + err.message);
    setState("error");
    return;
  }
  const info = state.info;
  $("#model-name").textContent = info.model;
  const select = $("#method");
  for (const m of info.methods) {
    const opt = document.createElement("option");
    opt.value = opt.textContent = m;
    select.appendChild(opt);
  }
  select.value = info.defaults.method === "ar" && info.methods.includes("ngram") ? "ngram" : info.defaults.method;
  $("#draft-length").value = info.defaults.draft_length;
  $("#max-tokens").max = info.limits.max_tokens;
  if (info.api_key_required) {
    $("#key-label").hidden = false;
    $("#api-key").value = localStorage.getItem("verispec-key") || "";
    $("#api-key").addEventListener("change", () => localStorage.setItem("verispec-key", $("#api-key").value));
  }
  document.querySelectorAll(".tab").forEach((t) => t.addEventListener("click", () => switchTab(t.dataset.tab)));
  $("#chat-form").addEventListener("submit", sendChat);
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
  });
  $("#stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("#race-stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("#clear").addEventListener("click", () => { state.history = []; $("#log").textContent = ""; });
  $("#race-form").addEventListener("submit", runRace);
  setState("idle");
}

init();
