// Small DOM helpers the page's modules share. Text goes into the page only as text nodes (`append` of a string), never
// as HTML.

export const $ = (id) => document.getElementById(id);

export function element(tag, ...children) {
  const node = document.createElement(tag);
  for (const child of children) node.append(child);
  return node;
}

export function button(label, onClick, className) {
  const b = element("button", label);
  b.type = "button";
  if (className) b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

// A line under the input for what the page refused or cannot do (a file not attached, a turn that does not fit).
export function notice(text) {
  const box = $("notice");
  box.textContent = text ?? "";
  box.hidden = !text;
}

const FULL = "This browser's storage is full: what the page keeps (conversations, settings) is not saved. Delete or "
  + "export conversations to make room.";
const refused = new Set(); // the keys whose last write the browser refused

// Keep `value` under `key` in localStorage. Where the browser refuses (its storage is full: attached files are kept in
// every conversation), a notice says so and the page goes on; the notice goes once every key is kept again.
export function write(key, value) {
  try {
    localStorage.setItem(key, value);
  } catch (e) {
    refused.add(key);
    notice(e.name === "QuotaExceededError" ? FULL : `This browser did not keep it (${e.name}: ${e.message}).`);
    return false;
  }
  if (refused.delete(key) && !refused.size) notice("");
  return true;
}

export function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}
