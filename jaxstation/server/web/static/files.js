// Files as part of a message: dropped on the page, pasted into the input, or picked with Attach. A text or code file
// is read as UTF-8 and waits as a chip (its name and size) until the message is sent, where its text follows the
// message in a fence named after the file. A binary file (a NUL byte, or bytes that are not UTF-8) or one over
// MAX_FILE_BYTES is refused here, with a message, and never sent.

import { $, button, element, notice } from "./dom.js";

export const MAX_FILE_BYTES = 256 * 1024;
const waiting = [];

export function formatSize(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  return bytes < 1024 * 1024 ? `${(bytes / 1024).toFixed(1)} KiB` : `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}

// The file's text, or the reason it is refused.
async function readText(file) {
  if (file.size > MAX_FILE_BYTES) {
    return { refused: `it is ${formatSize(file.size)}, over the ${formatSize(MAX_FILE_BYTES)} a file may be` };
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (bytes.includes(0)) return { refused: "it is not text (it holds NUL bytes)" };
  try {
    return { text: new TextDecoder("utf-8", { fatal: true }).decode(bytes) };
  } catch {
    return { refused: "it is not text (not valid UTF-8)" };
  }
}

async function attach(files) {
  const refusals = [];
  for (const file of files) {
    const { text, refused } = await readText(file);
    if (refused) refusals.push(`${file.name} was not attached: ${refused}.`);
    else waiting.push({ name: file.name, size: file.size, text });
  }
  notice(refusals.join(" "));
  showWaiting();
}

// Chips for `files`; with `onRemove`, each has a button that removes it.
export function fileChips(files, onRemove) {
  const box = element("div");
  box.className = "chips";
  files.forEach((file, i) => {
    const chip = element("span", element("span", file.name), element("small", formatSize(file.size)));
    chip.className = "chip";
    chip.title = file.name;
    if (onRemove) chip.append(Object.assign(button("×", () => onRemove(i), "small"), { title: "Remove" }));
    box.append(chip);
  });
  return box;
}

function showWaiting() {
  $("attachments").replaceChildren(fileChips(waiting, (i) => {
    waiting.splice(i, 1);
    showWaiting();
  }));
}

// The files waiting for the next message.
export function waitingFiles() {
  return [...waiting];
}

// The message went out with them: the composer holds none.
export function clearFiles() {
  waiting.length = 0;
  showWaiting();
}

// A user message's text as the model reads it: the message, then each file in a fence longer than any in the file.
export function withFiles(text, files = []) {
  const parts = [text];
  for (const file of files) {
    const fence = "`".repeat(Math.max(3, ...[...file.text.matchAll(/`+/g)].map((m) => m[0].length + 1)));
    const lang = file.name.includes(".") ? file.name.slice(file.name.lastIndexOf(".") + 1) : "";
    parts.push(`${file.name}:\n${fence}${lang}\n${file.text}\n${fence}`);
  }
  return parts.filter((p) => p.trim()).join("\n\n");
}

export function wireFiles() {
  const main = document.querySelector("main");
  main.addEventListener("dragover", (e) => {
    if (e.dataTransfer?.types.includes("Files")) {
      e.preventDefault();
      main.classList.add("dropping");
    }
  });
  main.addEventListener("dragleave", (e) => {
    if (!main.contains(e.relatedTarget)) main.classList.remove("dropping");
  });
  main.addEventListener("drop", (e) => {
    main.classList.remove("dropping");
    if (!e.dataTransfer?.files.length) return;
    e.preventDefault();
    attach([...e.dataTransfer.files]);
  });
  $("prompt").addEventListener("paste", (e) => {
    if (!e.clipboardData?.files.length) return;
    e.preventDefault();
    attach([...e.clipboardData.files]);
  });
  $("attach").addEventListener("change", (e) => {
    attach([...e.target.files]);
    e.target.value = "";
  });
}
