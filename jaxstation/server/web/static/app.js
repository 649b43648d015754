// The chat page: conversations, sending and streaming, and the page's start. Each other concern is a module of its
// own: answer.js (an assistant turn, drawn as it streams), markdown.js (rendering answers as DOM nodes, never HTML),
// code.js and highlight.js (code blocks), api.js (the key and the station's API), models.js (the picker), context.js
// (the context left), files.js (attached files), settings.js, theme.js and station.js (the live panel). Conversations
// live in localStorage; where it is full, or a file or an event cannot be read, a notice says so and the page goes on.

import { $, button, element, notice, read, write } from "./dom.js";
import { api, errorText, forgetKey, readEvents } from "./api.js";
import { AnswerView } from "./answer.js";
import { contextOf, loadModels, pickedModel, showModel } from "./models.js";
import { chatTokens, showContext, wontFit } from "./context.js";
import { clearFiles, fileChips, waitingFiles, wireFiles, withFiles } from "./files.js";
import { settings, wireSettings } from "./settings.js";
import { wireTheme } from "./theme.js";
import { wireStation } from "./station.js";

const CHATS = "jaxstation.chats";
const state = { chats: read(CHATS, []), current: null, controller: null, ready: false };

function save() {
  write(CHATS, JSON.stringify(state.chats));
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

// ---- the request and its stream ----

function requestBody(chat) {
  const { system, ...sampling } = settings();
  const messages = chat.messages.filter((m) => !m.error)
    .map((m) => ({ role: m.role, content: m.role === "user" ? withFiles(m.content, m.files) : m.content }));
  if (system.trim()) messages.unshift({ role: "system", content: system });
  return { model: chat.model, messages, stream: true, stream_options: { include_usage: true }, ...sampling };
}

const listed = (value) => (Array.isArray(value) ? value : []);

function applyDelta(reply, delta) {
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const call of listed(delta.tool_calls)) {
    const slot = (reply.tools[call.index ?? 0] ??= { name: "", arguments: "" });
    slot.name += call.function?.name ?? "";
    slot.arguments += call.function?.arguments ?? "";
  }
}

// One event of the stream; one that is not a JSON object is left out, and a notice says so.
function applyEvent(reply, data) {
  if (data === "[DONE]") return;
  let chunk = null;
  try {
    chunk = JSON.parse(data);
  } catch {
    // below
  }
  if (chunk === null || typeof chunk !== "object") {
    notice("The station sent an event this page could not read; the answer goes on without it.");
    return;
  }
  if (chunk.error) reply.error = chunk.error.message ?? JSON.stringify(chunk.error);
  for (const choice of listed(chunk.choices)) applyDelta(reply, choice?.delta ?? {});
  if (chunk.usage) reply.usage = chunk.usage;
}

// Stream the answer to `body` (default: the chat as it stands) into a new assistant turn.
async function generate(body) {
  const chat = currentChat();
  const request = body ?? requestBody(chat);
  const reply = { role: "assistant", content: "", reasoning: "", tools: [] };
  chat.messages.push(reply);
  state.controller = new AbortController();
  setBusy();
  const view = renderChat();
  const start = performance.now();
  try {
    const res = await api("/v1/chat/completions", request, state.controller.signal);
    if (res.ok) await readEvents(res, (data) => applyEvent(reply, data), () => view.update(reply));
    else reply.error = await errorText(res);
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = String(e.message ?? e);
  } finally {
    state.controller = null;
    if (reply.usage) reply.stats = { seconds: (performance.now() - start) / 1000, ...reply.usage };
    setBusy();
    view.update(reply, true);
    view.node.append(meta(statsText(reply), chat.messages.length - 1));
    save();
    showChat(chat);
  }
}

// Send `text` (and `files`) as the chat's next turn, unless it would not fit the model's context: then say so and
// return false, the conversation unchanged.
async function send(text, files) {
  const chat = currentChat();
  chat.model = pickedModel();
  const message = { role: "user", content: text, ...(files.length ? { files } : {}) };
  const body = requestBody({ ...chat, messages: [...chat.messages, message] });
  setBusy(true);
  const refusal = await wontFit(body, contextOf(chat.model));
  setBusy();
  notice(refusal);
  if (refusal) return false;
  if (!chat.messages.length && chat.title === "New chat") chat.title = (text || files[0].name).slice(0, 40);
  chat.messages.push(message);
  save();
  generate(body);
  return true;
}

// ---- rendering ----

function statsText(reply) {
  if (reply.stopped) return "stopped";
  if (!reply.stats) return "";
  const { seconds, prompt_tokens: p, completion_tokens: c } = reply.stats;
  const rate = seconds > 0 ? (c / seconds).toFixed(1) : "–";
  return `${rate} tokens/s · prompt ${p} · completion ${c}`;
}

// Draw an assistant turn into `node`; a finished one (not `streaming`) with its figures. Returns its view.
function showAssistant(node, reply, index, streaming) {
  const view = new AnswerView(node);
  view.update(reply, !streaming);
  if (!streaming) node.append(meta(statsText(reply), index));
  return view;
}

function meta(text, index) {
  const bar = element("div", element("span", text));
  bar.className = "meta";
  if (index === currentChat().messages.length - 1) bar.append(button("Regenerate", () => regenerate(index)));
  return bar;
}

function regenerate(index) {
  if (state.controller || !state.ready) return;
  currentChat().messages.splice(index);
  generate();
}

function fillUser(node, message, index) {
  node.replaceChildren(message.content);
  if (message.files?.length) node.append(fileChips(message.files));
  const bar = element("div");
  bar.className = "meta";
  bar.append(button("Edit", () => editUser(node, message, index)));
  node.append(bar);
}

function editUser(node, message, index) {
  if (state.controller) return;
  const area = element("textarea", message.content);
  area.rows = 4;
  const resend = async () => {
    const chat = currentChat();
    const kept = chat.messages.splice(index);
    if (!(await send(area.value, message.files ?? []))) chat.messages.push(...kept);
  };
  node.replaceChildren(area, button("Send", resend), button("Cancel", renderChat));
  area.focus();
}

// Draw the current conversation; returns the view of its last turn where that is an assistant's.
function renderChat() {
  const chat = currentChat();
  const box = $("messages");
  box.replaceChildren();
  let last = null;
  chat.messages.forEach((message, index) => {
    const node = element("div");
    node.className = "msg " + (message.role === "user" ? "user" : "assistant");
    box.append(node);
    if (message.role === "user") fillUser(node, message, index);
    else last = showAssistant(node, message, index, state.controller !== null && index === chat.messages.length - 1);
  });
  showChat(chat);
  return last;
}

// What goes with the conversation on screen: scrolled to its end, the context it leaves, the list of conversations.
function showChat(chat) {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
  showContext(chatTokens(chat), contextOf(showModel(chat.model)));
  renderList();
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
  notice("");
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

// Send turns into Stop while an answer streams, and is off while a turn is being checked or the station loads.
function setBusy(checking = false) {
  $("send").hidden = state.controller !== null;
  $("stop").hidden = state.controller === null;
  $("send").disabled = checking || !state.ready;
}

// ---- import and export ----

function exportChats() {
  const blob = new Blob([JSON.stringify(state.chats, null, 2)], { type: "application/json" });
  const a = Object.assign(element("a"), { href: URL.createObjectURL(blob), download: "jaxstation-chats.json" });
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function cleanFile(f) {
  return { name: String(f?.name ?? "file"), size: Number(f?.size) || 0, text: String(f?.text ?? "") };
}

function cleanMessage(m) {
  const role = ["user", "assistant"].includes(m?.role) ? m.role : null;
  if (!role) return null;
  const message = { role, content: String(m.content ?? "") };
  if (role === "assistant") Object.assign(message, { reasoning: String(m.reasoning ?? ""), tools: [] });
  if (role === "user" && Array.isArray(m.files)) message.files = m.files.map(cleanFile);
  return message;
}

// The conversations an exported file holds, or the reason it holds none.
function exported(text) {
  let given;
  try {
    given = JSON.parse(text);
  } catch (e) {
    return { refused: `it is not JSON (${e.message})` };
  }
  const chats = (Array.isArray(given) ? given : [given]).filter((c) => Array.isArray(c?.messages)).map((c) => ({
    id: newId(), title: String(c.title ?? "Imported chat"), messages: c.messages.map(cleanMessage).filter(Boolean),
    ...(typeof c.model === "string" ? { model: c.model } : {}),
  }));
  return chats.length ? { chats } : { refused: "it holds no conversations" };
}

function importChats(name, text) {
  const { chats, refused } = exported(text);
  if (refused) {
    notice(`${name} was not imported: ${refused}.`);
    return;
  }
  notice("");
  state.chats.unshift(...chats);
  state.current = chats[0].id;
  save();
  renderChat();
}

// ---- start-up ----

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
  await loadModels();
  state.ready = true;
  setBusy();
  renderChat();
}

function wire() {
  $("composer").addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    const files = waitingFiles();
    if ((!text.trim() && !files.length) || state.controller || $("send").disabled) return;
    if (await send(text, files)) {
      $("prompt").value = "";
      clearFiles();
    }
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => select(null));
  $("model").addEventListener("change", () => {
    const chat = currentChat();
    chat.model = pickedModel();
    save();
    showContext(chatTokens(chat), contextOf(chat.model));
  });
  $("export").addEventListener("click", exportChats);
  $("import").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    if (file) importChats(file.name, await file.text());
    e.target.value = "";
  });
  $("forget-key").addEventListener("click", forgetKey);
}

function start() {
  state.current = state.chats[0]?.id ?? null;
  wire();
  wireFiles();
  wireSettings();
  wireTheme();
  wireStation();
  setBusy();
  renderChat();
  waitReady();
}

start();
