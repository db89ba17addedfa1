// The playground: a chat with one served model (or adapter), streamed, with the knobs that
// matter. Everything the model writes is put in the page as text (textContent), never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const DEFAULT_SPECS = {
  json_schema: JSON.stringify({
    type: "object",
    properties: {answer: {type: "string", maxLength: 80}, confidence: {type: "integer", minimum: 0, maximum: 10}},
    required: ["answer", "confidence"], additionalProperties: false}, null, 2),
  tools: JSON.stringify([{type: "function", function: {
    name: "get_weather", description: "The weather in a city",
    parameters: {type: "object", properties: {city: {type: "string", maxLength: 40}}, required: ["city"],
      additionalProperties: false}}}], null, 2),
};
const chat = {history: [], controller: null, cards: []};

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

// Text with ``` fences as paragraphs and code blocks, built from text nodes only.
function render(target, text) {
  target.replaceChildren();
  text.split("```").forEach((part, i) => {
    if (i % 2 === 1) {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      const newline = part.indexOf("\n");
      const language = newline > 0 ? part.slice(0, newline).trim() : "";
      code.textContent = /^[\w+#.-]+$/.test(language) ? part.slice(newline + 1) : part;
      if (language) code.dataset.language = language;
      pre.appendChild(code);
      target.appendChild(pre);
    } else if (part) {
      const p = document.createElement("p");
      p.textContent = part;
      target.appendChild(p);
    }
  });
}

function addMessage(role, text) {
  const box = document.createElement("article");
  box.className = "message " + role;
  const who = document.createElement("h2");
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  const stats = document.createElement("p");
  stats.className = "stats";
  box.append(who, body, stats);
  $("messages").appendChild(box);
  if (text) render(body, text);
  box.scrollIntoView({block: "end"});
  return {box, body, stats};
}

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return showError("GET /v1/models: " + await errorText(response));
  chat.cards = (await response.json()).data.filter((c) => c.pyserve_kind !== "embedding");
  const models = $("model");
  models.replaceChildren();
  for (const card of chat.cards.filter((c) => !c.parent)) {
    const option = document.createElement("option");
    option.value = option.textContent = card.id;
    models.appendChild(option);
  }
  fillAdapters();
}

function fillAdapters() {
  const adapters = $("adapter");
  adapters.replaceChildren(new Option("(base model)", ""));
  for (const card of chat.cards.filter((c) => c.parent === $("model").value)) {
    adapters.appendChild(new Option(card.id, card.id));
  }
}

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

// The request body, or a thrown Error naming the field at fault.
function requestBody() {
  const body = {
    model: $("adapter").value || $("model").value,
    messages: [],
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
    stream: true,
    stream_options: {include_usage: true},
  };
  const seed = number("seed");
  if (seed !== null) body.seed = seed;
  const system = $("system").value.trim();
  if (system) body.messages.push({role: "system", content: system});
  body.messages.push(...chat.history);
  const mode = $("mode").value;
  if (mode !== "text") {
    let spec;
    try {
      spec = JSON.parse($("mode-spec").value);
    } catch (e) {
      throw new Error((mode === "tools" ? "Tools" : "Schema") + " is not valid JSON: " + e.message);
    }
    if (mode === "json_schema") body.response_format = {type: "json_schema", json_schema: {name: "answer", schema: spec}};
    else Object.assign(body, {tools: spec, tool_choice: $("tool-choice").value});
  }
  return body;
}

async function speculation(model) {
  try {
    const response = await api("/v1/stats");
    if (!response.ok) return null;
    // Behind `pyserve router` each replica's engine is listed as MODEL@REPLICA: their sum.
    const engines = Object.entries((await response.json()).models)
      .filter(([name]) => name === model || name.startsWith(model + "@")).map(([, stats]) => stats);
    if (!engines.length) return null;
    const total = (key) => engines.reduce((a, s) => a + (s[key] || 0), 0);
    return [total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")];
  } catch (e) {
    return null;
  }
}

// Reads an SSE body, calling onChunk with each parsed data object.
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onChunk(JSON.parse(line.slice(6)));
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  let body;
  try {
    body = requestBody();
  } catch (e) {
    return showError(e.message);
  }
  // After an answer that called tools, the message is the calls' result (one tool message per call).
  const last = chat.history[chat.history.length - 1];
  const turn = last && last.tool_calls ?
    last.tool_calls.map((call) => ({role: "tool", tool_call_id: call.id, content: text})) :
    [{role: "user", content: text}];
  body.messages.push(...turn);
  showError("");
  $("prompt").value = "";
  const historyBefore = chat.history.length;
  chat.history.push(...turn);
  addMessage(turn[0].role, text);
  const answer = addMessage("assistant", "");
  answer.box.dataset.state = "streaming";
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const before = await speculation($("model").value);
  const started = performance.now();
  let first = null, latest = null, content = "", usage = null, outcome = "done";
  const calls = [];
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
      signal: controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) content += delta.content;
        for (const call of delta.tool_calls || []) {
          const slot = calls[call.index] = calls[call.index] || {id: "", name: "", arguments: ""};
          if (call.id) slot.id = call.id;
          if (call.function && call.function.name) slot.name += call.function.name;
          if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
        }
        if (delta.content || delta.tool_calls) {
          latest = performance.now();
          if (first === null) first = latest;
        }
      }
      const shown = calls.length ? content + calls.map((c) => "```json\n" + c.name + "(" + c.arguments + ")\n```").join("") : content;
      render(answer.body, shown);
    });
  } catch (e) {
    if (e.name === "AbortError") outcome = "stopped";
    else { outcome = "error"; showError(e.message); }
  } finally {
    chat.controller = null;
    setBusy(false);
  }
  answer.box.dataset.state = outcome;
  if (outcome === "error") {
    chat.history.length = historyBefore;  // a failed turn is not sent again with the next one
  } else if (calls.length) {
    chat.history.push({role: "assistant", content: content || null, tool_calls: calls.map((c) => (
      {id: c.id, type: "function", function: {name: c.name, arguments: c.arguments}}))});
  } else {
    chat.history.push({role: "assistant", content});
  }
  showPromptKind();
  const after = await speculation($("model").value);
  const figures = [];
  if (first !== null) figures.push("TTFT " + (first - started).toFixed(0) + " ms");
  if (usage) figures.push(rateFigure(usage.completion_tokens, first, latest));
  if (usage) figures.push((usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0) +
    " cached prompt tokens");
  if (before && after && after[0] > before[0]) {
    figures.push("acceptance " + ((after[1] - before[1]) / (after[0] - before[0])).toFixed(2) +
      " (server-wide during the answer)");
  }
  if (outcome === "stopped") figures.push("stopped");
  answer.stats.textContent = figures.join(" · ");
}

// Tokens per second over the answer's own timing, from its first token to its last. An answer whose
// first and last tokens arrived less than MIN_RATE_SPAN_MS apart came in a burst (buffered on the
// way, or a forced tool call's grammar wrote it), which says nothing of the model's speed: no rate.
const MIN_RATE_SPAN_MS = 50;
function rateFigure(tokens, firstMs, lastMs) {
  const span = firstMs === null ? 0 : lastMs - firstMs;
  if (tokens > 1 && span >= MIN_RATE_SPAN_MS) return ((tokens - 1) / (span / 1000)).toFixed(1) + " tok/s";
  return tokens + (tokens === 1 ? " token" : " tokens at once (no rate)");
}

// The message box says what the next message is: the result of the tools just called, or a user turn.
function showPromptKind() {
  const last = chat.history[chat.history.length - 1];
  $("prompt").placeholder = last && last.tool_calls ?
    "The tools' result (sent as each call's answer; Ctrl+Enter sends)" : "Message (Ctrl+Enter sends, Esc stops)";
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function showMode() {
  const mode = $("mode").value;
  const spec = $("mode-spec");
  $("mode-spec-label").hidden = spec.hidden = mode === "text";
  $("tool-choice-label").hidden = $("tool-choice").hidden = mode !== "tools";
  $("mode-spec-label").textContent = mode === "tools" ? "Tools (JSON)" : "Schema (JSON)";
  if (mode !== "text") spec.value = DEFAULT_SPECS[mode];
}

$("ask").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("stop").addEventListener("click", stop);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); send(); }
  if (event.key === "Escape") stop();
});
$("model").addEventListener("change", fillAdapters);
$("mode").addEventListener("change", showMode);
$("clear").addEventListener("click", () => {
  chat.history = [];
  $("messages").replaceChildren();
  showError("");
  showPromptKind();
});
$("forget-key").addEventListener("click", () => { clearKey(); loadModels(); });
window.pyservePlayground = {render, chat, rateFigure};  // for the browser tests
loadModels();
