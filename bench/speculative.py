"""Speculative decoding: tokens/s with prompt-lookup drafts against plain decoding, with llama-server's own n-gram
speculation on the same requests in the same run as the reference line. Two rates: tokens/s over the whole run
(prefill of the prompts included), and decode tokens/s a request (its tokens after the first over the time after
its first: what speculation changes).

Workloads (the default model, its chat template, greedy, a fixed number of new tokens each):
  grounded  "rewrite this text": passages of the repository's own docs, 300-1000 tokens each, so that the output
            copies spans of the prompt
  open      short open-ended requests: little to look up
Systems: jaxstation in-process (a Scheduler over an Engine of the station's shape), plain and with n-gram drafts;
llama-server (scripts/build_llama_server.sh) plain and with `--spec-type` n-gram speculation, over HTTP.
At each K (requests at once) and workload: tokens/s, the drafts' acceptance rate and mean accepted length, and
whether speculation changed any token (it must not, for jaxstation).

Usage:
  python -m bench.speculative                      # K = 1 and 8, 20 prompts per workload
  python -m bench.speculative --ks 1 --prompts 8   # shorter
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import planned_model, write_result
from bench.peers import find_llama_server
from bench.workload import REPO, free_port, llama_server_cmd, server_process

TOPICS = ("a lighthouse keeper", "a city under the sea", "the first train to the mountains", "a lost letter",
          "a robot gardener", "a winter market", "an old violin", "a map with no names", "a river that runs uphill",
          "the last bookshop", "a clock that runs backwards", "a festival of lanterns")


def passages(tok, n: int, lo: int = 300, hi: int = 1000) -> list[str]:
    """n passages of the repository's docs, each lo to hi tokens: consecutive paragraphs, in file order."""
    out, current = [], ""
    for path in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for para in re.split(r"\n\s*\n", path.read_text()):
            if "|" in para or "```" in para:  # tables and code read poorly as prose
                continue
            current = f"{current}\n\n{para}".strip()
            size = len(tok.encode(current, add_special_tokens=False))
            if size > hi:
                current = para
            elif size >= lo:
                out.append(current)
                current = ""
            if len(out) == n:
                return out
    return out


def prompts(tok, workload: str, n: int) -> list[list[int]]:
    if workload == "grounded":
        asks = [f"Rewrite the following text, keeping its wording and its facts:\n\n{p}" for p in passages(tok, n)]
    else:
        asks = [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False)
            for a in asks]


def run_station(engine, jobs_prompts: list[list[int]], k: int, new: int, speculation) -> dict:
    """Every prompt through one Scheduler, at most k at a time; tok/s, the drafts' counters, the tokens."""
    from jaxstation.engine.jobs import Job
    from jaxstation.engine.scheduler import Scheduler

    sched = Scheduler(engine, continuous=True, max_queue=len(jobs_prompts), terminal_ids=frozenset(),
                      speculation=speculation)
    sched.start()
    results = []
    t0 = time.perf_counter()
    try:
        for i in range(0, len(jobs_prompts), k):
            jobs = [Job(tokens=p, max_new_tokens=new) for p in jobs_prompts[i:i + k]]
            for job in jobs:
                sched.submit(job)
            results += [job.future.result(900) for job in jobs]
    finally:
        sched.drain(60)
    wall = time.perf_counter() - t0
    outputs = [r.generated for r in results]
    decode = [(len(r.generated) - 1) / (r.timing["total_s"] - r.timing["ttft_s"]) for r in results]
    value = sched.metrics.registry.get_sample_value
    drafts = value("jaxstation_spec_decode_num_drafts_total") or 0
    drafted = value("jaxstation_spec_decode_num_draft_tokens_total") or 0
    accepted = value("jaxstation_spec_decode_num_accepted_tokens_total") or 0
    return {"tokens_per_s": sum(map(len, outputs)) / wall, "decode_tokens_per_s": float(np.mean(decode)),
            "wall_s": wall, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / drafts if drafts else None, "outputs": outputs}


def run_llama(base: str, jobs_prompts: list[list[int]], k: int, new: int) -> dict:
    """Every prompt through llama-server's /completion, k at a time, greedy, `new` tokens each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(p: list[int]) -> dict:
        with httpx.Client(timeout=900) as client:
            r = client.post(f"{base}/completion", json={"prompt": p, "n_predict": new, "temperature": 0,
                                                         "ignore_eos": True, "cache_prompt": False,
                                                         "return_tokens": True})
            r.raise_for_status()
            return r.json()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        replies = list(pool.map(one, jobs_prompts))
    wall = time.perf_counter() - t0
    drafted = sum((r.get("timings") or {}).get("draft_n", 0) for r in replies)
    accepted = sum((r.get("timings") or {}).get("draft_n_accepted", 0) for r in replies)
    decode = [(r["timings"]["predicted_n"] - 1) / (r["timings"]["predicted_ms"] / 1e3) for r in replies]
    return {"tokens_per_s": sum(int(r.get("tokens_predicted", 0)) for r in replies) / wall,
            "decode_tokens_per_s": float(np.mean(decode)), "wall_s": wall,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "outputs": [r.get("tokens") for r in replies]}


def llama_spec_flags(binary: str, n: int, k: int) -> list[str] | None:
    """llama-server's n-gram speculation flags, where this build has them: its simple n-gram lookup with jaxstation's
    longest lookup (n) and draft length (k)."""
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    m = re.search(r"--spec-type\s+\{?\[?([^\n\]}]*)", helptext)
    if m is None:
        return None
    kinds = [s.strip() for s in re.split(r"[|,]", m.group(1)) if s.strip().startswith("ngram")]
    if "ngram-simple" not in kinds:
        return ["--spec-type", kinds[0]] if kinds else None
    sizes = {"--spec-ngram-simple-size-n": n, "--spec-ngram-simple-size-m": k, "--spec-draft-n-max": k}
    return ["--spec-type", "ngram-simple", *(x for f, v in sizes.items() if f in helptext for x in (f, str(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft", type=int, default=3, help="jaxstation's k: the most tokens a request drafts a step")
    ap.add_argument("--llama-server", help="path of the llama-server binary (default: bench.peers' build cache)")
    ap.add_argument("--no-llama", action="store_true")
    args = ap.parse_args()

    from jaxstation.engine.engine import Engine
    from jaxstation.engine.speculative import Speculation
    from jaxstation.model.default_model import default_model_path

    model, plan = planned_model()  # the default model as a station on this machine plans and loads it
    tok = model.tokenizer
    work = {w: prompts(tok, w, args.prompts) for w in ("grounded", "open")}
    longest = max(len(p) for ps in work.values() for p in ps)
    max_seq = 128 * -(-(longest + args.new_tokens + 2) // 128)
    lanes = max(8, max(args.ks))
    engine = Engine(model, lanes=lanes, max_seq=max_seq, chunk=32, block=128, attention=plan.attention,
                    prefill_budget=None, speculative=True)
    engine.warmup()
    rows: list[dict] = []
    notes: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        llama = {}
        binary = None if args.no_llama else find_llama_server(args.llama_server)
        if binary is None:
            notes["llama-server"] = "not run: --no-llama, or not built (scripts/build_llama_server.sh)"
        else:
            spec = llama_spec_flags(binary, 4, args.draft)
            notes["llama-server"] = f"speculation flags {spec}" if spec else "this build has no n-gram --spec-type"
            for name, extra in (("plain", []), ("ngram", spec)):
                if extra is None:
                    continue
                port = free_port()
                cmd = llama_server_cmd(binary, str(default_model_path()), port, max(args.ks), max_seq * max(args.ks))
                stack.enter_context(server_process(cmd + extra, f"http://127.0.0.1:{port}/health", 300,
                                                   log=Path(f"/tmp/speculative-llama-{name}.log")))
                llama[name] = f"http://127.0.0.1:{port}"
        for workload, ps in work.items():
            for k in args.ks:
                plain = run_station(engine, ps, k, args.new_tokens, None)
                spec = run_station(engine, ps, k, args.new_tokens, Speculation(k=args.draft))
                row = {"workload": workload, "k": k, "prompt_tokens": [min(map(len, ps)), max(map(len, ps))],
                       "jaxstation_plain": plain, "jaxstation_ngram": spec,
                       "same_tokens": spec["outputs"] == plain["outputs"],
                       "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                       "decode_speedup": spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]}
                for name, base in llama.items():
                    row[f"llama_{name}"] = run_llama(base, ps, k, args.new_tokens)
                print(f"{workload:8s} K={k}: tok/s (decode tok/s a request) plain {plain['tokens_per_s']:6.1f} "
                      f"({plain['decode_tokens_per_s']:6.1f}), ngram {spec['tokens_per_s']:6.1f} "
                      f"({spec['decode_tokens_per_s']:6.1f}) = {row['speedup']:.2f}x ({row['decode_speedup']:.2f}x), "
                      f"acceptance {spec['acceptance']}, mean accepted {spec['mean_accepted_length']}, same tokens "
                      f"{row['same_tokens']}; " + ", ".join(f"llama {n} {row[f'llama_{n}']['tokens_per_s']:6.1f} "
                                                            f"({row[f'llama_{n}']['decode_tokens_per_s']:6.1f})"
                                                            for n in llama), flush=True)
                for v in row.values():
                    if isinstance(v, dict):
                        v.pop("outputs", None)
                rows.append(row)
    path = write_result("speculative", {"config": vars(args), "notes": notes, "rows": rows,
                                        "engine": {"lanes": lanes, "max_seq": max_seq}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
