// Markdown to DOM nodes, never HTML: paragraphs, headings, lists, code fences, inline code, bold, italic and links.
// Model output is only ever put into the page as text nodes; a link is made only for an http(s) URL; a code fence
// becomes a code view (code.js).

import { element } from "./dom.js";
import { codeView } from "./code.js";

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([\s\S]+?)\*\*|__([\s\S]+?)__|\*([^*\s](?:[^*]*[^*\s])?)\*|_([^_\s](?:[^_]*[^_\s])?)_|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
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
  out.append(codeView(body.join("\n"), lang));
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

export function renderMarkdown(text) {
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
export function splitThinking(content) {
  const start = content.indexOf("<think>");
  if (start < 0) return { reasoning: "", answer: content };
  const end = content.indexOf("</think>", start);
  const reasoning = content.slice(start + 7, end < 0 ? undefined : end);
  const answer = content.slice(0, start) + (end < 0 ? "" : content.slice(end + 8));
  return { reasoning: reasoning.trim(), answer: answer.trim() };
}
