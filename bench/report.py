"""The tables of the README and docs/, rendered from the canonical results, and written into the pages.

Each table has a name, and a page shows it between the markers `<!-- bench:NAME -->` and `<!-- /bench -->`. A table
reads only the canonical result files (bench/results/<bench>-<model>.json, one per benchmark and model, see
bench/README.md); its rows follow a fixed order of models (unknown ones after, by name), so the same files give the
same bytes on any machine. Each table ends with a caption naming the machine, the command and the date of every run
it shows. A canonical file for another model adds its rows to the tables of its benchmark without a change here.

Usage:
  python -m bench.report            # rewrite every table in README.md, docs/*.md and bench/README.md
  python -m bench.report --check    # exit 1, naming each table that differs from its results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench -->)", re.S)
MODELS = {  # the order of rows, and each model's label; a model not named here comes after these, by its file name
    "smollm2": "SmolLM2-135M Q4_1 (the default)",
    "gemma-3-270m-q4_k_m": "Gemma 3 270M Q4_K_M",
    "llama-3.2-1b-q4_k_m": "Llama 3.2 1B's shape, random weights, Q4_K_M",
    "llama-3.1-8b-q4_k_m": "Llama 3.1 8B's shape, random weights, Q4_K_M",
    "qwen3-0.6b": "Qwen3-0.6B's shape, random weights",
    "mistral-7b": "Mistral 7B's shape, random weights",
}
NUMERIC = re.compile(r"[-+]?\d")  # a cell that starts with a number: a right-aligned column
HOME_CACHE = re.compile(r"/\S*?/\.cache/")  # a file under the runner's home, as a caption shows it: ~/.cache/...
Runs = list[tuple[str, dict]]  # (model, canonical result), in the order of MODELS
Rows = list[list[str]]


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose tables `bench.report` writes."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "bench" / "README.md"]


def load(results: Path, bench: str) -> Runs:
    """(model, result) for each canonical result of `bench`, in the order of MODELS, then by name."""
    found = {p.name[len(bench) + 1:-len(".json")]: p for p in results.glob(f"{bench}-*.json")}
    order = sorted(found, key=lambda m: (list(MODELS).index(m) if m in MODELS else len(MODELS), m))
    return [(m, json.loads(found[m].read_text())) for m in order]


def label(model: str) -> str:
    return MODELS.get(model, model)


def isa(flags: list[str] | None) -> str:
    """The kernel-relevant instruction sets a machine's flags name."""
    if flags is None:
        return ""
    names = [name for name, present in (("AVX-512", "avx512f" in flags),
                                        ("VNNI", "avx512_vnni" in flags or "avx_vnni" in flags),
                                        ("AMX", any(f.startswith("amx") for f in flags))) if present]
    return ", ".join(names) or "no AVX-512"


def machine(m: dict) -> str:
    """A machine in words: cores, CPU, instruction sets, read bandwidth."""
    details = [d for d in (isa(m.get("flags")), m.get("read_bandwidth") and
                           f"read {m['read_bandwidth'] / 1e9:.1f} GB/s") if d]
    return f"{m['cores']}-core {m['cpu']}" + (f" ({'; '.join(details)})" if details else "")


def caption(what: str, runs: Runs) -> str:
    """The caption under a table: what it shows, then each run's machine, command and date."""
    if not runs:
        return f"_{what} No canonical result yet._"
    machines = {machine(d["machine"]) for _, d in runs}
    each = [f"`{HOME_CACHE.sub('~/.cache/', d['command'])}` ({d['date'][:10]})" for _, d in runs]
    if len(machines) == 1:
        return f"_{what} {machines.pop()}: {'; '.join(each)}._"
    return f"_{what} " + "; ".join(f"{e} on a {machine(d['machine'])}" for e, (_, d) in zip(each, runs,
                                                                                         strict=True)) + "._"


def markdown(header: list[str], rows: Rows) -> str:
    """A markdown table; a column whose every cell is a number, or starts with one, is right-aligned."""
    numeric = [all(NUMERIC.match(r[i]) for r in rows if r[i] not in ("", "-")) and any(r[i] for r in rows)
               for i in range(len(header))]
    rule = ["---:" if n else "---" for n in numeric]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in (header, rule, *rows))


def f(x: float | None, spec: str = ".1f") -> str:
    """A number, or - where there is none."""
    return "-" if x is None else format(x, spec)


def pct(x: float | None, spec: str = ".1f") -> str:
    """A fraction as a percentage, or - where there is none."""
    return "-" if x is None else format(100 * x, spec) + "%"


def med(d: dict | None, key: str) -> float | None:
    """d[key]["median"], or None."""
    return ((d or {}).get(key) or {}).get("median")


def versus(ours: float | None, theirs: float | None, spec: str = ".1f") -> str:
    """ "ours vs theirs (ratio x)", or - where either is missing."""
    if ours is None or theirs is None:
        return "-"
    return f"{ours:{spec}} vs {theirs:{spec}} ({ours / theirs:.2f}x)"


class Fields:
    """A field of every run shown, for a caption: one value where the runs agree (`{config[reps]}` is 5), else the
    first run's with the others' named by model: "5 (1 for Llama 3.1 8B's shape, ...)"."""

    def __init__(self, runs: list[tuple[str, object]]) -> None:
        self.runs = runs

    def __getitem__(self, key: str) -> Fields:
        return Fields([(m, v[key]) for m, v in self.runs if isinstance(v, dict) and key in v])

    def __format__(self, spec: str) -> str:
        if not self.runs:
            return "-"
        (_, first), *others = self.runs
        differ = [f"{format(v, spec)} for {label(m)}" for m, v in others if v != first]
        return format(first, spec) + (f" ({', '.join(differ)})" if differ else "")


class Missing(dict):
    """The fields of no run: every field, and every field of a field, formats as -."""

    def __missing__(self, key: str) -> Missing:
        return self

    def __getitem__(self, key: object) -> Missing:
        return self

    def __format__(self, spec: str) -> str:
        return "-"


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of the docs: the canonical results it reads, its header and its rows; the rows' docstring, formatted
    with the runs' fields (`{config[lanes]}`, `Fields`), opens its caption."""

    benches: tuple[str, ...]
    header: list[str] | Callable[[Runs], list[str]]
    rows: Callable[[Runs], Rows]  # its docstring: the caption's first sentence
    model: str | None = None  # only this model's results
    keep: Callable[[dict], bool] = lambda result: True

    def render(self, results: Path) -> str:
        runs = [(m, d) for bench in self.benches for m, d in load(results, bench)
                if (self.model is None or m == self.model) and self.keep(d)]
        header = self.header(runs) if callable(self.header) else self.header
        what = " ".join(self.rows.__doc__.split()).format_map(Fields(runs) if runs else Missing())
        return markdown(header, self.rows(runs)) + "\n\n" + caption(what, runs)


# ---- the rows ------------------------------------------------------------------------------------------------------


def peers_header(runs: Runs) -> list[str]:
    ks = sorted({int(k) for _, d in runs for k in d["config"]["ks"]})
    return ["model", "sampling", *(f"K = {k}" for k in ks)]


def peers_rows(runs: Runs) -> Rows:
    """Whole requests, tokens/s, jaxstation vs llama.cpp's llama-server on the same GGUF file, K requests at once
    ({config[slots]} lanes and slots; a {config[prompt_len]}-token prompt, then {config[new_tokens]} new tokens, EOS
    ignored; medians of {config[reps]}; sampled: temperature 0.8, top_p 0.95)."""
    ks = [h.removeprefix("K = ") for h in peers_header(runs) if h.startswith("K = ")]
    rows = []
    for model, d in runs:
        ours, theirs = _pair(d)
        for mode, key in (("greedy", "tokens_per_s"), ("sampled", "sampled_tokens_per_s")):
            if key in ours:
                cells = [versus(med(ours.get(key), k), med(theirs.get(key), k)) for k in ks]
                rows.append([label(model) if mode == "greedy" else "", mode, *cells])
    return rows


def _pair(d: dict) -> tuple[dict, dict]:
    """A peers result's jaxstation and llama-server rows."""
    by = {r["system"]: r for r in d["rows"]}
    return by["jaxstation"], by["llama-server"]


def _started(d: dict) -> bool:
    """A peers run that timed both servers' start."""
    return all("start" in r for r in _pair(d))


def peers_start_header(runs: Runs) -> list[str]:
    lengths = sorted({int(n) for _, d in runs for r in d["rows"] for n in r.get("prefill_tokens_per_s") or {}})
    return ["model", "start -> ready s: station cold / warm cache", "llama-server", "memory MiB (VmRSS)",
            *(f"prefill of {n:,} tokens, tokens/s" for n in lengths)]


def peers_start_rows(runs: Runs) -> Rows:
    """Each server's start, process start to ready (the station's with its compilation cache emptied, then warm),
    its resident memory after the runs, and a prompt's prefill alone (one new token; tokens/s of the server-side
    time to first token, median of {config[reps]}): jaxstation vs llama-server, on the files of the speed table."""
    lengths = [h.split()[2].replace(",", "") for h in peers_start_header(runs)[4:]]
    rows = []
    for model, d in runs:
        ours, theirs = _pair(d)
        cold = ours.get("cold_start", {}).get("ready_s")
        rows.append([label(model), f"{f(cold)} / {f(ours['start']['ready_s'])}", f(theirs["start"]["ready_s"]),
                     versus(ours["start"]["memory_mib"]["VmRSS"], theirs["start"]["memory_mib"]["VmRSS"], ".0f"),
                     *(versus(med(ours.get("prefill_tokens_per_s"), n), med(theirs.get("prefill_tokens_per_s"), n),
                              ".0f") for n in lengths)])
    return rows


def throughput_rows(runs: Runs) -> Rows:
    """Aggregate tokens/s of K requests at once through the scheduler and over HTTP `/generate` ({config[dtype]}
    weights, a station of as many lanes as the largest K; a {config[prompt_len]}-token prompt, then
    {config[new_tokens]} new tokens, greedy; medians of {config[reps]}; overhead: the scheduler's wall time a wave
    beyond its step)."""
    rows = []
    for _, d in runs:
        direct = {r["k"]: r for r in d["direct"].get("rows", [])}
        http = {r["k"]: r for r in d["http"].get("rows", [])}
        for k in sorted(direct | http):
            overhead = med(direct.get(k), "overhead_frac")
            rows.append([str(k), f(med(direct.get(k), "tokens_per_s")),
                         f(direct.get(k, {}).get("ratio_to_first"), ".2f"), pct(overhead),
                         f(med(http.get(k), "tokens_per_s"))])
    return rows


def latency_rows(runs: Runs) -> Rows:
    """Open-loop Poisson arrivals on a station of {config[lanes]} lanes ({config[dtype]} weights; {config[requests]}
    requests a rate, {config[long_frac]:.0%} of prompts 500-600 tokens, {config[new_tokens]} new tokens; queue at
    most {config[max_queue]})."""
    return [[f"{r['rate']:g}", f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}",
             f"{1e3 * r['itl_s']['p50']:.0f} / {1e3 * r['itl_s']['p99']:.0f}", f"{r['queue_s']['p99']:.2f}",
             f"{r['achieved_tokens_per_s']:.0f}", str(r["rejected"])] for _, d in runs for r in d["direct"]]


def chunk_rows(runs: Runs) -> Rows:
    """{config[scenario_decoders]} lanes decoding while a {config[scenario_long]}-token prompt prefills, by prefill
    chunk (medians of {config[scenario_reps]})."""
    return [[str(r["chunk"]), f"{1e3 * r['itl_p50_s']['median']:.0f}", f"{1e3 * r['itl_p99_s']['median']:.0f}",
             f"{r['p99_over_p50']['median']:.2f}", f"{r['long_ttft_s']['median']:.2f}"]
            for _, d in runs for r in d["scenario"]]


def step_rows_(runs: Runs) -> Rows:
    """One step, ms: a decode wave, one prefill chunk, packed steps, and a turn's prompt piece fused with the wave."""
    rows = []
    for _, d in runs:
        for lanes, s in d["steps"].items():
            packs = " / ".join(f(s["pack_ms"].get(n)) for n in ("16", "32", "64", "128"))
            rows.append([lanes, f(s["decode_wave_ms"]), f(s["prefill_chunk_ms"]), packs,
                         f"{f(s['turn_fused_ms'])} ({s['turn_piece_tokens']} tokens)", f(s["turn_separate_ms"])])
    return rows


def churn_rows(runs: Runs) -> Rows:
    """Churn, requests/s: tiny `/generate` requests ({churn[prompt_tokens]} prompt tokens, {churn[new_tokens]} new
    tokens, greedy) from {churn[clients]} keep-alive clients, {churn[requests]} requests, one prefill chunk a turn
    against packed admission, and llama-server with as many slots."""
    return [[lanes, f(r.get("chunk")), f(r.get("packed")), f(r.get("llama-server")),
             f(r.get("packed") / r["llama-server"] if r.get("llama-server") else None, ".2f") + "x"]
            for _, d in runs for lanes, r in d["churn"].items() if isinstance(r, dict) and lanes.isdigit()]


def burst_rows(runs: Runs) -> Rows:
    """Burst: {burst[prompts]} prompts of mixed lengths at once on 32 lanes, TTFT in s, and the gaps between the tokens
    of 8 lanes decoding meanwhile, ms."""
    bursts = [(name, d["burst"][mode]) for _, d in runs
              for mode, name in (("chunk", "one chunk a turn"), ("packed", "packed")) if mode in d["burst"]]
    return [[name, f"{b['ttft_s']['p50']:.2f}", f"{b['ttft_s']['p99']:.2f}", f"{b['last_first_token_s']:.2f}",
             f"{b['plain_gap_ms']:.1f}", f"{b['burst_gap_ms']['p50']:.1f} / {b['burst_gap_ms']['p99']:.1f}"]
            for name, b in bursts]


def steady_rows(runs: Runs) -> Rows:
    """Steady decode, tokens/s while every lane decodes and nothing arrives."""
    return [[k, f(v["chunk"]), f(v["packed"])] for _, d in runs for k, v in d["steady"].items() if isinstance(v, dict)]


def clients_rows(runs: Runs) -> Rows:
    """aiperf and guidellm against the station ({lanes_or_slots} lanes) and llama-server (as many slots):
    `{workload[endpoint]}`, streaming, {workload[prompt_tokens]} prompt and {workload[output_tokens]} output tokens,
    closed loop."""
    return [[r["system"], r["client"], str(r["concurrency"]), f(r["output_tok_s"]), f(r["ttft_ms"]["p50"], ".0f"),
             f(r["ttft_ms"]["p99"], ".0f"), f(r["itl_ms"]["p50"]), f(r["itl_ms"]["p99"]),
             f"{r['requests']} ({r['errors']})"] for _, d in runs for r in d["rows"]]


def mesh_header(runs: Runs) -> list[str]:
    ks = [k for _, d in runs for k in d["config"]["ks"]]
    return ["stations", "pipelining", *(f"K = {k} tok/s" for k in ks), "vs local", "KiB a decode wave",
            "hop p50 / p99 ms", "transport p50 ms"]


def mesh_rows(runs: Runs) -> Rows:
    """Mesh stations as processes on loopback, the host's scheduler in the bench process ({config[dtype]} weights,
    {config[new_tokens]} new tokens; medians of {config[reps]}); hop and transport at the largest K."""
    rows = []
    for _, d in runs:
        local = {r["k"]: med(r, "tokens_per_s") for r in d["direct"]["rows"]}
        ks = sorted(local)
        rows.append(["local (no HTTP)", "", *(f(local[k]) for k in ks), "1.00", "", "", ""])
        for m in d["mesh"]:
            by = {r["k"]: r for r in m["rows"]}
            top = by[ks[-1]]
            rows.append([str(m["stations"]), "on" if m["pipeline"] else "off",
                         *(f(med(by.get(k), "tokens_per_s")) for k in ks),
                         f(med(top, "tokens_per_s") / local[ks[-1]], ".2f"), f(top["bytes_per_decode_wave"] / 1024),
                         f"{top['hop_ms']['p50']:.1f} / {top['hop_ms']['p99']:.1f}",
                         f(top["hop_transport_ms"]["p50"], ".2f")])
    return rows


def speculative_rows(runs: Runs) -> Rows:
    """Decode tokens/s a request, and in brackets the whole run's tokens/s; {config[prompts]} requests a workload,
    {config[new_tokens]} new tokens, greedy, K at a time; prompt-lookup drafts of {config[draft]} tokens on the
    station, llama-server's `ngram-simple` speculation."""
    def rate(x: dict | None) -> str:
        return "-" if x is None else f"{x['decode_tokens_per_s']:.1f} ({x['tokens_per_s']:.1f})"

    return [[r["workload"], str(r["k"]), rate(r["jaxstation_plain"]), rate(r["jaxstation_ngram"]),
             f"{r['decode_speedup']:.2f}x ({r['speedup']:.2f}x)", f"{100 * r['jaxstation_ngram']['acceptance']:.0f}%",
             f"{r['jaxstation_ngram']['mean_accepted_length']:.2f}", "yes" if r["same_tokens"] else "NO",
             rate(r.get("llama_plain")), rate(r.get("llama_ngram"))] for _, d in runs for r in d["rows"]]


def decode_rows(runs: Runs) -> Rows:
    """A full decode wave, ms (medians), and the fraction of the roofline: the step's bytes (its weights and the live KV
    its rows read) at the read bandwidth measured just before each step, over the step's time."""
    return [[label(m) if i == 0 else "", str(r["lanes"]), str(r["live"]), f(r["ms_per_step"], ".2f"),
             f(r["tokens_per_s"]), f"{100 * r['fraction_of_roofline']:.0f}%", f(r["read_bandwidth_beside"] / 1e9)]
            for m, d in runs for i, r in enumerate(d["rows"])]


def matmul_rows(runs: Runs) -> Rows:
    """Each of a model's matrices (the first layer's projections and the head) multiplied alone by as many rows of
    random activations, GOPS (a multiply and an add per weight a row; medians of {config[reps]}), and all of them
    together against the integer dot's peak on every core, measured just before (the kernels' `vpdpbusd` on registers
    alone). The model's cell names the kernel's instruction sets where the run recorded them (AMX: tiles for 16 rows
    or more)."""
    names = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")
    kernel = lambda d: f" ({d['int_dot']})" if "int_dot" in d else ""  # noqa: E731
    return [[label(m) + kernel(d) if i == 0 else "", str(r["rows"]), *(f(r["gops"][k], ".0f") for k in names),
             f(r["total_gops"], ".0f"), pct(r["fraction_of_peak"], ".0f")]
            for m, d in runs for i, r in enumerate(d["rows"])]


TRACED = {"int_matmul": "the projections", "head": "the head", "decode_attention": "the attention",
          "rms_norm": "the norms"}


def trace_header(runs: Runs) -> list[str]:
    return ["us a step", *(f"{label(m)}, {r['lanes']} lane{'s' if r['lanes'] > 1 else ''}, live {r['live']}"
                           for m, d in runs for r in d["rows"])]


def trace_rows(runs: Runs) -> Rows:
    """A lone row's decode step under JAX's profiler, split by kind of operation (medians over the traced steps; the
    tracer slows every operation a little)."""
    traces = [r for _, d in runs for r in d["rows"]]

    def calls(r: dict, kind: str) -> str:
        c = r["kernel_calls"].get(kind)
        return "-" if c is None else f"{c['us']:,.0f} ({c['calls']} call{'s' if c['calls'] > 1 else ''})"

    others = [sum(c["us"] for k, c in r["kernel_calls"].items() if k not in TRACED) for r in traces]
    return [["the step, traced", *(f"{r['step_us']:,.0f}" for r in traces)],
            *([name, *(calls(r, kind) for r in traces)] for kind, name in TRACED.items()),
            ["the other kernel calls", *(f"{us:,.0f}" for us in others)],
            ["XLA's other operations", *(f"{r['other_ops_us']:,.0f} ({r['other_ops']:.0f})" for r in traces)],
            ["no operation running", *(f"{r['idle_us']:,.0f}" for r in traces)]]


def accuracy_rows(runs: Runs) -> Rows:
    """Each weight format against the same file dequantized to float32, both loaded as a station loads them: perplexity
    and top-1 agreement under teacher forcing over the repository's `LICENSE` (1024-token windows), and at the
    reference prompts' positions the top-1 agreement and how many of 48 greedy tokens are shared before the
    continuations part."""
    rows = []
    for m, d in runs:
        dtype, p, prompts = d["dtype"], d["perplexity"], d["prompts"]
        agree = round(sum(r["top1_agreement"] * r["positions"] for r in prompts))
        shared = ", ".join("all" if r["greedy_equal"] else str(r["first_divergence"]) for r in prompts)
        rows.append([label(m), f"`{dtype}`", f"{p['tokens']:,}", f(p["float32"], ".3f"), f(p[dtype], ".3f"),
                     f"{100 * (p[dtype] / p['float32'] - 1):+.2f}%", pct(p.get("top1_agreement")),
                     f"{agree} of {sum(r['positions'] for r in prompts)}", shared])
    return rows


def llama_rows(runs: Runs) -> Rows:
    """The same text read as llama.cpp's `llama-perplexity -c 512` reads it (512-token chunks, the second half of each
    scored), and `llama-perplexity` itself on the same file and text."""
    def against(x: float | None, base: float) -> str:
        return "-" if x is None else f"{x:.3f} ({100 * (x / base - 1):+.2f}%)"

    return [[label(m), f(p["float32"], ".3f"), against(p[d["dtype"]], p["float32"]),
             against((p.get("llama.cpp") or {}).get("perplexity"), p["float32"])]
            for m, d in runs for p in [d["llama_perplexity_protocol"]]]


def kv_rows(runs: Runs) -> Rows:
    """The first tokens of the repository's docs scored through the engine's chunked prefill from a float32 arena and
    from the smaller one (rings in both), each row against its own float32 run."""
    return [[label(m), dtype, f(d[f"perplexity_{dtype}"], ".4f"), f(d["perplexity_float32"], ".4f"),
             f(d["perplexity_ratio"], ".4f"), f"{100 * d['top1_agreement']:.2f}%", f(d["max_abs_logprob_diff"], ".3f")]
            for m, d in runs for dtype in [d["bench"].removeprefix("kv_quality_")]]


PHASES = {"ready": "at ready", "served": "after the requests", "idle": "idle", "programs dropped":
          "compiled programs dropped"}


def memory_rows(runs: Runs) -> Rows:
    """Resident memory of a station, MiB: once `/ready` answers, after requests on every lane (half of them top-p
    sampled), idle once the decode thread has handed freed memory back, and with the compiled programs dropped."""
    return [[label(m), *(f"{d['phases'][p]['VmRSS']:,.0f}" if p in d["phases"] else "-" for p in PHASES)]
            for m, d in runs]


def coldstart_rows(runs: Runs) -> Rows:
    """Process start to the first `/ready` 200 on CPU, the default model at {config[lanes]} lanes x {config[max_seq]}
    positions ({config[dtype]} weights), with an empty and a warm compilation cache, medians of {config[reps]}, s."""
    rows = []
    for _, d in runs:
        for cache in ("empty", "warm"):
            ph, ready = d["phase_medians_s"][cache], d["median_start_to_ready_s"][cache]
            programs = d["runs"][cache][0]["programs"]
            rest = ready - sum(ph.get(k) or 0 for k in ("import", "weight_load", "arena_alloc"))
            rows.append([cache, f"{ready:.2f}", f(ph.get("import"), ".2f"), f(ph.get("weight_load"), ".2f"),
                         f(ph.get("arena_alloc"), ".2f"), f(rest), f"{programs['compiled']} / {programs['cache']}"])
    return rows


def image_rows(runs: Runs) -> Rows:
    """`scripts/build_image_local.sh` from a fresh clone: build time (the local base image left out), the image's size,
    `/ready` after `podman run`, and a stop during a generation."""
    return [[f"`{d['device']}`", f"{d['build_s']:.0f}", f"{d['image_gb']:.2f}", f"{d['ready_s']:.1f}",
             f"{d['stop_under_load_s']:.1f} (the request: {d['in_flight_status']})", str(d["exit_code"])]
            for _, d in runs]


def chat_rows(runs: Runs) -> Rows:
    """A {config[turns]}-turn chat ({config[system_chat_len]}-token system prompt, {config[user_len]}-token user
    messages, {config[reply]}-token greedy replies), each turn alone with reuse and fresh; {config[lanes]} lanes,
    {config[dtype]} weights; medians of {config[reps]} conversations, the ratio's spread in brackets."""
    return [[str(t["turn"]), f"{med(t, 'prompt_tokens'):.0f}", f"{med(t, 'cached_tokens'):.0f}",
             f(med(t, "ttft_reuse_s"), ".2f"), f(med(t, "ttft_fresh_s"), ".2f"),
             "{median:.2f} [{min:.2f}-{max:.2f}]".format(**t["reuse_over_fresh"]), "yes" if t["identical"] else "NO"]
            for _, d in runs for t in d["chat"]["turns"]]


def shared_rows(runs: Runs) -> Rows:
    """A shared {config[system_len]}-token system prompt: {config[requests]} requests submitted at once to an empty
    station, {config[shared_new]} new tokens each."""
    return [[mode, f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.1f}",
             "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f} ({r['hits']:.0f}/{r['lookups']:.0f})",
             f"{r['prefill_saved_tokens']:.0f} / {r['prompt_tokens']}"]
            for _, d in runs for mode, r in d["shared_system"].items() if mode in ("off", "on")]


def replay_rows(runs: Runs) -> Rows:
    """{config[conversations]} two-turn conversations on {config[lanes]} lanes (each a {config[doc]}-token document and
    a {config[question]}-token question, a {config[reply]}-token reply, then a new question); the host tier at its
    default size; tokens and bytes only."""
    rows = []
    for m, d in runs:
        t1, t2 = d["turns"]
        rss = ", ".join(f"{b / 2**20:,.0f}" for b in (d["rss_before_bytes"], t1["rss_bytes"], t2["rss_bytes"]))
        tiers = [f"{t['tier_bytes'] / 2**20:,.0f} MiB, {t['tier_entries']:.0f} entries" for t in (t1, t2)]
        rows.append([label(m), f"{t2['prompt_tokens']:,}",
                     f"{t2['prefilled_tokens']:,} ({100 * t2['prefilled_fraction']:.1f}%)", *tiers, rss])
    return rows


SESSIONS = ("session 1", "its second turn", "session 2")
SESSION_HEADER = ["model", "version", "run", "requests", "4xx", "prompt tokens prefilled", "mean TTFT", "wall", "exit"]


def session_rows(runs: Runs) -> Rows:
    """Sessions of {package} from npm against the station: the agent's version, the requests and those the station
    answered with a 4xx (from its access log), prompt tokens prefilled (the rest reused from the prefix cache), the
    mean time to first token and the wall time, s, and the agent's exit code."""
    return [[label(m) if i == 0 else "", d["package"].rpartition("@")[2] if i == 0 else "", name, str(r["requests"]),
             str(len(r["client_errors"])) if "client_errors" in r else "-", f"{r['prefilled']:,}",
             f"{r['mean_ttft_s']:.2f}", f"{r['wall_s']:.1f}", str(r["exit"])]
            for m, d in runs for i, (name, r) in enumerate(zip(SESSIONS, d["runs"], strict=True))]


def structured_rows(runs: Runs) -> Rows:
    """Every request held to a JSON schema against the same requests unconstrained ({dtype} weights, greedy,
    {new_tokens} new tokens, K lanes), and the host's mask time, ms; compiling a schema over {compile[schemas]} real
    schemas: p50 {compile[p50_ms]:.2f} ms, p99 {compile[p99_ms]:.2f} ms; llguidance's tokenizer built in
    {llguidance_tokenizer_s:.2f} s."""
    return [[str(r["k"]), f(r["plain_tok_s"]), f(r["constrained_tok_s"]), f(r["ratio"], ".2f"),
             f(r["mask_ms_per_wave"], ".2f"), f(r["mask_ms_per_row"], ".2f")] for _, d in runs for r in d["throughput"]]


def soak_rows(runs: Runs) -> Rows:
    """Mixed clients on every API, a third of the requests cut at a random point."""
    return [[f"{d['duration_s']:.0f}", str(d["concurrency"]), *(f"{d['totals'][k]:,}" for k in
                                                                 ("sent", "completed", "disconnected", "errors")),
             "yes" if d["lanes_free"] and d["queue_empty"] else "NO",
             ", ".join(f"{d['rss_mib'][k]:,.0f}" for k in ("first", "after_warmup", "last")), str(d["exit_code"])]
            for _, d in runs]


def lora_rows(runs: Runs) -> Rows:
    """One decode step of 8 rows, each on its own rank-16 adapter on every projection, against the same step without
    adapters, interleaved in one process; the ratio of the medians, and in brackets the median of the pairs'
    ratios."""
    return [[label(m), str(d["layers"]), f"`{d['dtype']}`", f"{d['weight_bytes'] / 1e6:,.0f}",
             f"{d['adapter_bytes'] / 1e6:,.0f}", f(d["base_ms"]), f(d["lora_ms"]),
             f"{d['ratio']:.2f}x ({d['pair_ratio_median']:.2f}x)"] for m, d in runs]


def split_rows(runs: Runs) -> Rows:
    """A full decode wave split over N virtual CPU devices sharing the machine's cores (XLA's dot and the blocked
    attention at every N), ms, and the bytes one device reads a step, MB."""
    return [[label(m) if i == 0 else "", str(r["tensor_parallel"]), str(r["lanes"]), str(r["live"]),
             f(r["ms_per_step"]), f(r["tokens_per_s"]),
             f"{(r['weight_bytes_per_device'] + r['kv_bytes_per_device']) / 1e6:,.0f}"]
            for m, d in runs for i, r in enumerate(d["rows"])]


def bulk_rows(runs: Runs) -> Rows:
    """Generated tokens/s over one file of {config[prompts]} requests of the ShareGPT-shaped mix
    ({config[prompt_tokens]} prompt tokens and {config[requested_tokens]} to generate, greedy, EOS ignored), with
    {config[lanes]} lanes and slots: `LLM.generate` in one process, `jaxstation batch` on the file, and llama.cpp's
    llama-server on the same GGUF file sent the file's requests {config[lanes]} at a time; each one's start left
    out."""
    rows = []
    for model, d in runs:
        by = {r["system"]: r["tokens_per_s"] for r in d["rows"]}
        ours, theirs = by.get("llm"), by.get("llama-server")
        rows.append([label(model), f(ours), f(by.get("batch")), f(theirs),
                     "-" if ours is None or theirs is None else f"{ours / theirs:.2f}x"])
    return rows


def split(result: dict) -> bool:
    """A `bench.step --tensor-parallel` run over more than one device."""
    return len(result["config"].get("tensor_parallel", [1])) > 1


def unsplit(result: dict) -> bool:
    return not split(result)


def scored(result: dict) -> bool:
    """An accuracy run that also read the text as `llama-perplexity` does."""
    return "llama_perplexity_protocol" in result


# ---- the tables: the results each reads, its header, its rows (whose docstring opens its caption) -----------------

TABLES = {
    "peers": Table(("peers",), peers_header, peers_rows),
    "peers-start": Table(("peers",), peers_start_header, peers_start_rows, keep=_started),
    "throughput": Table(("throughput",), ["K", "scheduler tok/s", "vs K = 1", "overhead", "HTTP tok/s"],
                        throughput_rows, model="smollm2"),
    "latency": Table(("latency",), ["rate/s", "TTFT p50 / p99 s", "ITL p50 / p99 ms", "queue p99 s", "tok/s",
                                    "rejected"], latency_rows, model="smollm2"),
    "latency-chunks": Table(("latency",), ["prefill chunk", "ITL p50 ms", "ITL p99 ms", "p99 / p50",
                                           "long prompt's TTFT s"], chunk_rows, model="smollm2"),
    "admission-steps": Table(("admission",), ["lanes", "decode wave", "prefill chunk (32)",
                                              "packed 16 / 32 / 64 / 128 rows", "fused turn", "pack + wave"],
                             step_rows_, model="smollm2"),
    "admission-churn": Table(("admission",), ["lanes", "one chunk a turn", "packed", "llama-server",
                                              "packed / llama-server"], churn_rows, model="smollm2"),
    "admission-burst": Table(("admission",), ["admission", "TTFT p50", "TTFT p99", "last first token",
                                              "decode gap alone", "gap during the burst p50 / p99"], burst_rows,
                             model="smollm2"),
    "admission-steady": Table(("admission",), ["K", "one chunk a turn", "packed"], steady_rows, model="smollm2"),
    "clients": Table(("clients",), ["system", "client", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                                    "ITL p50 ms", "ITL p99 ms", "requests (errors)"], clients_rows, model="smollm2"),
    "mesh": Table(("throughput_mesh",), mesh_header, mesh_rows, model="smollm2"),
    "speculative": Table(("speculative",), ["workload", "K", "plain", "ngram", "ngram / plain", "acceptance",
                                            "mean accepted", "same tokens", "llama-server", "llama-server n-gram"],
                         speculative_rows, model="smollm2"),
    "matmuls": Table(("step_matmuls",), ["model", "rows", "q, k, v", "o", "gate, up", "down", "head",
                                         "all, GOPS", "of the dot's peak"], matmul_rows),
    "step": Table(("step",), ["model", "lanes", "live", "ms a step", "tokens/s", "of the roofline", "GB/s beside"],
                  decode_rows, keep=unsplit),
    "profile-trace": Table(("profile_trace",), trace_header, trace_rows),
    "accuracy": Table(("accuracy_gguf", "accuracy_int8"), ["model", "weights", "text tokens", "perplexity, float32",
                                                           "perplexity, weights", "difference",
                                                           "top-1, teacher-forced", "top-1 at prompt positions",
                                                           "greedy tokens shared"], accuracy_rows),
    "accuracy-llama": Table(("accuracy_gguf",), ["model", "float32", "`gguf` (integer)",
                                                 "llama.cpp's `llama-perplexity`"], llama_rows, keep=scored),
    "kv-quality": Table(("kv_quality_bfloat16", "kv_quality_int8"), ["model", "KV dtype", "perplexity", "float32's",
                                                                     "ratio", "top-1 agreement",
                                                                     "largest logprob difference"], kv_rows),
    "memory": Table(("memory",), ["model", *PHASES.values()], memory_rows),
    "coldstart": Table(("coldstart",), ["cache", "start -> `/ready`", "import", "weight load", "arena",
                                        "compile and the rest", "programs compiled / from cache"], coldstart_rows,
                       model="smollm2"),
    "image": Table(("image_cuda", "image_cpu"), ["`--device`", "build s", "image GB", "`/ready` s", "stop s",
                                                 "exit code"], image_rows),
    "prefix-chat": Table(("prefix",), ["turn", "prompt tokens", "cached", "TTFT with reuse s", "TTFT fresh s",
                                       "with reuse / fresh", "same tokens"], chat_rows, model="smollm2"),
    "prefix-shared": Table(("prefix",), ["reuse", "wall s", "tokens/s", "hit rate", "prompt tokens saved"],
                           shared_rows, model="smollm2"),
    "agent-replay": Table(("agent_replay",), ["model", "turn 2 prompt tokens", "prefilled", "tier after turn 1",
                                              "tier after turn 2", "RSS MiB: loaded, after turn 1, after turn 2"],
                          replay_rows),
    "agent-session": Table(("agent_session_claude",), SESSION_HEADER, session_rows),
    "agent-session-codex": Table(("agent_session_codex",), SESSION_HEADER, session_rows),
    "structured": Table(("structured",), ["K", "unconstrained tok/s", "JSON schema tok/s", "ratio", "mask ms a wave",
                                          "a row"], structured_rows, model="smollm2"),
    "soak": Table(("soak",), ["s", "clients", "requests", "completed", "cut", "errors", "lanes free, queue empty",
                              "RSS MiB: start, after warm-up, end", "exit code"], soak_rows, model="smollm2"),
    "lora": Table(("step_lora",), ["model", "layers", "weights", "weights MB", "8 adapters MB", "base step ms",
                                   "with adapters ms", "ratio"], lora_rows),
    "bulk": Table(("bulk",), ["model", "`LLM.generate`", "`jaxstation batch`", "llama-server",
                              "`LLM.generate` / llama-server"], bulk_rows),
    "tensor-parallel": Table(("step",), ["model", "N", "lanes", "live", "ms a step", "tokens/s", "one device reads"],
                             split_rows, keep=split),
}


def render(name: str, results: Path = RESULTS) -> str:
    """Table `name` from the results, with its caption."""
    if name not in TABLES:
        raise KeyError(f"no table named {name!r} (bench/report.py knows {', '.join(sorted(TABLES))})")
    return TABLES[name].render(results)


# ---- the pages -----------------------------------------------------------------------------------------------------


def fill(text: str, results: Path = RESULTS) -> str:
    """A page's text with every block between its markers rendered anew from the results."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), results) + "\n" + m.group(4), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the canonical results are")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each page whose tables differ")
    args = ap.parse_args()
    stale = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = fill(text, args.results)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new, encoding="utf-8")
    print(("differ: " if args.check else "rewrote: ") + (", ".join(map(str, stale)) or "none"))
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
