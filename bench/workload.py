"""Shared workload pieces for the benches: fixed prompts, an instrumented engine, a station subprocess, HTTP clients.

Not a script: `bench.throughput`, `bench.latency`, `bench.roofline` and `bench.peers` import it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

# Plain English words; prompts are random sentences of them, encoded by the model's own tokenizer.
_WORDS = (
    "the a of and to in is was for on that with as by at from it this be are or an which his her their they "
    "river mountain city station train engine lamp garden window letter winter summer morning evening night "
    "story history science music painting market harbour island forest bridge village road field storm cloud "
    "teacher doctor farmer sailor writer student child mother father friend neighbour king queen soldier "
    "walked carried opened closed wrote read found lost built painted watched heard remembered followed "
    "quiet bright old new small large early late warm cold distant careful strange simple heavy gentle green "
    "because although while after before until since when where however therefore meanwhile finally"
).split()


def make_prompts(tokenizer, n: int, length: int | Sequence[int], seed: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` tokens (or lengths[i]), random English from a fixed seed, as token ids.

    The same (n, length, seed) gives the same ids on every run and for every system compared.
    """
    rng = np.random.default_rng(seed)
    lengths = [length] * n if isinstance(length, int) else list(length)
    out = []
    for want in lengths:
        ids: list[int] = []
        while len(ids) < want:
            words = rng.choice(_WORDS, size=max(16, want)).tolist()
            text = " ".join(words).capitalize() + "."
            ids += tokenizer.encode(text, add_special_tokens=False)
        out.append(ids[:want])
    return out


def percentiles(samples: Sequence[float], ps: Sequence[int] = (50, 95, 99)) -> dict:
    """{"p50": ..., "p95": ..., "p99": ..., "mean", "max", "n"} (None when there are no samples)."""
    if not samples:
        return {**{f"p{p}": None for p in ps}, "mean": None, "max": None, "n": 0}
    a = np.asarray(samples, np.float64)
    return {**{f"p{p}": float(np.percentile(a, p)) for p in ps}, "mean": float(a.mean()), "max": float(a.max()),
            "n": len(samples)}


def med_spread(samples: Sequence[float]) -> dict:
    """Median and spread (min, max) of repetitions."""
    if not samples:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


class StepTimer:
    """Wraps an Engine's `decode` and `prefill` (instance attributes, so the Scheduler calls the wrappers).

    Records each call's wall time and, for decode, how many rows were live: the lanes busy in that wave.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._decode, self._prefill = engine.decode, engine.prefill
        self.reset()
        engine.decode = self.decode
        engine.prefill = self.prefill

    def reset(self) -> None:
        self.decode_s: list[float] = []
        self.prefill_s: list[float] = []
        self.busy: list[int] = []

    def decode(self, rows, *a, **kw):
        t0 = time.perf_counter()
        out = self._decode(rows, *a, **kw)
        self.decode_s.append(time.perf_counter() - t0)
        self.busy.append(sum(r is not None for r in rows))
        return out

    def prefill(self, *a, **kw):
        t0 = time.perf_counter()
        out = self._prefill(*a, **kw)
        self.prefill_s.append(time.perf_counter() - t0)
        return out

    @property
    def step_s(self) -> float:
        return sum(self.decode_s) + sum(self.prefill_s)

    @property
    def waves(self) -> int:
        return len(self.decode_s) + len(self.prefill_s)

    def mean_busy(self) -> float | None:
        return statistics.fmean(self.busy) if self.busy else None


def first_executable(*candidates: str | None) -> str | None:
    """The first candidate path that is an executable file, or None."""
    for cand in candidates:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll url until it answers 200; raise RuntimeError if proc dies or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


@contextlib.contextmanager
def server_process(cmd: Sequence[str], ready_url: str, timeout_s: float = 300.0, log: Path | None = None,
                   env: dict | None = None) -> Iterator[subprocess.Popen]:
    """Start cmd, wait for ready_url to answer 200, yield the process, then terminate it."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **(env or {})})
    try:
        try:
            wait_http(ready_url, timeout_s, proc)
        except RuntimeError as e:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd[:4])}...: {e}\n{tail}") from None
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def station_available() -> str | None:
    """None if `python -m jaxstation serve` can be tried, else why not."""
    for f in ("server/serve.py", "cli.py", "__main__.py"):
        if not (REPO / "jaxstation" / f).exists():
            return f"jaxstation/{f} is missing"
    return None


def station_cmd(port: int, lanes: int, max_seq: int, chunk: int = 32, block: int = 128,
                max_queue: int = 256, dtype: str | None = None, prefix_reuse: str = "off", model: str | None = None
                ) -> list[str]:
    """A station subprocess (dtype None: the station's default). Prefix reuse is off by default: the benches repeat
    their prompts and measure fresh prefill (bench.prefix measures reuse)."""
    return [sys.executable, "-m", "jaxstation", "serve", "--port", str(port), "--lanes", str(lanes),
            "--continuous-batch", "--max-seq", str(max_seq), "--prefill-chunk", str(chunk), "--kv-block", str(block),
            "--max-queue", str(max_queue), *(["--dtype", dtype] if dtype else []), "--prefix-reuse", prefix_reuse,
            *(["--model", model] if model else [])]


def reply_problems(reply: object, prompt_tokens: int, max_new: int) -> list[str]:
    """What makes `reply` not a well-formed /generate reply to a prompt of that many tokens (empty: nothing)."""
    if not isinstance(reply, dict):
        return [f"not a JSON object: {reply!r:.200}"]
    gen = reply.get("generated")
    if not isinstance(gen, list) or not all(isinstance(t, int) and t >= 0 for t in gen):
        return [f"'generated' is not a list of token ids: {gen!r:.200}"]
    out = []
    if len(gen) > max_new:
        out.append(f"{len(gen)} tokens generated, more than max_new_tokens={max_new}")
    if reply.get("finish_reason") not in ("stop", "length"):
        out.append(f"finish_reason {reply.get('finish_reason')!r} is not stop or length")
    if reply.get("prompt_tokens") != prompt_tokens:
        out.append(f"prompt_tokens {reply.get('prompt_tokens')!r} != {prompt_tokens}")
    if not isinstance(reply.get("timing"), dict):
        out.append("no 'timing' object")
    return out


# The sampled runs' settings, sent alike to every system (llama.cpp's own top_k 40 and min_p 0.05 turned off)
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
GREEDY = {"temperature": 0}


def station_generate(client, base: str, tokens: list[int], max_new: int, sampling: dict = GREEDY) -> dict:
    """POST /generate, greedy (or `sampling`, seeded by the prompt), no stop ids, EOS ignored (as llama-server's
    `ignore_eos`). Returns the JSON reply with "client_s" (round trip) added.

    Raises ValueError if the reply is not a well-formed /generate reply for this request.
    """
    t0 = time.perf_counter()
    seed = len(tokens) + sum(tokens) if sampling.get("temperature") else None
    r = client.post(f"{base}/generate", json={"tokens": tokens, "max_new_tokens": max_new, **sampling,
                                               "seed": seed, "stop_token_ids": [], "ignore_eos": True}, timeout=600)
    r.raise_for_status()
    out = r.json()
    wrong = reply_problems(out, len(tokens), max_new)
    if wrong:
        raise ValueError(f"malformed /generate reply ({'; '.join(wrong)}): {r.text[:300]}")
    out["client_s"] = time.perf_counter() - t0
    out["n_generated"] = len(out["generated"])
    return out


@functools.cache
def repacking_crashes(binary: str) -> bool:
    """Whether this llama-server dies at start with its CPU weight repacking on: on a CPU that advertises AMX, the
    AMX buffers crash the process in some virtual machines (a SIGSEGV in the warm-up run). Probed once per binary."""
    from jaxstation.model.default_model import default_model_path

    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                             "-np", "1", "-c", "512"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
        return False
    except RuntimeError:
        return proc.returncode is not None and proc.returncode < 0
    finally:
        proc.terminate()
        proc.wait()


def llama_server_cmd(binary: str, gguf: str, port: int, slots: int, context: int, threads: int | None = None
                     ) -> list[str]:
    """llama-server on `gguf` with `slots` parallel slots sharing `context` positions; `--no-repack` where its
    repacked weights crash here (`repacking_crashes`: the benches' notes say so)."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(context),
            *(["-t", str(threads)] if threads else []), *(["--no-repack"] if repacking_crashes(binary) else [])]


def llama_server_completion(client, base: str, tokens: list[int], max_new: int, sampling: dict = GREEDY) -> dict:
    """POST llama-server /completion with token ids, greedy (or `sampling`, with its top_k and min_p off), no early
    stop."""
    t0 = time.perf_counter()
    extra = {"top_k": 0, "min_p": 0.0, "seed": len(tokens) + sum(tokens)} if sampling.get("temperature") else {}
    r = client.post(f"{base}/completion", json={"prompt": tokens, "n_predict": max_new, **sampling, **extra,
                                                 "ignore_eos": True, "cache_prompt": False}, timeout=600)
    r.raise_for_status()
    out = r.json()
    return {"client_s": time.perf_counter() - t0, "n_generated": int(out.get("tokens_predicted", 0)),
            "timings": out.get("timings")}


def llama_cpp_python_completion(client, base: str, text: str, max_new: int) -> dict:
    """POST the llama-cpp-python server's /v1/completions, greedy. Its API takes text, not token ids."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/completions", json={"prompt": text, "max_tokens": max_new, "temperature": 0,
                                                  "logit_bias": {"2": -100.0}},  # no early stop at EOS (id 2)
                    timeout=600)
    r.raise_for_status()
    out = r.json()
    return {"client_s": time.perf_counter() - t0, "n_generated": int(out.get("usage", {}).get("completion_tokens", 0))}


def concurrent_run(call, prompts: Sequence[list[int]], max_new: int,
                   headers: dict[str, str] | None = None) -> tuple[float, list[dict]]:
    """Send every prompt at once from its own thread with call(client, tokens, max_new). Returns (wall, replies)."""
    import httpx

    replies: list[dict | Exception] = [None] * len(prompts)  # type: ignore[list-item]
    barrier = threading.Barrier(len(prompts) + 1)

    def worker(i: int) -> None:
        with httpx.Client(timeout=600, headers=headers) as client:
            barrier.wait()
            try:
                replies[i] = call(client, prompts[i], max_new)
            except Exception as e:  # reported by the caller
                replies[i] = e

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r for r in replies if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed: {errors[0]!r}")
    return wall, replies  # type: ignore[return-value]


def open_loop(arrivals: Sequence[float], one) -> float:
    """Start `one(i)` in its own thread at each arrival time (seconds from now), wait for all; return the wall time."""
    threads = []
    t0 = time.perf_counter()
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """n arrival offsets (seconds from the start) of a Poisson process at `rate` requests/s."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def mixed_lengths(n: int, seed: int, long_frac: float = 0.15, long_len: tuple[int, int] = (500, 600),
                  short_len: tuple[int, int] = (16, 96)) -> list[int]:
    """A prompt-length mix: mostly short prompts, a fraction of long ones (>= 500 tokens)."""
    rng = np.random.default_rng(seed)
    n_long = max(1, math.ceil(long_frac * n)) if n >= 2 else 0
    lens = [int(rng.integers(*long_len)) for _ in range(n_long)] + \
        [int(rng.integers(*short_len)) for _ in range(n - n_long)]
    rng.shuffle(lens)
    return lens
