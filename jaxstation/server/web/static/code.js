// A code block as the page shows it: its language, a Copy button, and the code highlighted (highlight.js) where the
// language is one the page knows. Copying uses the clipboard API, or where the page has none (it is served over plain
// HTTP from another host, which browsers do not count as a secure context) a selected text area and the browser's
// copy command.

import { button, element } from "./dom.js";
import { highlight, languageOf } from "./highlight.js";

async function copyText(text) {
  if (navigator.clipboard?.writeText) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // refused (no permission, the page not focused): try the copy command
    }
  }
  const area = element("textarea");
  area.value = text;
  area.readOnly = true;
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  try {
    return document.execCommand("copy");
  } catch {
    return false;
  } finally {
    area.remove();
  }
}

// `highlighted` false: the code as plain text (a block still streaming in, highlighted once it is whole).
export function codeView(text, info, highlighted = true) {
  const lang = languageOf(info);
  const code = element("code", lang && highlighted ? highlight(text, lang) : text);
  if (info) code.className = "language-" + info;
  const copy = button("Copy", async () => {
    copy.textContent = (await copyText(text)) ? "Copied" : "Copy failed";
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  }, "copy");
  copy.title = "Copy the code";
  const head = element("div", element("span", info || "text"), copy);
  head.className = "code-head";
  const box = element("div", head, element("pre", code));
  box.className = "code";
  return box;
}
