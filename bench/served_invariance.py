"""Batch invariance as a user sees it: a `jaxstation serve` process with its default settings (continuous batching,
narrow waves, packed admission), and the openai client over HTTP. A greedy and a seeded completion, each alone and
then both together among 0, 2 and 6 neighbours that come and go (so each beside 1, 3 and 7 others); their texts,
log-probabilities and top log-probabilities compared with ==. Writes the counts and any difference to JSON.

`--random gemma2|gemma3` serves a random checkpoint of that family at a mid size (640 wide, 4 layers, the default
model's 49,152-token vocabulary and tokenizer), written once as a GGUF file into --workdir.

Usage:
  python -m bench.served_invariance --model gemma-3-270m-q4_k_m.gguf --max-seq 1024
  python -m bench.served_invariance --random gemma2 --max-seq 512
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import add_name_arg, model_name, wait_ready, write_result

TARGETS = [{"prompt": "The capital of France is", "temperature": 0.0},
           {"prompt": "def fibonacci(n):", "temperature": 0.8, "seed": 7}]
WORDS = ["Once", "upon", "a", "time", "the", "river", "sang", "42", "def", "while"]


def random_gemma(arch: str, path: Path) -> Path:
    """A random `arch` GGUF file (float32) with the default model's tokenizer, unless `path` exists."""
    import gguf

    from jaxstation.model.default_model import default_model_path

    if path.exists():
        return path
    rng = np.random.default_rng(0)
    d, ffn, layers, heads, head_dim = 640, 2048, 4, 4, 256
    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(str(path), arch)
    for name, field in source.fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_context_length(8192)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_attention_scale(head_dim ** -0.5)
    writer.add_sliding_window(512)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    else:
        writer.add_sliding_window_pattern([i % 4 != 3 for i in range(layers)])
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)

    def tensor(name: str, *shape: int, norm: bool = False) -> None:
        data = 1.0 + rng.normal(0, 0.1, shape) if norm else rng.normal(0, 0.02, shape)
        writer.add_tensor(name, data.astype(np.float32))

    tensor("token_embd.weight", vocab, d)
    tensor("output_norm.weight", d, norm=True)
    for i in range(layers):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(f"blk.{i}.{norm}.weight", d, norm=True)
        if arch == "gemma3":
            tensor(f"blk.{i}.attn_q_norm.weight", head_dim, norm=True)
            tensor(f"blk.{i}.attn_k_norm.weight", head_dim, norm=True)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, d)
        tensor(f"blk.{i}.attn_k.weight", head_dim, d)
        tensor(f"blk.{i}.attn_v.weight", head_dim, d)
        tensor(f"blk.{i}.attn_output.weight", d, heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, d)
        tensor(f"blk.{i}.ffn_up.weight", ffn, d)
        tensor(f"blk.{i}.ffn_down.weight", d, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def neighbours(n: int, rng: np.random.Generator) -> list[dict]:
    return [{"prompt": " ".join(rng.choice(WORDS, 12)), "temperature": 0.7, "seed": i,
             "max_tokens": int(rng.integers(4, 48)), "delay": float(rng.uniform(0, 1))} for i in range(n)]


def complete(http: httpx.Client, request: dict, new_tokens: int) -> tuple:
    time.sleep(request.get("delay", 0))
    body = {"model": "m", "prompt": request["prompt"], "max_tokens": request.get("max_tokens", new_tokens),
            "temperature": request["temperature"], "logprobs": 2, "ignore_eos": True}
    if "seed" in request:
        body["seed"] = request["seed"]
    reply = http.post("/v1/completions", json=body)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def first_difference(a: tuple, b: tuple) -> dict | None:
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        if x != y:
            return {"token": i, "alone": x, "beside": y}
    return None if a == b else {"token": None, "text_equal": a[0] == b[0]}


def probe(url: str, new_tokens: int) -> list[dict]:
    with httpx.Client(base_url=url, timeout=600) as http:
        alone = [complete(http, t, new_tokens) for t in TARGETS]
        rng = np.random.default_rng(3)
        rows = []
        for n in (0, 2, 6):
            with concurrent.futures.ThreadPoolExecutor(n + 2) as pool:
                beside = [pool.submit(complete, http, t, new_tokens) for t in TARGETS]
                for f in [pool.submit(complete, http, r, new_tokens) for r in neighbours(n, rng)]:
                    f.result()
                for target, a, f in zip(TARGETS, alone, beside, strict=True):
                    b = f.result()
                    rows.append({"target": target["prompt"], "others": n + 1, "tokens": len(b[1]), "equal": a == b,
                                 "first_difference": first_difference(a, b)})
        return rows


def serve(model: Path, args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--model", str(model), "--port", str(port),
           "--lanes", str(args.lanes), "--max-seq", str(args.max_seq)]
    env = {**os.environ, "MOONSHINE_CONTINUOUS_BATCH": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint to serve")
    ap.add_argument("--random", choices=["gemma2", "gemma3"], help="a random checkpoint of this family instead")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8431)
    add_name_arg(ap)
    args = ap.parse_args()
    if (args.model is None) == (args.random is None):
        ap.error("give one of --model and --random")
    model = args.model or random_gemma(args.random, args.workdir / f"random-{args.random}.gguf")
    url = f"http://127.0.0.1:{args.port}"
    proc = serve(model, args, args.port)
    try:
        wait_ready(proc, url, 900)
        rows = probe(url, args.new_tokens)
    finally:
        proc.terminate()
        proc.wait(30)
    import jax

    name = f"random-{args.random}" if args.random else model.stem
    payload = {"model": name, "lanes": args.lanes, "max_seq": args.max_seq,
               "new_tokens": args.new_tokens, "jax": jax.__version__, "cases": rows,
               "all_equal": all(r["equal"] for r in rows)}
    print(write_result("served_invariance", payload, model=model_name(name), variant=args.name))
    for r in rows:
        print(f"{r['target']!r:28} beside {r['others']}: {'equal' if r['equal'] else r['first_difference']}")


if __name__ == "__main__":
    main()
