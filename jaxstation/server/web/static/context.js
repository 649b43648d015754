// The context left, beside the input: the conversation's tokens (the last reply's prompt and completion tokens, from
// its stream's usage chunk) against the picked model's `max_model_len`. Before a turn goes out, the station's
// /tokenize counts its prompt exactly, so a turn that would not fit is stopped on the page with a message instead.

import { $ } from "./dom.js";
import { api } from "./api.js";

// The tokens `chat` holds: its last answered turn's prompt and completion.
export function chatTokens(chat) {
  const last = chat.messages.findLast((m) => m.role === "assistant" && m.stats);
  return last ? last.stats.prompt_tokens + last.stats.completion_tokens : 0;
}

export function showContext(used, limit) {
  const meter = $("context-meter");
  const text = $("context-text");
  meter.hidden = !limit;
  if (!limit) {
    text.textContent = used ? `${used} tokens` : "";
    return;
  }
  Object.assign(meter, { max: limit, value: Math.min(used, limit), optimum: 0, low: limit * 0.5, high: limit * 0.8 });
  text.textContent = `${used} / ${limit} tokens`;
  text.title = `the conversation holds ${used} of the model's ${limit} tokens of context`;
  $("context").classList.toggle("full", used >= limit);
}

// Why `body` (a chat request) would not fit in `limit` tokens, or null if it fits or cannot be counted.
export async function wontFit(body, limit) {
  if (!limit) return null;
  let count;
  try {
    const res = await api("/tokenize", { model: body.model, messages: body.messages, add_generation_prompt: true });
    if (!res.ok) return null;
    count = (await res.json()).count;
  } catch {
    return null;
  }
  const room = body.max_tokens ?? 1;
  if (count + room <= limit) return null;
  const asked = body.max_tokens ? ` plus the ${body.max_tokens} to generate` : "";
  return `This turn does not fit: its prompt is ${count} tokens${asked}, and the model's context holds ${limit}. `
    + "Start a new chat, or shorten the message or its files.";
}
