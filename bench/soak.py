"""Soak: a real station under a mixed load with clients that go away, and what it holds afterwards.

Starts `python -m jaxstation serve` (the default SmolLM2 model, continuous batching, 127.0.0.1 only) and, for
`--duration` seconds, keeps `--concurrency` clients busy with chat completions, Responses, Messages (each streamed or
not, through the official `openai` and `anthropic` SDKs) and `/generate` requests. A share of them (`--disconnect`)
is cut at a random point: the client's task is cancelled, which closes its connection mid-request or mid-stream.
Then it checks what must hold: every lane free and the queue at 0 (read from /metrics), and the station's RSS flat
(sampled every `--rss-every` seconds from /proc: first, last and max, and the growth from the first sample after the
warm-up quarter to the last). Everything runs in this one process's event loop; the station is its own process.

Usage:
  python -m bench.soak                    # 600 s, 6 clients, a third of them cut
  python -m bench.soak --duration 20      # a short check
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai

from bench.common import wait_ready, write_result
from bench.workload import REPO, free_port

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = ("Say hello in French.", "What is the capital of Italy?", "Write a haiku about rain.",
           "List three colors.", "Explain what a queue is in one sentence.", "Count from one to ten.")
KINDS = ("chat", "responses", "messages", "generate")


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def gauge(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


class Clients:
    """The SDK clients on one station, and what one request of each kind sends."""

    def __init__(self, base: str, tokens: list[list[int]]) -> None:
        self.openai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.anthropic = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
        self.http = httpx.AsyncClient(base_url=base, timeout=300)
        self.tokens = tokens

    async def run(self, kind: str, stream: bool, rng: random.Random) -> None:
        """One request, read to its end (a stream event by event)."""
        prompt, n = rng.choice(PROMPTS), rng.randint(4, 64)
        ask = [{"role": "user", "content": prompt}]
        if kind == "generate":
            r = await self.http.post("/generate", json={"tokens": rng.choice(self.tokens), "max_new_tokens": n,
                                                        "temperature": 0.7, "seed": rng.randrange(1 << 30)})
            r.raise_for_status()
            return
        if kind == "chat":
            reply = await self.openai.chat.completions.create(model=MODEL, messages=ask, max_tokens=n, stream=stream,
                                                              temperature=0.7)
        elif kind == "responses":
            reply = await self.openai.responses.create(model=MODEL, input=ask, max_output_tokens=n, stream=stream,
                                                       store=False, temperature=0.7)
        else:
            reply = await self.anthropic.messages.create(model=MODEL, messages=ask, max_tokens=n, stream=stream)
        if stream:
            async for _ in reply:
                pass

    async def close(self) -> None:
        await self.openai.close()
        await self.anthropic.close()
        await self.http.aclose()


async def client_loop(clients: Clients, deadline: float, disconnect: float, seed: int, tally: dict) -> None:
    """Requests back to back until the deadline; a `disconnect` share cancelled after a random wait."""
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind = rng.choice(KINDS)
        stream = kind != "generate" and rng.random() < 0.5
        key = f"{kind}{'_stream' if stream else ''}"
        tally["sent"][key] += 1
        cut = rng.uniform(0.05, 4.0) if rng.random() < disconnect else None
        try:
            await asyncio.wait_for(clients.run(kind, stream, rng), cut)
            tally["completed"][key] += 1
        except TimeoutError:
            tally["disconnected"][key] += 1
        except Exception as e:  # a reply that failed: counted and shown, the soak goes on
            tally["errors"][key] += 1
            tally["error_messages"].append(f"{key}: {type(e).__name__}: {str(e)[:200]}")


async def sample_rss(pid: int, every: float, until: asyncio.Event, samples: list) -> None:
    start = time.monotonic()
    while not until.is_set():
        samples.append((round(time.monotonic() - start, 1), rss_bytes(pid)))
        try:
            await asyncio.wait_for(until.wait(), every)
        except TimeoutError:
            pass
    samples.append((round(time.monotonic() - start, 1), rss_bytes(pid)))


async def settle(http: httpx.AsyncClient, timeout: float) -> dict:
    """Wait until no lane is busy and the queue is empty (or the timeout): the last /metrics readings."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await http.get("/metrics")).text
        state = {k: gauge(text, f"jaxstation_{k}") for k in ("busy_lanes", "queue_depth")}
        if state == {"busy_lanes": 0.0, "queue_depth": 0.0} or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def soak(args: argparse.Namespace, base: str, pid: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        tokens = [(await http.post("/tokenize", json={"prompt": p})).json()["tokens"] for p in PROMPTS]
        clients = Clients(base, tokens)
        tally = {k: collections.Counter() for k in ("sent", "completed", "disconnected", "errors")}
        tally["error_messages"] = []
        samples: list = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, args.rss_every, stop, samples))
        t0 = time.monotonic()
        deadline = t0 + args.duration
        await asyncio.gather(*(client_loop(clients, deadline, args.disconnect, args.seed + i, tally)
                               for i in range(args.concurrency)))
        ran = time.monotonic() - t0
        end = await settle(http, 60)
        stop.set()
        await sampler
        await clients.close()
    rss = [b for _, b in samples]
    warm = next(b for t, b in samples if t >= args.duration / 4) if ran >= args.duration / 4 else rss[0]
    return {"duration_s": round(ran, 1), "concurrency": args.concurrency, "disconnect_share": args.disconnect,
            **{k: dict(tally[k]) for k in ("sent", "completed", "disconnected", "errors")},
            "totals": {k: sum(tally[k].values()) for k in ("sent", "completed", "disconnected", "errors")},
            "error_messages": tally["error_messages"][:20], "end": end,
            "lanes_free": end["busy_lanes"] == 0, "queue_empty": end["queue_depth"] == 0,
            "rss_mib": {"first": rss[0] / 2**20, "after_warmup": warm / 2**20, "last": rss[-1] / 2**20,
                        "max": max(rss) / 2**20, "growth_after_warmup": (rss[-1] - warm) / 2**20},
            "rss_samples": [(t, round(b / 2**20, 1)) for t, b in samples]}


def start_station(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "MOONSHINE_CONTINUOUS_BATCH": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=6, help="clients at once")
    ap.add_argument("--disconnect", type=float, default=0.33, help="share of requests cut at a random point")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("/tmp/jaxstation-soak.log"), help="the station's output")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_station(port, args.log)
    try:
        wait_ready(proc, base, 900)
        result = asyncio.run(soak(args, base, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    result["exit_code"] = code
    result["ok"] = result["lanes_free"] and result["queue_empty"] and result["totals"]["errors"] == 0 and code == 0
    path = write_result("soak", result)
    print({k: v for k, v in result.items() if k != "rss_samples"})
    print(f"wrote {path}")
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
