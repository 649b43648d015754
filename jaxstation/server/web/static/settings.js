// The request's settings, kept in the browser: a system prompt, and sampling that starts at llama.cpp's web UI
// defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) until the user changes it. An emptied field sends
// nothing, so the station's own default applies; Reset restores the page's defaults.

import { $, write } from "./dom.js";

const STORE = "jaxstation.settings";
const DEFAULTS = { temperature: "0.8", "top-k": "40", "top-p": "0.95", "min-p": "0.05" };
const FIELDS = ["system", "temperature", "top-k", "top-p", "min-p", "max-tokens", "seed"];

function keep() {
  write(STORE, JSON.stringify(Object.fromEntries(FIELDS.map((f) => [f, $(f).value]))));
}

function show(values) {
  for (const id of FIELDS) $(id).value = values[id] ?? DEFAULTS[id] ?? "";
}

export function wireSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(STORE)) ?? {};
  } catch {
    // unreadable: the defaults
  }
  show(saved);
  for (const id of FIELDS) $(id).addEventListener("change", keep);
  $("reset-settings").addEventListener("click", () => {
    show({ system: $("system").value });
    keep();
  });
}

// The settings as request fields (undefined: not sent).
export function settings() {
  const number = (id, parse) => ($(id).value.trim() === "" ? undefined : parse($(id).value));
  const int = (v) => parseInt(v, 10);
  return {
    system: $("system").value,
    temperature: number("temperature", parseFloat),
    top_k: number("top-k", int),
    top_p: number("top-p", parseFloat),
    min_p: number("min-p", parseFloat),
    max_tokens: number("max-tokens", int),
    seed: number("seed", int),
  };
}
