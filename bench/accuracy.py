"""A weight format against the float32-dequantized model: logits, top-1, greedy continuations, perplexity.

The GGUF integer path (gguf: activations rounded to 8 bits per block), int8 or bfloat16 weights change the numbers;
this says by how much, on the default model or any GGUF file (`--model`):

- On every position of the prompts: the largest absolute logit difference to float32 and the top-1 agreement. The
  default model's prompts are the three public reference prompts (tests/reference/smollm2_hf_reference.npz); another
  model's are the four texts of tests/reference/gemma3_270m_reference.json.
- Greedy continuations (48 tokens through the real engine, no stop: an EOS is just a token) of both: equal or not,
  and where they first diverge.
- Over the repository's LICENSE text (Apache-2.0, about 2,300 tokens) in 1024-token windows: the perplexity of
  both, and the top-1 agreement under teacher forcing (both read the text; at how many positions do they predict the
  same next token).
- Over the same text as llama.cpp's `llama-perplexity -c 512` reads it (tokenized with the model's specials, cut
  into 512-token chunks that each open with the BOS where the model adds one, the second half of each chunk scored):
  the perplexity of both, and `llama-perplexity`'s own on the same file where it is built
  (scripts/build_llama_server.sh; or --llama-perplexity PATH).

Usage: python -m bench.accuracy [--dtype gguf] [--model FILE.gguf] [--llama-perplexity PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import add_name_arg, model_name, planned_model, write_result
from bench.peers import CACHE
from bench.workload import first_executable, repacking_crashes
from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.layers import forward_full

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "reference" / "smollm2_hf_reference.npz"
TEXT_PROMPTS = ROOT / "tests" / "reference" / "gemma3_270m_reference.json"
TEXT = ROOT / "LICENSE"
WINDOW = 1024
NEW = 48
LLAMA_CTX = 512  # llama-perplexity -c


def read_text(base, quant, ids: list[int]) -> dict[str, float]:
    """Both models over `ids` in non-overlapping windows of WINDOW tokens: each one's perplexity (exp of the mean
    next-token NLL) and the share of positions where their top-1 predictions agree."""
    nll, agree, n = np.zeros(2), 0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = jnp.asarray(ids[start:start + WINDOW + 1])
        tops = []
        for i, model in enumerate((base, quant)):
            logits = forward_full(model.cfg, model.params, window[:-1])
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll[i] -= float(jnp.take_along_axis(logp, window[1:, None], axis=-1).sum())
            tops.append(np.asarray(jnp.argmax(logits, axis=-1)))
        agree += int(np.sum(tops[0] == tops[1]))
        n += len(window) - 1
    ppl = np.exp(nll / n)
    return {"float32": float(ppl[0]), "other": float(ppl[1]), "top1_agreement": agree / n}


def llama_chunks(tokenizer, text: str) -> list[list[int]]:
    """The text as llama-perplexity reads it: tokenized with the model's specials, cut into LLAMA_CTX-token chunks,
    each opening with the BOS where the model adds one."""
    ids = tokenizer.encode(text)
    bos = ids[0] if len(ids) == len(tokenizer.encode(text, add_special_tokens=False)) + 1 else None
    chunks = [ids[i:i + LLAMA_CTX] for i in range(0, len(ids) - LLAMA_CTX + 1, LLAMA_CTX)]
    return [[bos, *c[1:]] if bos is not None else c for c in chunks]


def chunk_perplexity(model, chunks: list[list[int]]) -> float:
    """llama-perplexity's score: each chunk's second half, every position predicting the next token."""
    first, nll = LLAMA_CTX // 2, 0.0
    for chunk in chunks:
        logits = forward_full(model.cfg, model.params, jnp.asarray(chunk))[first:-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll -= float(jnp.take_along_axis(logp, jnp.asarray(chunk[first + 1:])[:, None], axis=-1).sum())
    return float(np.exp(nll / (len(chunks) * (LLAMA_CTX - first - 1))))


def llama_perplexity(binary: str, gguf: str) -> dict:
    """llama.cpp's own perplexity of the file over TEXT (its integer arithmetic), from `llama-perplexity`."""
    server = Path(binary).with_name("llama-server")  # built beside it: the probe of its weight repacking
    no_repack = server.is_file() and repacking_crashes(str(server))
    cmd = [binary, "-m", gguf, "-f", str(TEXT), "-c", str(LLAMA_CTX), "-t", str(os.cpu_count() or 1),
           *(["--no-repack"] if no_repack else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    chunks = re.search(r"perplexity over (\d+) chunks", out.stdout + out.stderr)
    if ppl is None or chunks is None:
        return {"error": (out.stdout + out.stderr)[-500:]}
    return {"perplexity": float(ppl.group(1)), "chunks": int(chunks.group(1)), "command": " ".join(cmd)}


def station_model(dtype: str, model: str | None):
    """The model as a station on this machine loads it (weights, layer walk, matmul)."""
    return planned_model(dtype=dtype, model=model)[0]


def prompts(model: str | None, tokenizer) -> dict[str, list[int]]:
    """The prompts compared position by position and continued greedily (see the module's docstring)."""
    if model is None:
        ref = np.load(REFERENCE)
        return {p: ref[f"{p}_prompt_ids"].tolist() for p in ("p0", "p1", "p2")}
    cases = json.loads(TEXT_PROMPTS.read_text(encoding="utf-8"))["greedy"]
    return {f"t{i}": tokenizer.encode(case["prompt"]) for i, case in enumerate(cases)}


def greedy_noeos(model, prompt: list[int]) -> list[int]:
    """NEW greedy tokens with no stop id, with the station's decode attention."""
    attention = resolve_plan(StationConfig(dtype="float32"), model.cfg).attention
    engine = Engine(model, lanes=1, max_seq=256, chunk=32, block=128, attention=attention)
    return generate(engine, prompt, NEW, SamplingParams())


def compare_prompt(base, quant, prompt: list[int], dtype: str) -> dict:
    """Logits at every position of `prompt` and 48 greedy tokens after it, of both models."""
    a = np.asarray(forward_full(base.cfg, base.params, jnp.asarray(prompt)))
    b = np.asarray(forward_full(quant.cfg, quant.params, jnp.asarray(prompt)), np.float32)
    ga, gb = greedy_noeos(base, prompt), greedy_noeos(quant, prompt)
    diverge = next((i for i, (x, y) in enumerate(zip(ga, gb, strict=True)) if x != y), None)
    row = {"positions": len(prompt), "max_abs_logit_diff": float(np.abs(a - b).max()),
           "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))), "greedy_equal": ga == gb,
           "first_divergence": diverge}
    if diverge is not None:
        row["float32_text_after"] = base.tokenizer.decode(ga[diverge:diverge + 12])
        row[f"{dtype}_text_after"] = base.tokenizer.decode(gb[diverge:diverge + 12])
        row["shared_text"] = base.tokenizer.decode(ga[:diverge])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2 Q4_1)")
    add_name_arg(ap)
    ap.add_argument("--llama-perplexity", default=None,
                    help="path of llama.cpp's llama-perplexity (default: the build cache, then PATH)")
    args = ap.parse_args()
    base, quant = station_model("float32", args.model), station_model(args.dtype, args.model)
    rows = []
    for name, prompt in prompts(args.model, base.tokenizer).items():
        rows.append({"prompt": name, **compare_prompt(base, quant, prompt, args.dtype)})
        print(rows[-1], flush=True)
    text_ids = base.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    text = read_text(base, quant, text_ids)
    ppl = {"text": TEXT.name, "tokens": len(text_ids), "float32": text["float32"], args.dtype: text["other"],
           "top1_agreement": text["top1_agreement"]}
    print(ppl)
    chunks = llama_chunks(base.tokenizer, TEXT.read_text())
    llama = {"text": TEXT.name, "ctx": LLAMA_CTX, "chunks": len(chunks), "float32": chunk_perplexity(base, chunks),
             args.dtype: chunk_perplexity(quant, chunks)}
    binary = first_executable(args.llama_perplexity, str(CACHE / "llama-perplexity"))
    llama["llama.cpp"] = llama_perplexity(binary, str(base.source)) if binary else {"error": "not built"}
    print(llama)
    path = write_result(f"accuracy_{args.dtype}", {
        "dtype": args.dtype, "model": str(base.source), "weight_bytes": {
            "float32": base.params.nbytes, args.dtype: quant.params.nbytes}, "prompts": rows, "perplexity": ppl,
        "llama_perplexity_protocol": llama}, model=model_name(args.model), variant=args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
