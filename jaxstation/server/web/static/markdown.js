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

// Each block reader takes the rows and the row its block starts at, and says what it made: the block's node (none for
// a blank row), the row after it, and the last row it read (a paragraph or a list reads the row that ends it).

function codeBlock(rows, i, highlighted) {
  const [, fence, lang] = rows[i].match(FENCE);
  const body = [];
  for (i += 1; i < rows.length && !rows[i].trim().startsWith(fence); i += 1) body.push(rows[i]);
  // an unterminated fence (an answer still streaming) is shown plain, and highlighted once it closes
  return { node: codeView(body.join("\n"), lang, highlighted || i < rows.length), next: i + 1, read: i };
}

function list(rows, i) {
  const ordered = /\d/.test(rows[i].match(ITEM)[1]);
  const node = document.createElement(ordered ? "ol" : "ul");
  for (; i < rows.length && ITEM.test(rows[i]); i += 1) node.append(element("li", ...inline(rows[i].match(ITEM)[2])));
  return { node, next: i, read: i };
}

function paragraph(rows, i) {
  const body = [];
  for (; i < rows.length && rows[i].trim() && !FENCE.test(rows[i]) && !ITEM.test(rows[i]); i += 1) body.push(rows[i]);
  return { node: element("p", ...lines(body)), next: i, read: i };
}

function block(rows, i, highlighted) {
  const heading = rows[i].match(HEADING);
  if (!rows[i].trim()) return { node: null, next: i + 1, read: i };
  if (FENCE.test(rows[i])) return codeBlock(rows, i, highlighted);
  if (ITEM.test(rows[i])) return list(rows, i);
  if (heading) {
    const node = element("h" + Math.min(heading[1].length + 2, 6), ...inline(heading[2]));
    return { node, next: i + 1, read: i };
  }
  return paragraph(rows, i);
}

const normal = (text) => String(text).replace(/\r\n?/g, "\n");

export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const rows = normal(text).split("\n");
  for (let i = 0; i < rows.length;) {
    const { node, next } = block(rows, i, true);
    if (node) out.append(node);
    i = next;
  }
  return out;
}

// Markdown that streams into `box`, drawn in time linear in its length: a block that no later text can change (every
// row it read is complete, so not the last row) is drawn once and kept; each update draws again only the blocks from
// the first that may still change. Text that does not extend what was kept (a <think> that opens late) starts over.
export class MarkdownView {
  constructor(box) {
    this.box = box;
    this.kept = ""; // the text of the blocks drawn for good
    this.live = []; // the nodes of the blocks that may still change
  }

  update(text, final = false) {
    text = normal(text);
    if (!text.startsWith(this.kept)) {
      this.box.replaceChildren();
      this.kept = "";
    }
    for (const node of this.live) node.remove();
    this.live = [];
    const rows = text.slice(this.kept.length).split("\n");
    for (let i = 0; i < rows.length;) {
      const { node, next, read } = block(rows, i, final);
      const done = !final && !this.live.length && read < rows.length - 1;
      if (node) this.box.append(node);
      if (done) this.kept += rows.slice(i, next).map((row) => row + "\n").join("");
      else if (node) this.live.push(node);
      i = next;
    }
  }
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
