// The chat page. Model output is only ever put into the page as text nodes (textContent) by the tiny markdown
// renderer below; links are made only for http(s) URLs. Conversations, settings and the API key live in
// localStorage; the key is sent as an Authorization header, never in a URL.
"use strict";

const STORE = { chats: "jaxstation.chats", settings: "jaxstation.settings", key: "jaxstation.key" };
const $ = (id) => document.getElementById(id);

// ---- markdown -> DOM nodes, never HTML ----

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([\s\S]+?)\*\*|__([\s\S]+?)__|\*([^*\s](?:[^*]*[^*\s])?)\*|_([^_\s](?:[^_]*[^_\s])?)_|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

function element(tag, ...children) {
  const node = document.createElement(tag);
  for (const child of children) node.append(child);
  return node;
}

function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) out.push(element("code", m[2]));
    else if (m[3] !== undefined || m[4] !== undefined) out.push(element("strong", ...inline(m[3] ?? m[4])));
    else if (m[5] !== undefined || m[6] !== undefined) out.push(element("em", ...inline(m[5] ?? m[6])));
    else out.push(link(m[7], m[8], m[0]));
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}

function link(label, target, source) {
  const href = safeUrl(target);
  if (!href) return source;
  const a = element("a", ...inline(label));
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  return a;
}

function lines(texts) {
  const out = [];
  texts.forEach((t, i) => {
    if (i) out.push(document.createElement("br"));
    out.push(...inline(t));
  });
  return out;
}

const FENCE = /^\s*(```|~~~)\s*([\w+.#-]*)/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;

function codeBlock(rows, i, out) {
  const [, fence, lang] = rows[i].match(FENCE);
  const body = [];
  for (i += 1; i < rows.length && !rows[i].trim().startsWith(fence); i += 1) body.push(rows[i]);
  const code = element("code", body.join("\n"));
  if (lang) code.className = "language-" + lang;
  out.append(element("pre", code));
  return i + 1;
}

function list(rows, i, out) {
  const ordered = /\d/.test(rows[i].match(ITEM)[1]);
  const node = document.createElement(ordered ? "ol" : "ul");
  for (; i < rows.length && ITEM.test(rows[i]); i += 1) node.append(element("li", ...inline(rows[i].match(ITEM)[2])));
  out.append(node);
  return i;
}

function paragraph(rows, i, out) {
  const body = [];
  for (; i < rows.length && rows[i].trim() && !FENCE.test(rows[i]) && !ITEM.test(rows[i]); i += 1) body.push(rows[i]);
  out.append(element("p", ...lines(body)));
  return i;
}

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const rows = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < rows.length) {
    const heading = rows[i].match(HEADING);
    if (!rows[i].trim()) i += 1;
    else if (FENCE.test(rows[i])) i = codeBlock(rows, i, out);
    else if (ITEM.test(rows[i])) i = list(rows, i, out);
    else if (heading) {
      out.append(element("h" + Math.min(heading[1].length + 2, 6), ...inline(heading[2])));
      i += 1;
    } else i = paragraph(rows, i, out);
  }
  return out;
}

// Without a reasoning parser on the station, the thinking arrives inline as <think>...</think>.
function splitThinking(content) {
  const start = content.indexOf("<think>");
  if (start < 0) return { reasoning: "", answer: content };
  const end = content.indexOf("</think>", start);
  const reasoning = content.slice(start + 7, end < 0 ? undefined : end);
  const answer = content.slice(0, start) + (end < 0 ? "" : content.slice(end + 8));
  return { reasoning: reasoning.trim(), answer: answer.trim() };
}

// ---- storage ----

function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const state = { chats: read(STORE.chats, []), current: null, controller: null, ready: false };

function save() {
  localStorage.setItem(STORE.chats, JSON.stringify(state.chats));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function currentChat() {
  let chat = state.chats.find((c) => c.id === state.current);
  if (!chat) {
    chat = { id: newId(), title: "New chat", messages: [] };
    state.chats.unshift(chat);
    state.current = chat.id;
  }
  return chat;
}

// ---- the station's API ----

async function askKey() {
  const dialog = $("key-dialog");
  $("key").value = "";
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  localStorage.setItem(STORE.key, $("key").value.trim());
}

async function api(path, body, signal) {
  for (let attempt = 0; ; attempt += 1) {
    const headers = { "Content-Type": "application/json" };
    const key = localStorage.getItem(STORE.key);
    if (key) headers.Authorization = "Bearer " + key;
    const res = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), signal });
    if (res.status !== 401 || attempt > 0) return res;
    await askKey();
  }
}

function settings() {
  const number = (id, parse) => ($(id).value.trim() === "" ? undefined : parse($(id).value));
  return {
    system: $("system").value,
    temperature: number("temperature", parseFloat),
    max_tokens: number("max-tokens", (v) => parseInt(v, 10)),
    seed: number("seed", (v) => parseInt(v, 10)),
  };
}

function requestBody(chat) {
  const s = settings();
  const messages = chat.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
  return { messages, stream: true, stream_options: { include_usage: true }, temperature: s.temperature,
           max_tokens: s.max_tokens, seed: s.seed };
}

function applyDelta(reply, delta) {
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const call of delta.tool_calls ?? []) {
    const slot = (reply.tools[call.index ?? 0] ??= { name: "", arguments: "" });
    slot.name += call.function?.name ?? "";
    slot.arguments += call.function?.arguments ?? "";
  }
}

function applyEvent(reply, data, timing) {
  if (data === "[DONE]") return;
  const chunk = JSON.parse(data);
  if (chunk.error) reply.error = chunk.error.message ?? JSON.stringify(chunk.error);
  for (const choice of chunk.choices ?? []) {
    timing.first ??= performance.now();
    applyDelta(reply, choice.delta ?? {});
  }
  if (chunk.usage) reply.usage = chunk.usage;
}

async function readEvents(res, reply, timing, onChange) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) applyEvent(reply, data, timing);
    }
    onChange();
  }
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body.error?.message ?? body.message ?? res.statusText;
  } catch {
    return res.status + " " + res.statusText;
  }
}

function finishStats(reply, timing) {
  const seconds = (performance.now() - timing.start) / 1000;
  if (reply.usage) reply.stats = { seconds, ...reply.usage };
}

async function generate() {
  const chat = currentChat();
  const body = requestBody(chat);
  const reply = { role: "assistant", content: "", reasoning: "", tools: [] };
  chat.messages.push(reply);
  state.controller = new AbortController();
  setBusy(true);
  const node = renderChat();
  const update = () => fillAssistant(node, reply, chat.messages.length - 1, true);
  const timing = { start: performance.now(), first: null };
  try {
    const res = await api("/v1/chat/completions", body, state.controller.signal);
    if (res.ok) await readEvents(res, reply, timing, update);
    else reply.error = await errorText(res);
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = String(e.message ?? e);
  } finally {
    state.controller = null;
    finishStats(reply, timing);
    setBusy(false);
    save();
    renderChat();
  }
}

async function send(text) {
  const chat = currentChat();
  if (!chat.messages.length && chat.title === "New chat") chat.title = text.slice(0, 40);
  chat.messages.push({ role: "user", content: text });
  save();
  renderList();
  await generate();
}

// ---- rendering ----

function button(label, onClick, className) {
  const b = element("button", label);
  b.type = "button";
  if (className) b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

function statsText(reply) {
  if (reply.stopped) return "stopped";
  if (!reply.stats) return "";
  const { seconds, prompt_tokens: p, completion_tokens: c } = reply.stats;
  const rate = seconds > 0 ? (c / seconds).toFixed(1) : "–";
  return `${rate} tokens/s · prompt ${p} · completion ${c}`;
}

function fillAssistant(node, reply, index, streaming) {
  const split = splitThinking(reply.content);
  const reasoning = (reply.reasoning + "\n" + split.reasoning).trim();
  node.replaceChildren();
  if (reasoning) {
    const details = element("details", element("summary", "Reasoning"), element("div", reasoning));
    details.lastChild.className = "reasoning";
    node.append(details);
  }
  for (const call of reply.tools) {
    const tool = element("div", element("strong", "Tool call: "), element("code", call.name),
                         element("pre", call.arguments));
    tool.className = "tool";
    node.append(tool);
  }
  node.append(renderMarkdown(split.answer));
  if (reply.error) node.append(Object.assign(element("p", reply.error), { className: "error" }));
  if (!streaming) node.append(meta(statsText(reply), index));
}

function meta(text, index) {
  const bar = element("div", element("span", text));
  bar.className = "meta";
  const chat = currentChat();
  if (index === chat.messages.length - 1) bar.append(button("Regenerate", () => regenerate(index)));
  return bar;
}

function regenerate(index) {
  if (state.controller || !state.ready) return;
  currentChat().messages.splice(index);
  generate();
}

function fillUser(node, message, index) {
  node.replaceChildren(message.content);
  const bar = element("div");
  bar.className = "meta";
  bar.append(button("Edit", () => editUser(node, message, index)));
  node.append(bar);
}

function editUser(node, message, index) {
  if (state.controller) return;
  const area = element("textarea", message.content);
  area.rows = 4;
  const resend = () => {
    currentChat().messages.splice(index);
    send(area.value);
  };
  node.replaceChildren(area, button("Send", resend), button("Cancel", renderChat));
  area.focus();
}

function renderChat() {
  const chat = currentChat();
  const box = $("messages");
  box.replaceChildren();
  let last = null;
  chat.messages.forEach((message, index) => {
    last = element("div");
    last.className = "msg " + (message.role === "user" ? "user" : "assistant");
    if (message.role === "user") fillUser(last, message, index);
    else fillAssistant(last, message, index, state.controller !== null && index === chat.messages.length - 1);
    box.append(last);
  });
  box.scrollTop = box.scrollHeight;
  renderList();
  return last;
}

function renderList() {
  const list = $("chats");
  list.replaceChildren();
  for (const chat of state.chats) {
    const item = element("li", button(chat.title, () => select(chat.id), "title"),
                         button("✎", () => rename(item, chat), "small"), button("×", () => remove(chat.id), "small"));
    item.firstChild.title = chat.title;
    item.lastChild.title = "Delete";
    item.children[1].title = "Rename";
    if (chat.id === state.current) item.className = "current";
    list.append(item);
  }
}

function select(id) {
  if (state.controller) return;
  state.current = id;
  renderChat();
}

function rename(item, chat) {
  const input = Object.assign(element("input"), { value: chat.title });
  const done = () => {
    chat.title = input.value.trim() || chat.title;
    save();
    renderList();
  };
  input.addEventListener("keydown", (e) => e.key === "Enter" && input.blur());
  input.addEventListener("blur", done);
  item.replaceChildren(input);
  input.focus();
}

function remove(id) {
  if (state.controller || !confirm("Delete this conversation?")) return;
  state.chats = state.chats.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.chats[0]?.id ?? null;
  save();
  renderChat();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("send").disabled = !state.ready;
}

// ---- import and export ----

function exportChats() {
  const blob = new Blob([JSON.stringify(state.chats, null, 2)], { type: "application/json" });
  const a = Object.assign(element("a"), { href: URL.createObjectURL(blob), download: "jaxstation-chats.json" });
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function cleanMessage(m) {
  const role = ["user", "assistant"].includes(m?.role) ? m.role : null;
  if (!role) return null;
  const message = { role, content: String(m.content ?? "") };
  if (role === "assistant") Object.assign(message, { reasoning: String(m.reasoning ?? ""), tools: [] });
  return message;
}

function importChats(text) {
  const given = JSON.parse(text);
  const chats = (Array.isArray(given) ? given : [given]).filter((c) => Array.isArray(c?.messages)).map((c) => ({
    id: newId(), title: String(c.title ?? "Imported chat"), messages: c.messages.map(cleanMessage).filter(Boolean),
  }));
  state.chats.unshift(...chats);
  if (chats.length) state.current = chats[0].id;
  save();
  renderChat();
}

// ---- settings and start-up ----

const SETTING_FIELDS = ["system", "temperature", "max-tokens", "seed"];

function loadSettings() {
  const saved = read(STORE.settings, {});
  for (const id of SETTING_FIELDS) {
    $(id).value = saved[id] ?? "";
    $(id).addEventListener("change", () => {
      localStorage.setItem(STORE.settings, JSON.stringify(Object.fromEntries(SETTING_FIELDS.map((f) => [f, $(f).value]))));
    });
  }
}

async function waitReady() {
  const status = $("status");
  for (;;) {
    let body = {};
    try {
      const res = await fetch("/ready", { cache: "no-store" });
      body = await res.json();
      if (res.ok) break;
    } catch {
      body = { status: "unreachable" };
    }
    status.hidden = false;
    status.className = body.status === "failed" ? "failed" : "";
    status.textContent = body.status === "failed" ? "The station failed to load its model; see its log."
      : `The station is ${body.status ?? "loading"}… waiting for it to be ready.`;
    await new Promise((r) => setTimeout(r, 1000));
  }
  status.hidden = true;
  state.ready = true;
  setBusy(false);
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller || !state.ready) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => select(null));
  $("export").addEventListener("click", exportChats);
  $("import").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    if (file) importChats(await file.text());
    e.target.value = "";
  });
  $("forget-key").addEventListener("click", () => localStorage.removeItem(STORE.key));
}

function start() {
  state.current = state.chats[0]?.id ?? null;
  wire();
  loadSettings();
  setBusy(false);
  renderChat();
  waitReady();
}

window.jaxstation = { renderMarkdown, splitThinking };
start();
