// The station's API as the page calls it. The API key lives in localStorage and goes out as an Authorization header,
// never in a URL; the first call answered 401 asks for it (once, however many calls were refused together).

import { $, write } from "./dom.js";

const KEY = "jaxstation.key";
let asking = null;

function askKey() {
  asking ??= new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key").value = "";
    dialog.addEventListener("close", () => {
      write(KEY, $("key").value.trim());
      asking = null;
      resolve();
    }, { once: true });
    dialog.showModal();
  });
  return asking;
}

export function forgetKey() {
  localStorage.removeItem(KEY);
}

// GET `path`, or POST `body` as JSON; asks for the key once on a 401 and tries again.
export async function api(path, body, signal) {
  for (let attempt = 0; ; attempt += 1) {
    const headers = body === undefined ? {} : { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    const res = await fetch(path, { method: body === undefined ? "GET" : "POST", headers, signal, cache: "no-store",
                                    body: body === undefined ? undefined : JSON.stringify(body) });
    if (res.status !== 401 || attempt > 0) return res;
    await askKey();
  }
}

export async function errorText(res) {
  try {
    const body = await res.json();
    return body.error?.message ?? body.message ?? res.statusText;
  } catch {
    return res.status + " " + res.statusText;
  }
}

// Read a server-sent event stream, calling onData with each event's data and onChange after each network read.
export async function readEvents(res, onData, onChange) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) onData(data);
    }
    onChange();
  }
}
