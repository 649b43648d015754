"""Greedy parity probe: a deployed station's replies against a reference made beforehand, on CPU, for the same model.

`make` runs a fixed set of chat prompts greedily through the station's own engine on this machine (no server) and
writes their token ids and replies. `check` sends the same prompts to a station's POST /generate, all at once,
checks each reply is well-formed and equal to the reference, prints the first position where a reply departs from it,
and exits 1 on any failure. The station must run the same model, dtype, prefill chunk and KV block as the reference
(recorded in it).

Usage:
  python -m scripts.parity_probe make [--model PATH] [--dtype float32] [--out scripts/parity_reference.json]
  python -m scripts.parity_probe check --url URL [--reference scripts/parity_reference.json]
      (a bearer token, e.g. a Cloud Run identity token, is read from $JAXSTATION_BEARER_TOKEN)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.workload import reply_problems

REFERENCE = Path(__file__).resolve().parent / "parity_reference.json"
QUESTIONS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "Why is the sky blue? Answer briefly.",
)
MAX_NEW_TOKENS = 32
CHUNK, BLOCK = 32, 128  # the station's defaults (MOONSHINE_PREFILL_CHUNK, MOONSHINE_KV_BLOCK)


def make(model_path: str | None, dtype: str, out: Path) -> dict:
    from jaxstation.engine.engine import Engine, generate
    from jaxstation.engine.rows import SamplingParams
    from jaxstation.model.loader import load_model

    model = load_model(model_path, dtype)
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in QUESTIONS]
    engine = Engine(model, lanes=1, max_seq=BLOCK * -(-(max(map(len, prompts)) + MAX_NEW_TOKENS + 1) // BLOCK),
                    chunk=CHUNK, block=BLOCK)
    cases = [{"question": q, "tokens": p,
              "generated": generate(engine, p, MAX_NEW_TOKENS, SamplingParams(), stop_ids=frozenset(tok.eos_ids))}
             for q, p in zip(QUESTIONS, prompts, strict=True)]
    ref = {"model": Path(str(model.source)).name, "dtype": dtype, "prefill_chunk": CHUNK, "kv_block": BLOCK,
           "max_new_tokens": MAX_NEW_TOKENS, "cases": cases}
    head = json.dumps({k: v for k, v in ref.items() if k != "cases"})[:-1]
    out.write_text(head + ', "cases": [\n' + ",\n".join(json.dumps(c) for c in cases) + "\n]}\n")  # a case a line
    return ref


def problems(reply: object, case: dict, max_new: int) -> list[str]:
    """What is wrong with one /generate reply, against its reference case (empty: nothing)."""
    out = reply_problems(reply, len(case["tokens"]), max_new)
    if out or reply["generated"] == case["generated"]:
        return out
    gen, want = reply["generated"], case["generated"]
    at = next((i for i, (a, b) in enumerate(zip(gen, want, strict=False)) if a != b), min(len(gen), len(want)))
    return [f"differs from the reference at token {at}: got {gen[at:at + 5]}..., want {want[at:at + 5]}... "
            f"({len(gen)} vs {len(want)} tokens)"]


def check(url: str, reference: Path) -> int:
    import httpx

    ref = json.loads(reference.read_text())
    token = os.environ.get("JAXSTATION_BEARER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def run(client: httpx.Client, case: dict) -> list[str]:
        body = {"tokens": case["tokens"], "max_new_tokens": ref["max_new_tokens"], "temperature": 0}
        try:
            r = client.post("/generate", json=body)
            return [f"HTTP {r.status_code}: {r.text[:300]}"] if r.status_code != 200 else \
                problems(r.json(), case, ref["max_new_tokens"])
        except (httpx.HTTPError, ValueError) as e:
            return [f"{type(e).__name__}: {e}"]

    failed = 0
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600) as client, \
            ThreadPoolExecutor(len(ref["cases"])) as pool:  # all at once: a batch-invariant station's bits are alike
        for i, (case, found) in enumerate(zip(ref["cases"], pool.map(lambda c: run(client, c), ref["cases"]),
                                              strict=True)):
            failed += bool(found)
            print(f"case {i} ({case['question']!r}): {'ok' if not found else 'FAILED: ' + '; '.join(found)}")
    print(f"parity probe: {len(ref['cases']) - failed}/{len(ref['cases'])} replies equal to the reference "
          f"({ref['model']}, {ref['dtype']})")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write the reference from greedy runs on this machine")
    mk.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    mk.add_argument("--out", type=Path, default=REFERENCE)
    ck = sub.add_parser("check", help="compare a station's greedy replies with the reference")
    ck.add_argument("--url", required=True, help="the station's base URL")
    ck.add_argument("--reference", type=Path, default=REFERENCE)
    args = ap.parse_args(argv)
    if args.command == "make":
        ref = make(args.model, args.dtype, args.out)
        print(f"wrote {args.out}: {len(ref['cases'])} cases, {ref['model']} {ref['dtype']}")
        return 0
    return check(args.url, args.reference)


if __name__ == "__main__":
    sys.exit(main())
