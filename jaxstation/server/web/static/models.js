// The model picker: what GET /v1/models lists (every served name, then each LoRA adapter with the model it adapts).
// The picked name goes out as each request's `model` (an adapter's name runs the adapter), is kept per conversation,
// and its card's `max_model_len` is the context the page measures the conversation against.

import { $, element, write } from "./dom.js";
import { api } from "./api.js";

const LAST = "jaxstation.model"; // the last name picked: a new conversation starts on it
const cards = new Map();

function label(card) {
  return card.parent ? `${card.id} (LoRA adapter of ${card.parent})` : card.id;
}

// Fill the picker with `list` (the `data` of /v1/models).
function showModels(list) {
  cards.clear();
  for (const card of list) cards.set(card.id, card);
  const option = (card) => Object.assign(element("option", label(card)), { value: card.id });
  const bases = list.filter((c) => !c.parent).map(option);
  const adapters = list.filter((c) => c.parent).map(option);
  const select = $("model");
  select.replaceChildren(...bases);
  if (adapters.length) select.append(Object.assign(element("optgroup", ...adapters), { label: "LoRA adapters" }));
  select.disabled = list.length < 2;
}

export async function loadModels() {
  try {
    const res = await api("/v1/models");
    if (res.ok) showModels((await res.json()).data ?? []);
  } catch {
    // no list: requests go out without a model, and the station answers with its own
  }
}

// Show `name` in the picker if the station serves it, else the last picked or the first; returns what is shown.
export function showModel(name) {
  const select = $("model");
  const fallback = cards.has(localStorage.getItem(LAST)) ? localStorage.getItem(LAST) : cards.keys().next().value;
  select.value = cards.has(name) ? name : (fallback ?? "");
  return select.value || undefined;
}

// The name the picker shows, remembered as the one new conversations start on.
export function pickedModel() {
  const name = $("model").value || undefined;
  if (name) write(LAST, name);
  return name;
}

export function contextOf(name) {
  return cards.get(name)?.max_model_len ?? null;
}
