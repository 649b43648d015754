// The station live: a panel that reads GET /station/status every second while it is open and the tab is visible, and
// shows each lane (free, holding a cached prefix, prefilling, decoding), the queue, tokens per second over the last
// minutes and the prefix cache's hits. The route answers from a snapshot the station's decode thread publishes, so
// polling it takes nothing from the requests being served.

import { $, element } from "./dom.js";
import { api, errorText } from "./api.js";

const PERIOD_MS = 1000;
let polling = false;

function laneText(lane) {
  if (lane.state === "prefilling") return `prefilling ${lane.fed} / ${lane.prompt_tokens}`;
  if (lane.state === "decoding") return `decoding: ${lane.prompt_tokens} + ${lane.generated} tokens`;
  if (lane.state === "cached") return `free, holding ${lane.prompt_tokens} cached tokens`;
  return "free";
}

function chart(rates, bucket) {
  const top = Math.max(...rates, 1);
  return rates.map((rate, i) => {
    const bar = element("span");
    bar.style.height = `${(100 * rate) / top}%`;
    bar.title = `${rate.toFixed(1)} tokens/s, ${(rates.length - i) * bucket} s ago`;
    return bar;
  });
}

function render(s) {
  $("station-state").textContent = `${s.status}${s.at ? ", as of " + new Date(s.at * 1000).toLocaleTimeString() : ""}`;
  $("lanes").replaceChildren(...s.lanes.map((lane, i) => {
    const item = element("li", element("strong", `lane ${i}`), element("span", laneText(lane)));
    item.dataset.state = lane.state;
    return item;
  }));
  const busy = s.lanes.filter((l) => l.state === "prefilling" || l.state === "decoding").length;
  $("lanes-summary").textContent = `${busy} of ${s.lanes.length} busy`;
  $("queue").textContent = `${s.queued} waiting (at most ${s.max_queue})`;
  const { generated, prefilled, bucket_s: bucket } = s.throughput;
  $("rate").textContent = `${generated.at(-1)?.toFixed(1) ?? 0} generated, ${prefilled.at(-1)?.toFixed(1) ?? 0} `
    + `prefilled (the last ${bucket} s); ${s.generated_tokens} generated in all`;
  $("rate-chart").replaceChildren(...chart(generated, bucket));
  $("rate-chart").title = `tokens generated per second, the last ${(generated.length * bucket) / 60} minutes`;
  const { lookups, hits, reused_tokens: reused } = s.prefix_cache;
  const share = lookups ? ` (${Math.round((100 * hits) / lookups)}%)` : "";
  $("prefix").textContent = `${hits} hits of ${lookups} lookups${share}, ${reused} prompt tokens reused`;
}

async function poll() {
  const panel = $("station");
  while (!panel.hidden) {
    if (document.visibilityState === "visible") {
      try {
        const res = await api("/station/status");
        if (res.ok) render(await res.json());
        else $("station-state").textContent = await errorText(res);
      } catch (e) {
        $("station-state").textContent = `unreachable (${e.message ?? e})`;
      }
    }
    await new Promise((resolve) => setTimeout(resolve, PERIOD_MS));
  }
  polling = false;
}

export function wireStation() {
  $("station-toggle").addEventListener("click", () => {
    const panel = $("station");
    panel.hidden = !panel.hidden;
    $("station-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    if (!panel.hidden && !polling) {
      polling = true;
      poll();
    }
  });
}
