// The te-rs chat page: keeps the conversation in `history`, sends it to
// /v1/chat/completions with stream: true and appends the streamed deltas
// (server-sent events, `data: {chunk}` ... `data: [DONE]`) to the page.
"use strict";

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), input: $("input"), send: $("send"), stop: $("stop"),
  composer: $("composer"), status: $("status"), model: $("model"),
  temperature: $("temperature"), temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"), system: $("system"), apiKey: $("api-key"),
  newChat: $("new-chat"),
};

/** The conversation so far: {role, content} of each finished turn. */
let history = [];
let modelId = null;
let controller = null;

// Settings survive a reload.
for (const [key, input] of [["temperature", el.temperature], ["maxTokens", el.maxTokens],
                            ["system", el.system], ["apiKey", el.apiKey]]) {
  const saved = localStorage.getItem("te-chat-" + key);
  if (saved !== null) input.value = saved;
  input.addEventListener("input", () => localStorage.setItem("te-chat-" + key, input.value));
}
const showTemperature = () => { el.temperatureValue.textContent = el.temperature.value; };
el.temperature.addEventListener("input", showTemperature);
showTemperature();

function headers() {
  const h = { "Content-Type": "application/json" };
  if (el.apiKey.value) h["Authorization"] = "Bearer " + el.apiKey.value;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  el.messages.appendChild(div);
  el.messages.scrollTop = el.messages.scrollHeight;
  return div;
}

function setBusy(busy) {
  el.send.disabled = busy;
  el.stop.disabled = !busy;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await errorText(r));
    const body = await r.json();
    modelId = body.data[0].id;
    el.model.textContent = modelId;
    return true;
  } catch (e) {
    el.model.textContent = "not connected";
    el.status.textContent = "Could not list the models: " + e.message;
    return false;
  }
}

/** Reads an SSE body, calling onData with each event's data. */
async function readEvents(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data && onData(data) === false) return;
    }
  }
}

async function send(text) {
  if (!modelId && !(await loadModel())) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant streaming", "");
  let answer = "";
  const messages = [];
  if (el.system.value.trim()) messages.push({ role: "system", content: el.system.value });
  messages.push(...history);
  controller = new AbortController();
  setBusy(true);
  el.status.textContent = "generating…";
  let finish = null;
  let failed = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        model: modelId,
        messages,
        stream: true,
        stream_options: { include_usage: true },
        temperature: parseFloat(el.temperature.value),
        max_tokens: parseInt(el.maxTokens.value, 10) || undefined,
      }),
    });
    if (!r.ok) throw new Error(await errorText(r));
    let usage = null;
    await readEvents(r.body, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          bubble.textContent = answer;
          el.messages.scrollTop = el.messages.scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      return true;
    });
    el.status.textContent = (finish === "length" ? "stopped at the token limit" : "done") +
      (usage ? ` · ${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens` : "");
  } catch (e) {
    if (e.name === "AbortError") {
      el.status.textContent = "stopped";
    } else {
      failed = true;
      el.status.textContent = "";
      addMessage("error", "Error: " + e.message);
    }
  } finally {
    bubble.classList.remove("streaming");
    if (failed && !answer) {
      // Nothing came back: forget the turn, so it can be sent again.
      history.pop();
      bubble.remove();
    } else {
      // A stopped answer stays in the conversation as far as it got.
      history.push({ role: "assistant", content: answer });
    }
    controller = null;
    setBusy(false);
    el.input.focus();
  }
}

el.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = el.input.value.trim();
  if (!text || controller) return;
  el.input.value = "";
  send(text);
});
el.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    el.composer.requestSubmit();
  }
});
el.stop.addEventListener("click", () => { if (controller) controller.abort(); });
el.newChat.addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  el.messages.replaceChildren();
  el.status.textContent = "";
});
el.apiKey.addEventListener("change", loadModel);

loadModel();
