"""Agent replay: many two-turn conversations on few lanes, and how much of each next turn the prefix cache's tiers
spare.

`--conversations` conversations share a station of `--lanes` lanes, built in process as `jaxstation serve` builds it
(the station's plan for `--model`, its engine, a Scheduler with the host tier at the station's default size,
`--prefix-cache-ram`; no disk tier and no speculative decoding). Turn 1 of every conversation is its own
`--doc`-token document and a `--question`-token question (random English through the model's tokenizer); every turn
1 is submitted at once, then every turn 2: turn 1's prompt, its greedy reply (`--reply` tokens) and a new question.
With more conversations than lanes, most turns 2 find their lane taken and resume from the host tier.

Per turn: each conversation's prompt tokens and the prompt tokens prefilled (its job's `cached_tokens` reused, the
rest prefilled), and after every turn the host tier's bytes and entries (`/metrics`' gauges) and the process's
resident memory (VmRSS). Acceptance: turn 2 prefills at most 10% of its prompt tokens.

Usage:
  python -m bench.agent_replay                                   # the default model, 24 conversations, 4 lanes
  python -m bench.agent_replay --model /path/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse

from bench.common import add_name_arg, model_name, write_result
from bench.workload import make_prompts
from jaxstation.engine.host_memory import resident_bytes


def tier_state(sched) -> dict:
    value = sched.metrics.registry.get_sample_value
    saved = {tier: value("jaxstation_prefix_cache_tier_saved_tokens_total", {"tier": tier}) or 0.0
             for tier in ("lane", "memory")}
    return {"tier_bytes": value("jaxstation_prefix_cache_memory_bytes") or 0.0,
            "tier_entries": value("jaxstation_prefix_cache_memory_entries") or 0.0,
            "saved_tokens": saved, "rss_bytes": resident_bytes()}


def run_turn(sched, prompts: list[list[int]], reply: int) -> list:
    from jaxstation.engine.jobs import Job

    jobs = [Job(tokens=p, max_new_tokens=reply, stop_ids=frozenset()) for p in prompts]
    for job in jobs:
        sched.submit(job)
    return [job.future.result() for job in jobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="as `serve --model` (default: the station's default model)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--doc", type=int, default=800, help="tokens of each conversation's document")
    ap.add_argument("--question", type=int, default=24, help="tokens of each question")
    ap.add_argument("--reply", type=int, default=32, help="tokens of turn 1's greedy reply")
    ap.add_argument("--seed", type=int, default=0)
    add_name_arg(ap)
    args = ap.parse_args()

    from jaxstation.config.memory import prefix_cache_ram
    from jaxstation.config.plan import load_planned, planned_engine, startup_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.engine.scheduler import Scheduler
    from jaxstation.server.station import warm_up

    settings = {"lanes": args.lanes, "max_seq": args.max_seq}
    if args.model is not None:
        settings["model"] = args.model
    config = StationConfig(**settings)
    plan = startup_plan(config)
    model = load_planned(config, plan)
    engine = planned_engine(model, config, plan)
    warm_up(engine, None, None)
    ram = prefix_cache_ram(config)
    sched = Scheduler(engine, continuous=True, max_queue=4 * args.conversations, terminal_ids=frozenset(),
                      prefix_cache_ram=ram)
    sched.start()
    tok = model.tokenizer
    n = args.conversations
    docs = make_prompts(tok, n, args.doc, seed=args.seed)
    questions = make_prompts(tok, 2 * n, args.question, seed=args.seed + 1)
    out: dict = {"config": dict(vars(args)), "model": str(model.source), "station": "in-process Scheduler",
                 "chunk": engine.chunk, "kv_dtype": str(engine.arena.k.dtype), "prefix_cache_ram": ram,
                 "ring": engine.ring, "rss_before_bytes": resident_bytes(), "turns": []}
    try:
        prompts = [docs[i] + questions[i] for i in range(n)]
        for k in (1, 2):
            results = run_turn(sched, prompts, args.reply)
            rows = [{"prompt_tokens": len(p), "cached_tokens": int(r.timing["cached_tokens"]),
                     "prefilled_tokens": len(p) - int(r.timing["cached_tokens"])}
                    for p, r in zip(prompts, results, strict=True)]
            total, prefilled = sum(r["prompt_tokens"] for r in rows), sum(r["prefilled_tokens"] for r in rows)
            turn = {"turn": k, "prompt_tokens": total, "prefilled_tokens": prefilled,
                    "prefilled_fraction": prefilled / total, "conversations": rows, **tier_state(sched)}
            out["turns"].append(turn)
            print(f"turn {k}: {prefilled}/{total} prompt tokens prefilled ({prefilled / total:.1%}); tier "
                  f"{turn['tier_bytes'] / 2**20:.1f} MiB in {turn['tier_entries']:.0f} entries; saved "
                  f"{turn['saved_tokens']}; RSS {turn['rss_bytes'] / 2**20:.0f} MiB", flush=True)
            prompts = [p + r.generated + questions[n + i] for i, (p, r) in enumerate(zip(prompts, results,
                                                                                          strict=True))]
    finally:
        sched.drain(10)
    out["turn2_prefilled_fraction"] = out["turns"][1]["prefilled_fraction"]
    out["accepted"] = out["turn2_prefilled_fraction"] <= 0.10
    print(f"turn 2 prefilled {out['turn2_prefilled_fraction']:.1%} of its prompt tokens (<= 10%: {out['accepted']})")
    print(f"wrote {write_result('agent_replay', out, model=model_name(args.model), variant=args.name)}")


if __name__ == "__main__":
    main()
