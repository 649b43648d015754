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

export function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}
