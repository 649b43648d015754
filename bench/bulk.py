"""Bulk throughput: one file of requests answered whole, by the station's offline paths and by llama.cpp's batched
server, generated tokens a second of each.

The file: --prompts completions requests of the ShareGPT-shaped mix `bench.workload` makes (prompt lengths mostly 16
to 96 tokens, 15% of 500 to 600; outputs mostly 32 to 160 tokens, 15% of 256 to 384, at most --max-tokens), token-id
prompts, greedy, EOS ignored so that every system generates as many tokens. Systems (--only picks):
  llm            `LLM.generate` in this process, the file's prompts and lengths as one call
  batch          `jaxstation batch` on the file, a process of its own (its own count of the run's seconds, after the
                 model loaded and compiled)
  llama-server   llama.cpp's `llama-server` on the same GGUF file with as many slots as the station's lanes, the
                 file's requests sent that many at a time (/completion with the token ids, n_predict, ignore_eos)
Each system's seconds leave out its start (llama-server's: a first request, which pages its weights in); tokens/s is
the generated tokens over them.

Usage:
  scripts/build_llama_server.sh                          # once; llama-server in ~/.cache/jaxstation-peers
  python -m bench.bulk                                   # 1,000 requests, 8 lanes and slots, the default model
  python -m bench.bulk --prompts 8 --max-tokens 8 --name smoke   # a smoke run, to bench/results/runs/
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import add_name_arg, model_name, settle_pages, write_result
from bench.peers import find_llama_server
from bench.workload import (
    GREEDY,
    free_port,
    llama_server_cmd,
    llama_server_completion,
    make_prompts,
    mixed_lengths,
    server_process,
)

SYSTEMS = ("llm", "batch", "llama-server")


def workload(args: argparse.Namespace, tokenizer) -> list[dict]:
    """The file's lines: OpenAI batch requests to /v1/completions."""
    prompts = make_prompts(tokenizer, args.prompts, mixed_lengths(args.prompts, args.seed), seed=args.seed)
    outputs = mixed_lengths(args.prompts, args.seed + 1, long_len=(256, 384), short_len=(32, 160))
    return [{"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "bench", "prompt": p, "max_tokens": min(n, args.max_tokens), **GREEDY,
                      "ignore_eos": True}} for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]


def station_flags(args: argparse.Namespace) -> dict:
    return {"lanes": args.lanes, "max_seq": args.max_seq, **({"model": args.model} if args.model else {})}


def run_llm(args: argparse.Namespace, lines: list[dict]) -> dict:
    from jaxstation import LLM, SamplingParams

    with LLM(**station_flags(args)) as llm:
        settle_pages()
        params = [SamplingParams(temperature=0, max_tokens=line["body"]["max_tokens"], ignore_eos=True)
                  for line in lines]
        t0 = time.perf_counter()
        outputs = llm.generate([line["body"]["prompt"] for line in lines], params)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def run_batch(args: argparse.Namespace, requests: Path) -> dict:
    results = requests.with_name("results.jsonl")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in station_flags(args).items()]
    done = subprocess.run([sys.executable, "-m", "jaxstation", "batch", "-i", str(requests), "-o", str(results),
                           "--quiet", *flags], capture_output=True, text=True, check=False)
    seconds = re.search(r"lines written to .* in ([\d.]+) s \(", done.stderr)
    if done.returncode != 0 or seconds is None:
        raise RuntimeError(f"jaxstation batch failed ({done.returncode}): {done.stderr[-2000:]}")
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    failed = [a for a in answers if a["error"] or a["response"]["status_code"] != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} batch lines failed, the first: {failed[0]}")
    return {"seconds": float(seconds[1]),
            "generated_tokens": sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)}


def run_llama_server(args: argparse.Namespace, lines: list[dict], gguf: str) -> dict:
    import httpx

    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise RuntimeError("no llama-server: build it with scripts/build_llama_server.sh, or pass --llama-server")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server_process(llama_server_cmd(binary, gguf, port, args.lanes, args.lanes * args.max_seq),
                        f"{base}/health"), httpx.Client(timeout=600) as client:
        def one(line: dict) -> int:
            body = line["body"]
            return llama_server_completion(client, base, body["prompt"], body["max_tokens"])["n_generated"]

        llama_server_completion(client, base, lines[0]["body"]["prompt"], 1)  # its first request pages the weights in
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.lanes) as pool:
            generated = sum(pool.map(one, lines))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "generated_tokens": generated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=384, help="the longest output (default: the mix's, 384)")
    ap.add_argument("--lanes", type=int, default=8, help="the station's lanes and llama-server's slots")
    ap.add_argument("--max-seq", type=int, default=1024, help="positions a lane (and a slot) holds")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (default: the peers cache's)")
    add_name_arg(ap)
    args = ap.parse_args()

    from jaxstation.model.loader import load_tokenizer
    from jaxstation.model.source import model_source

    gguf = str(model_source(args.model))
    lines = workload(args, load_tokenizer(gguf))
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxstation-bulk-") as tmp:
        requests = Path(tmp) / "requests.jsonl"
        requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
        for system in args.only:
            run = {"llm": lambda: run_llm(args, lines), "batch": lambda: run_batch(args, requests),
                   "llama-server": lambda: run_llama_server(args, lines, gguf)}[system]()
            run = {"system": system, **run, "tokens_per_s": run["generated_tokens"] / run["seconds"]}
            print(f"{system}: {run['generated_tokens']} tokens in {run['seconds']:.1f} s, "
                  f"{run['tokens_per_s']:.1f} tokens/s", flush=True)
            rows.append(run)
    config = {"prompts": args.prompts, "lanes": args.lanes, "max_seq": args.max_seq, "max_tokens": args.max_tokens,
              "seed": args.seed, "prompt_tokens": sum(len(line["body"]["prompt"]) for line in lines),
              "requested_tokens": sum(line["body"]["max_tokens"] for line in lines)}
    path = write_result("bulk", {"config": config, "rows": rows}, model=model_name(args.model), variant=args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
