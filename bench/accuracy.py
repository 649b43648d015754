"""int8 (or bfloat16) weights against float32 on the default model: logits, top-1, greedy continuations, perplexity.

- On every stored position of the three public reference prompts (tests/reference/smollm2_hf_reference.npz): the
  largest absolute logit difference to float32 and the top-1 agreement.
- Greedy continuations (48 tokens through the real engine, no stop: an EOS is just a token) of both: equal or not,
  and where they first diverge.
- Perplexity of the repository's LICENSE text (Apache-2.0, about 2,300 tokens) in 1024-token windows.

Usage: python -m bench.accuracy [--dtype int8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import planned_model, write_result
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.layers import forward_full
from jaxstation.serving.plan import resolve_plan
from jaxstation.serving.settings import StationConfig

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "reference" / "smollm2_hf_reference.npz"
TEXT = ROOT / "LICENSE"
WINDOW = 1024
NEW = 48


def perplexity(model, ids: list[int]) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of WINDOW tokens."""
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = jnp.asarray(ids[start:start + WINDOW + 1])
        logp = jax.nn.log_softmax(forward_full(model.cfg, model.params, window[:-1]), axis=-1)
        nll -= float(jnp.take_along_axis(logp, window[1:, None], axis=-1).sum())
        n += len(window) - 1
    return float(np.exp(nll / n))


def station_model(dtype: str):
    """The model as a station on this machine loads it (weights, layer walk, matmul)."""
    return planned_model(dtype=dtype)[0]


def greedy_noeos(model, prompt: list[int]) -> list[int]:
    """NEW greedy tokens with no stop id, with the station's decode attention."""
    attention = resolve_plan(StationConfig(dtype="float32"), model.cfg).attention
    engine = Engine(model, lanes=1, max_seq=256, chunk=32, block=128, attention=attention)
    return generate(engine, prompt, NEW, SamplingParams())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="int8")
    args = ap.parse_args()
    ref = np.load(REFERENCE)
    base, quant = station_model("float32"), station_model(args.dtype)
    text_ids = base.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    rows = []
    for p in ("p0", "p1", "p2"):
        prompt = ref[f"{p}_prompt_ids"].tolist()
        a = np.asarray(forward_full(base.cfg, base.params, jnp.asarray(prompt)))
        b = np.asarray(forward_full(quant.cfg, quant.params, jnp.asarray(prompt)), np.float32)
        ga, gb = greedy_noeos(base, prompt), greedy_noeos(quant, prompt)
        diverge = next((i for i, (x, y) in enumerate(zip(ga, gb, strict=True)) if x != y), None)
        row = {"prompt": p, "positions": len(prompt), "max_abs_logit_diff": float(np.abs(a - b).max()),
               "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
               "float32_vs_hf_top1": float(np.mean(a.argmax(-1) == ref[f"{p}_top64_ids"][:, 0])),
               "greedy_equal": ga == gb, "first_divergence": diverge}
        if diverge is not None:
            row["float32_text_after"] = base.tokenizer.decode(ga[diverge:diverge + 12])
            row[f"{args.dtype}_text_after"] = base.tokenizer.decode(gb[diverge:diverge + 12])
            row["shared_text"] = base.tokenizer.decode(ga[:diverge])
        rows.append(row)
        print(row, flush=True)
    ppl = {"text": TEXT.name, "tokens": len(text_ids), "float32": perplexity(base, text_ids),
           args.dtype: perplexity(quant, text_ids)}
    print(ppl)
    path = write_result(f"accuracy_{args.dtype}", {"dtype": args.dtype, "weight_bytes": {
        "float32": base.params.nbytes, args.dtype: quant.params.nbytes}, "prompts": rows, "perplexity": ppl})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
