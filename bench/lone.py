"""One stream at any lane count: a lone request's time per token on stations of 1, 8 and 32 lanes, over HTTP.

Each station is started as a user starts one (`python -m jaxstation serve --continuous-batch --lanes N --port P`,
nothing else: the default model and settings); they all stay up while the bench runs, and the repetitions are
interleaved across them (rep 1: every station, rep 2: every station, ...), so a noisy machine shifts them alike.
Each request runs alone: POST /generate with a new prompt's token ids each repetition (so a station with more lanes
puts each into another lane, as it does a user's distinct prompts; --same-prompt repeats one), greedy, `ignore_eos`,
N new tokens. Time per token is the decode part of the reply's server-side timing, (total_s - ttft_s) / (tokens - 1);
the client's round trip over all tokens is reported beside it. Every station must generate the same tokens for the
same prompt (the lanes never change a token).

Usage:
  python -m bench.lone                        # lanes 1 8 32, 128 new tokens, 5 reps, bench/results/lone-*.json
  python -m bench.lone --lanes 1 8 --reps 3 --new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from bench.workload import free_port, med_spread, server_process


def serve_cmd(port: int, lanes: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "jaxstation", "serve", "--continuous-batch", "--lanes", str(lanes),
            "--port", str(port), *extra]


def one_request(client, base: str, tokens: list[int], new_tokens: int) -> dict:
    """A lone /generate: its tokens, server-side ms per decoded token, and the client's round trip."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/generate", json={"tokens": tokens, "max_new_tokens": new_tokens, "temperature": 0,
                                               "ignore_eos": True}, timeout=600)
    client_s = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    n, timing = len(out["generated"]), out["timing"]
    if n != new_tokens:
        raise ValueError(f"{n} tokens generated, {new_tokens} asked")
    return {"generated": out["generated"], "ms_per_token": 1e3 * (timing["total_s"] - timing["ttft_s"]) / (n - 1),
            "ttft_ms": 1e3 * timing["ttft_s"], "client_ms_per_token": 1e3 * client_s / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--same-prompt", action="store_true", help="every repetition sends the same prompt")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `serve` argument (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--name", default="lone", help="the result file's name: bench/results/<name>-<date>-<machine>")
    args = ap.parse_args()
    import httpx

    def prompt(rep: int) -> list[int]:
        rep = 0 if args.same_prompt else rep
        return [(7 * i + 11 + 13 * rep) % 4000 + 100 for i in range(args.prompt_len)]

    runs: dict[int, list[dict]] = {n: [] for n in args.lanes}
    with contextlib.ExitStack() as stack, httpx.Client() as client:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        bases = {}
        for n in args.lanes:
            port = free_port()
            bases[n] = f"http://127.0.0.1:{port}"
            stack.enter_context(server_process(serve_cmd(port, n, args.serve_arg), f"{bases[n]}/ready",
                                               args.startup_timeout, log=logs / f"lanes{n}.log"))
            one_request(client, bases[n], prompt(-1), 8)  # warm: the first request's lazy work is not measured
        for rep in range(args.reps):
            for n in args.lanes:
                runs[n].append(one_request(client, bases[n], prompt(rep), args.new_tokens))
                print(f"rep {rep + 1} lanes {n:3d}: {runs[n][-1]['ms_per_token']:.2f} ms/token", flush=True)
    same = all(runs[n][rep]["generated"] == runs[args.lanes[0]][rep]["generated"] for n in args.lanes
               for rep in range(args.reps))
    rows = {}
    for n in args.lanes:
        per = [r["ms_per_token"] for r in runs[n]]
        rows[str(n)] = {"ms_per_token": med_spread(per), "client_ms_per_token":
                        med_spread([r["client_ms_per_token"] for r in runs[n]]),
                        "ttft_ms": med_spread([r["ttft_ms"] for r in runs[n]])}
    base = statistics.median(r["ms_per_token"] for r in runs[args.lanes[0]])
    print(f"\n{'lanes':>5} {'ms/token':>9} {'min':>7} {'max':>7} {'vs first':>9} {'client ms/tok':>14}")
    for n in args.lanes:
        row = rows[str(n)]
        med = row["ms_per_token"]["median"]
        row["ratio"] = med / base
        print(f"{n:5d} {med:9.2f} {row['ms_per_token']['min']:7.2f} {row['ms_per_token']['max']:7.2f} "
              f"{med / base:9.3f} {row['client_ms_per_token']['median']:14.2f}")
    print(f"same tokens on every station: {same}")
    path = write_result(args.name, {"args": vars(args), "lanes": rows, "same_tokens": same})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
