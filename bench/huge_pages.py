"""A decode step with the weights on 2 MiB pages against the same step with them on 4 KB pages, in one process.

The model is loaded twice, as a station plans it: once as `load_planned` keeps it (its weights collapsed onto 2 MiB
pages, `host_memory.keep_on_huge_pages`) and once by `load_model` alone (4 KB pages), each with its own engine (the
second one `--max-seq` 128 positions longer, so that the two compile programs of their own). A lone row decodes on
each in turn (with `--full`, every lane: a full-width wave), the order alternating, and the ratio is the median of
the pairs' ratios. Then the second copy is
collapsed too and the pairs run again: a control, which should give 1.

Usage:
  python -m bench.huge_pages                                  # the default model, 1 lane
  python -m bench.huge_pages --model gemma-3-270m-q4_k_m.gguf --lanes 1 8
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_result


def pairs(engines: list, lanes: int, rounds: int, full: bool) -> dict:
    """Decode steps of a lone row (or, `full`, of every lane) on each engine in turn: medians (us) and the median of
    the pairs' ratios (first/second)."""
    from jaxstation.engine.rows import DecodeRow, SamplingParams

    rows = [DecodeRow(1 + lane, 127, SamplingParams(), 0) if full or lane == 0 else None for lane in range(lanes)]
    times: list[list[float]] = [[], []]
    for e in engines:
        for _ in range(10):
            e.decode(rows)
    for i in range(rounds):
        for j in ((0, 1) if i % 2 else (1, 0)):
            t = time.perf_counter()
            engines[j].decode(rows)
            times[j].append(time.perf_counter() - t)
    return {"huge_us": 1e6 * statistics.median(times[0]), "small_us": 1e6 * statistics.median(times[1]),
            "ratio": statistics.median(a / b for a, b in zip(*times, strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: the default model)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1])
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--full", action="store_true", help="every lane decodes (a full-width wave), not a lone row")
    ap.add_argument("--name", default="huge_pages")
    args = ap.parse_args()
    from jaxstation.config.plan import load_planned, planned_engine, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.kernels import host_memory
    from jaxstation.model.loader import checkpoint_config, load_model

    out = {}
    for lanes in args.lanes:
        configs = [StationConfig(lanes=lanes, max_seq=args.max_seq + 128 * i, **({"model": args.model} if args.model
                                                                                 else {})) for i in range(2)]
        plans = [resolve_plan(c, checkpoint_config(c.model)) for c in configs]
        huge = load_planned(configs[0], plans[0])
        small = load_model(configs[1].model, plans[1].dtype, plans[1].layer_loop, plans[1].matmul)
        engines = [planned_engine(m, c, p) for m, c, p in zip((huge, small), configs, plans, strict=True)]
        measured = pairs(engines, lanes, args.rounds, args.full)
        collapsed = host_memory.keep_on_huge_pages(small.params)
        control = pairs(engines, lanes, args.rounds, args.full)
        out[str(lanes)] = {"huge_vs_small": measured, "both_huge": control, "second_collapsed_bytes": collapsed[0]}
        print(f"lanes {lanes}: 2 MiB pages {measured['huge_us']:.0f} us, 4 KB pages {measured['small_us']:.0f} us, "
              f"ratio {measured['ratio']:.3f}; both on 2 MiB pages: ratio {control['ratio']:.3f}", flush=True)
    print(f"wrote {write_result(args.name, {'args': vars(args), 'lanes': out})}")


if __name__ == "__main__":
    main()
