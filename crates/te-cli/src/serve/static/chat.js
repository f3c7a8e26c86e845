// The te-rs chat page: keeps the conversation in `history` (and in the
// browser's localStorage, so a reload keeps it), sends it to
// /v1/chat/completions with stream: true and renders the streamed deltas
// (server-sent events, `data: {chunk}` ... `data: [DONE]`) as markdown
// with highlighted code, with the answer's speed and time to first token
// under it. Self-contained: the server may have no internet access.
"use strict";

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), input: $("input"), send: $("send"), stop: $("stop"),
  composer: $("composer"), status: $("status"), model: $("model"),
  temperature: $("temperature"), temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"), system: $("system"), apiKey: $("api-key"),
  newChat: $("new-chat"),
};

/** The conversation so far: {role, content, meta} of each finished turn
 * (`meta`: the speed line under an answer). */
let history = [];
const CONVERSATION_KEY = "te-chat-conversation";
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
  if (role.startsWith("assistant")) setMarkdown(div, text);
  else div.textContent = text;
  el.messages.appendChild(div);
  el.messages.scrollTop = el.messages.scrollHeight;
  return div;
}

/** Shows `text` as markdown in `div`; the source stays in data-raw. */
function setMarkdown(div, text) {
  div.dataset.raw = text;
  div.innerHTML = renderMarkdown(text);
}

/** The speed line under an answer. */
function addMeta(text) {
  const div = document.createElement("div");
  div.className = "meta muted";
  div.textContent = text;
  el.messages.appendChild(div);
  return div;
}

function saveConversation() {
  localStorage.setItem(CONVERSATION_KEY, JSON.stringify(history));
}

function restoreConversation() {
  try {
    const saved = JSON.parse(localStorage.getItem(CONVERSATION_KEY) || "[]");
    if (!Array.isArray(saved)) return;
    history = saved.filter((m) => m && typeof m.content === "string" &&
                                  (m.role === "user" || m.role === "assistant"));
  } catch (_) {
    history = [];
  }
  for (const m of history) {
    addMessage(m.role, m.content);
    if (m.meta) addMeta(m.meta);
  }
}

const escapeHtml = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
  .replace(/"/g, "&quot;");

const KEYWORDS = new Set(("as async await break case catch class const continue def default del " +
  "do elif else enum export extends false fn for from func function if impl import in interface " +
  "let loop match mod mut new nil None null package pass pub raise return self Self static struct " +
  "super switch this throw trait true True False try type typeof use var void where while with " +
  "yield int float bool char double long unsigned string str void").split(" "));

/** `code` (already plain text) as HTML with spans for comments, strings,
 * numbers and keywords: one generic lexer for the common languages. */
function highlight(code) {
  const token = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;
  let out = "";
  let last = 0;
  for (let m; (m = token.exec(code)); ) {
    out += escapeHtml(code.slice(last, m.index));
    const text = escapeHtml(m[0]);
    if (m[1]) out += `<span class="tok-com">${text}</span>`;
    else if (m[2]) out += `<span class="tok-str">${text}</span>`;
    else if (m[3]) out += `<span class="tok-num">${text}</span>`;
    else if (KEYWORDS.has(m[4])) out += `<span class="tok-kw">${text}</span>`;
    else out += text;
    last = m.index + m[0].length;
  }
  return out + escapeHtml(code.slice(last));
}

/** Inline markdown of one escaped line: `code`, **bold**, *italic*. */
function inline(s) {
  return s.replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
}

/** Markdown to HTML: fenced code blocks (an unclosed one, while streaming,
 * too), headings, lists, paragraphs and inline marks; everything escaped. */
function renderMarkdown(text) {
  const parts = text.split(/^```/m);
  let html = "";
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? part.trim() : part.slice(0, nl).trim();
      const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
      html += `<pre><code class="lang-${escapeHtml(lang)}">${highlight(code)}</code></pre>`;
      return;
    }
    let list = null;
    let para = [];
    const flush = () => {
      if (para.length) html += `<p>${para.join("<br>")}</p>`;
      para = [];
      if (list) html += `</${list}>`;
      list = null;
    };
    for (const raw of part.replace(/^\n/, "").split("\n")) {
      const line = escapeHtml(raw);
      let m;
      if (!line.trim()) flush();
      else if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        flush();
        html += `<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`;
      } else if ((m = line.match(/^\s*(?:[-*+]|(\d+)\.)\s+(.*)$/))) {
        const kind = m[1] ? "ol" : "ul";
        if (para.length || list !== kind) flush();
        if (!list) { html += `<${kind}>`; list = kind; }
        html += `<li>${inline(m[2])}</li>`;
      } else {
        if (list) flush();
        para.push(inline(line));
      }
    }
    flush();
  });
  return html;
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
  saveConversation();
  addMessage("user", text);
  const bubble = addMessage("assistant streaming", "");
  let answer = "";
  const messages = [];
  if (el.system.value.trim()) messages.push({ role: "system", content: el.system.value });
  messages.push(...history.map(({ role, content }) => ({ role, content })));
  controller = new AbortController();
  setBusy(true);
  el.status.textContent = "generating…";
  let finish = null;
  let failed = false;
  const started = performance.now();
  let firstToken = null;
  let usage = null;
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
        // Defaults that keep a small model on topic.
        top_p: 0.9,
        repetition_penalty: 1.1,
        max_tokens: parseInt(el.maxTokens.value, 10) || undefined,
      }),
    });
    if (!r.ok) throw new Error(await errorText(r));
    await readEvents(r.body, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (firstToken === null) firstToken = performance.now();
          answer += choice.delta.content;
          setMarkdown(bubble, answer);
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
      const meta = speedLine(started, firstToken, performance.now(), usage);
      if (meta) addMeta(meta);
      history.push({ role: "assistant", content: answer, meta });
      saveConversation();
    }
    controller = null;
    setBusy(false);
    el.input.focus();
  }
}

/** "N tokens · X tokens/s · TTFT Y s" for an answer, or "" without tokens. */
function speedLine(started, firstToken, ended, usage) {
  if (firstToken === null) return "";
  const ttft = (firstToken - started) / 1000;
  const tokens = usage ? usage.completion_tokens : null;
  const secs = (ended - firstToken) / 1000;
  // The first token comes with the time to first token; the rest over `secs`.
  const rate = tokens && tokens > 1 && secs > 0 ? ((tokens - 1) / secs).toFixed(1) : null;
  return [tokens !== null ? `${tokens} tokens` : null, rate ? `${rate} tokens/s` : null,
          `TTFT ${ttft.toFixed(2)} s`].filter(Boolean).join(" · ");
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
  saveConversation();
  el.messages.replaceChildren();
  el.status.textContent = "";
});
el.apiKey.addEventListener("change", loadModel);

restoreConversation();
loadModel();
