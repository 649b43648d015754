// An assistant turn on the page: its reasoning (folded), its tool calls, its answer rendered from markdown and its
// error. While a reply streams in, each part is kept and added to, never drawn again whole (markdown.js's
// MarkdownView), so a long answer draws in time linear in its length; a stored reply is drawn the same way, once.

import { element } from "./dom.js";
import { MarkdownView, splitThinking } from "./markdown.js";

// Set a text node's text: appending only what is new where the new text extends the old.
function grow(node, text) {
  if (text.startsWith(node.data)) node.appendData(text.slice(node.data.length));
  else node.data = text;
}

export class AnswerView {
  constructor(node) {
    this.node = node;
    this.reasoning = null; // the folded reasoning's text, once there is any
    this.tools = []; // per tool call, the text of its name and of its arguments
    this.error = null;
    this.answer = new MarkdownView(element("div"));
    this.answer.box.className = "answer";
    node.append(this.answer.box);
  }

  // Show `reply` as it stands; `final`: nothing more arrives (an unterminated code block is highlighted too).
  update(reply, final = false) {
    const split = splitThinking(reply.content);
    this.showReasoning((reply.reasoning + "\n" + split.reasoning).trim());
    reply.tools.forEach((call, i) => this.showTool(call, i));
    this.answer.update(split.answer, final);
    this.showError(reply.error);
  }

  showReasoning(text) {
    if (!text && !this.reasoning) return;
    if (!this.reasoning) {
      this.reasoning = document.createTextNode("");
      const body = Object.assign(element("div", this.reasoning), { className: "reasoning" });
      this.node.prepend(element("details", element("summary", "Reasoning"), body));
    }
    grow(this.reasoning, text);
  }

  showTool(call, i) {
    if (!this.tools[i]) {
      this.tools[i] = { name: document.createTextNode(""), args: document.createTextNode("") };
      const tool = element("div", element("strong", "Tool call: "), element("code", this.tools[i].name),
                           element("pre", this.tools[i].args));
      tool.className = "tool";
      this.answer.box.before(tool);
    }
    grow(this.tools[i].name, call.name);
    grow(this.tools[i].args, call.arguments);
  }

  showError(text) {
    if (!text) return;
    if (!this.error) {
      this.error = Object.assign(element("p"), { className: "error" });
      this.node.append(this.error);
    }
    this.error.textContent = text;
  }
}
