"""A smaller KV arena against the float32 arena: perplexity and top-1 agreement over one long context.

Every token of a long text (the repository's docs, concatenated, cut to --tokens) is scored through the engine's own
chunked prefill (`Engine.prefill_scored`): its log-probability given every token before it, with the keys and values
of those tokens read back from the arena, once from a float32 arena and once from a --kv-dtype one. Reported: the
perplexity of each, and how often their top-1 next tokens agree. One lane, the blocked attention for both, windows as
the station keeps them (rings by default), so only the arena's dtype differs.

Usage: python -m bench.kv_quality --model gemma-3-270m.gguf --tokens 8192 --kv-dtype bfloat16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import model_name, planned_model, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.loader import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
CHUNK, BLOCK = 32, 128


def long_text(model: LoadedModel, tokens: int) -> list[int]:
    """The first `tokens` tokens of README.md and docs/*.md, concatenated."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ids = model.tokenizer.encode("\n\n".join(f.read_text() for f in files))
    if len(ids) < tokens:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than --tokens {tokens}")
    return ids[:tokens]


def score(model: LoadedModel, ids: list[int], kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability [n - 1] of each token after the first, the top-1 token [n - 1] at each of those positions)."""
    max_seq = -(-(len(ids) + 1) // BLOCK) * BLOCK
    engine = Engine(model, lanes=1, max_seq=max_seq, chunk=CHUNK, block=BLOCK, attention="blocked",
                    kv_dtype=kv_dtype)
    engine.begin(0, ids, SamplingParams(), frozenset())
    scored = []
    for start in range(0, len(ids), CHUNK):
        scored += engine.prefill_scored(0, ids, start, SamplingParams())[1]
    return (np.array([s.logprob for s in scored]),
            np.array([max(s.top, key=lambda t: t[1])[0] for s in scored]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF directory or .gguf file (default: the default model)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv-dtype", default="bfloat16")
    args = ap.parse_args()
    model, plan = planned_model(model=args.model)
    ids = long_text(model, args.tokens)
    base_lp, base_top = score(model, ids, "float32")
    lp, top = score(model, ids, args.kv_dtype)
    row = {"model": str(model.source), "weights": plan.dtype, "tokens": len(ids),
           "perplexity_float32": float(np.exp(-base_lp.mean())),
           f"perplexity_{args.kv_dtype}": float(np.exp(-lp.mean())),
           "top1_agreement": float(np.mean(base_top == top)),
           "max_abs_logprob_diff": float(np.abs(base_lp - lp).max())}
    row["perplexity_ratio"] = row[f"perplexity_{args.kv_dtype}"] / row["perplexity_float32"]
    print(row)
    print(f"wrote {write_result(f'kv_quality_{args.kv_dtype}', row, model=model_name(args.model))}")


if __name__ == "__main__":
    main()
