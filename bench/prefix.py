"""Prefix reuse: TTFT of a multi-turn chat with and without reuse, and throughput on a shared system prompt.

Chat: a conversation of `--turns` turns. Turn 1 is a system prompt plus a user message; turn k+1 sends turn k's
prompt, turn k's reply (greedy, `--reply` tokens) and a new user message, as a chat client does. Each turn runs alone
on the station, once continuing the conversation with reuse (the station's default) and once fresh
(`reuse_prefix=False`); TTFT is the reply's `timing.ttft_s`. Each rep is a new conversation (new text), so turn 1
never hits. Both runs must give the same tokens; the JSON records it. Target: the last turn's TTFT with reuse at
most 25% of fresh.

Shared system prompt: `--requests` requests, each a `--system-len`-token system prompt plus its own user message,
submitted at once to an empty station (a new Scheduler: an empty prefix cache), with reuse and without. The first
`lanes` requests find nothing cached; later ones find the system prompt in a freed lane. Reports generated tokens/s,
wall time, TTFT percentiles and the prefix cache's hit rate (hits / lookups), tokens reused and prefill saved.

Usage:
  python -m bench.prefix              # 3 reps of a 4-turn chat to ~1000 tokens; 24 requests on a 500-token prompt
  python -m bench.prefix --quick      # smoke run
"""

from __future__ import annotations

import argparse
import time

from bench.common import write_result
from bench.workload import make_prompts, med_spread, percentiles

BLOCK = 128


def new_scheduler(engine):
    from jaxstation.engine.scheduler import Scheduler

    sched = Scheduler(engine, continuous=True, max_queue=256, terminal_ids=frozenset())
    sched.start()
    return sched


def run_one(sched, prompt: list[int], new: int, reuse: bool):
    from jaxstation.engine.jobs import Job

    return sched.submit(Job(tokens=prompt, max_new_tokens=new, stop_ids=frozenset(), reuse_prefix=reuse)).result()


def chat(sched, tokenizer, args, seed: int) -> list[dict]:
    """One conversation: per turn, TTFT and cached tokens with reuse and fresh, and whether the tokens agree."""
    system = make_prompts(tokenizer, 1, args.system_chat_len, seed=seed)[0]
    users = make_prompts(tokenizer, args.turns, args.user_len, seed=seed + 1)
    prompts, reused = [], []
    history = system
    for k in range(args.turns):
        prompt = history + users[k]
        r = run_one(sched, prompt, args.reply, reuse=True)
        prompts.append(prompt)
        reused.append(r)
        history = prompt + r.generated
    turns = []
    for k, (prompt, r) in enumerate(zip(prompts, reused, strict=True)):
        fresh = run_one(sched, prompt, args.reply, reuse=False)
        turns.append({"turn": k + 1, "prompt_tokens": len(prompt), "cached_tokens": r.timing["cached_tokens"],
                      "ttft_reuse_s": r.timing["ttft_s"], "ttft_fresh_s": fresh.timing["ttft_s"],
                      "identical": r.generated == fresh.generated})
    return turns


def shared_system(engine, tokenizer, args, reuse: bool) -> dict:
    from jaxstation.engine.jobs import Job

    system = make_prompts(tokenizer, 1, args.system_len, seed=args.seed + 100)[0]
    users = make_prompts(tokenizer, args.requests, [24 + (7 * i) % 40 for i in range(args.requests)],
                         seed=args.seed + 101)
    sched = new_scheduler(engine)
    try:
        jobs = [Job(tokens=system + u, max_new_tokens=args.shared_new, stop_ids=frozenset(), reuse_prefix=reuse)
                for u in users]
        t0 = time.perf_counter()
        for j in jobs:
            sched.submit(j)
        results = [j.future.result() for j in jobs]
        wall = time.perf_counter() - t0
        m = sched.metrics
        lookups, hits = m.prefix_lookups._value.get(), m.prefix_hits._value.get()
        generated = sum(len(r.generated) for r in results)
        return {"reuse": reuse, "requests": len(jobs), "wall_s": wall, "generated": generated,
                "tokens_per_s": generated / wall, "requests_per_s": len(jobs) / wall,
                "ttft_s": percentiles([r.timing["ttft_s"] for r in results]),
                "lookups": lookups, "hits": hits, "hit_rate": hits / lookups if lookups else None,
                "reused_tokens": m.prefix_reused_tokens._value.get(),
                "prefill_saved_tokens": m.prefix_saved_tokens._value.get(),
                "prompt_tokens": sum(len(j.tokens) for j in jobs), "tokens": [r.generated for r in results]}
    finally:
        sched.drain(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=1280)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-chat-len", type=int, default=550, help="the chat's system prompt, tokens")
    ap.add_argument("--user-len", type=int, default=60, help="tokens per user message")
    ap.add_argument("--reply", type=int, default=64, help="tokens per assistant reply")
    ap.add_argument("--reps", type=int, default=3, help="conversations")
    ap.add_argument("--system-len", type=int, default=500, help="the shared system prompt, tokens")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--shared-new", type=int, default=32, help="new tokens per shared-prompt request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 rep, 2 turns, 12 shared-prompt requests")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.turns, args.requests, args.reply = 1, 2, 12, 16
    if args.max_seq % args.chunk or args.max_seq % BLOCK:
        ap.error(f"--max-seq must be a multiple of --chunk and of {BLOCK}")

    from jaxstation.engine.engine import Engine
    from jaxstation.model.loader import load_model

    model = load_model(dtype=args.dtype)
    tok = model.tokenizer
    engine = Engine(model, lanes=args.lanes, max_seq=args.max_seq, chunk=args.chunk, block=BLOCK)
    engine.warmup()
    out: dict = {"config": dict(vars(args)), "model": str(model.source)}

    sched = new_scheduler(engine)
    run_one(sched, make_prompts(tok, 1, 40, seed=999)[0], 2, reuse=False)  # warm-up, not measured
    reps = [chat(sched, tok, args, seed=args.seed + 10 * i) for i in range(args.reps)]
    sched.drain(5)
    out["chat"] = {"reps": reps, "turns": []}
    for k in range(args.turns):
        rows = [rep[k] for rep in reps]
        row = {"turn": k + 1, "prompt_tokens": med_spread([r["prompt_tokens"] for r in rows]),
               "cached_tokens": med_spread([r["cached_tokens"] for r in rows]),
               "ttft_reuse_s": med_spread([r["ttft_reuse_s"] for r in rows]),
               "ttft_fresh_s": med_spread([r["ttft_fresh_s"] for r in rows]),
               "reuse_over_fresh": med_spread([r["ttft_reuse_s"] / r["ttft_fresh_s"] for r in rows]),
               "identical": all(r["identical"] for r in rows)}
        out["chat"]["turns"].append(row)
        print(f"turn {k + 1}: prompt {row['prompt_tokens']['median']:.0f} cached {row['cached_tokens']['median']:.0f}"
              f"  TTFT reuse {row['ttft_reuse_s']['median']:.3f}s fresh {row['ttft_fresh_s']['median']:.3f}s"
              f"  ratio {row['reuse_over_fresh']['median']:.2f}  identical {row['identical']}")

    shared = {"off": shared_system(engine, tok, args, reuse=False), "on": shared_system(engine, tok, args, reuse=True)}
    shared["identical"] = shared["on"].pop("tokens") == shared["off"].pop("tokens")
    shared["speedup"] = shared["on"]["tokens_per_s"] / shared["off"]["tokens_per_s"]
    out["shared_system"] = shared
    for mode in ("off", "on"):
        s = shared[mode]
        print(f"shared {args.system_len}-token system prompt, reuse {mode}: {s['tokens_per_s']:.1f} tok/s "
              f"({s['requests_per_s']:.2f} req/s, wall {s['wall_s']:.1f}s)  TTFT p50 {s['ttft_s']['p50']:.2f}s  "
              f"hit rate {s['hit_rate'] if s['hit_rate'] is None else round(s['hit_rate'], 3)}  "
              f"saved {s['prefill_saved_tokens']:.0f}/{s['prompt_tokens']} prompt tokens")
    print(f"speedup {shared['speedup']:.2f}x, identical tokens {shared['identical']}")
    print(f"wrote {write_result('prefix', out)}")


if __name__ == "__main__":
    main()
