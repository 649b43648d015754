"""Every station setting's row: its StationConfig field, its environment variable, its CLI flag, how its text is
parsed and its help, and the commands that use it.

Every environment variable has a mirroring CLI flag (`MOONSHINE_BATCH_LANES` <-> `--lanes`, ...). `PORT` is honoured
because Cloud Run sets it. config/settings.py resolves the rows into one `StationConfig`; cli.py registers the flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxstation.config.setting_values import (
    parse_bool,
    parse_float,
    parse_int,
    parse_lora_modules,
    parse_names,
    parse_str,
)
from jaxstation.engine.choices import PACK_BUDGET_AUTO

COMMANDS = ("serve", "station", "host", "batch")
_ALL = frozenset(COMMANDS)
_LISTEN = frozenset({"serve", "station", "host"})  # the commands that listen on a socket
_FRONT = frozenset({"serve", "host"})  # the commands that serve the API: a station or a mesh host
_MESH = frozenset({"station", "host"})
_SERVE = frozenset({"serve"})  # one station process, on one device (runtime LoRA routes, a group of processes)
_LOCAL = frozenset({"serve", "batch"})  # a station's own engine in this process (batch: a file, no HTTP)
_API = frozenset({"serve", "host", "batch"})  # the commands that answer the API's requests


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting's row."""

    field: str
    env: str | None
    flag: str
    parse: Callable[[str, str], Any]
    help: str
    commands: frozenset[str] = _ALL  # the commands that use it: only they take its flag and read its variable


# One row per setting: the StationConfig field, its environment variable, its CLI flag.
SETTINGS: tuple[Setting, ...] = (
    Setting("model", "MOONSHINE_MODEL", "--model", parse_str,
            "HF directory, .gguf file, or a Hugging Face Hub model: org/name, or org/name:QUANT for one quant of a "
            "GGUF repository (downloaded into the Hugging Face cache; default: the embedded SmolLM2-135M-Instruct "
            "GGUF)"),
    Setting("revision", "MOONSHINE_MODEL_REVISION", "--revision", parse_str,
            "a Hub model's branch, tag or commit (default: main)"),
    Setting("dtype", "MOONSHINE_DTYPE", "--dtype", parse_str,
            "weight dtype: gguf (a GGUF model's matrices in their stored blocks, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
            "Q5_K or Q6_K, on the CPU kernel, multiplied in integers over activations rounded to 8 bits per block, "
            "as llama.cpp does), gguf-exact (the same blocks, float32's exact bits over the dequantized weights), "
            "float32, bfloat16 or int8 "
            "(weight-only, per output channel; activations and the KV arena stay float32 on CPU, bfloat16 on a GPU) "
            "(default: gguf on CPU for a GGUF model where the CPU kernel builds, else float32; bfloat16 on a "
            "GPU)"),
    Setting("attention", "MOONSHINE_ATTENTION", "--attention", parse_str,
            "decode attention: blocked (online softmax over KV blocks), kernel (the CPU decode attention kernel), xla "
            "or cudnn (jax.nn.dot_product_attention with per-lane lengths); auto is cudnn on a GPU for bfloat16, "
            "kernel on CPU for float32 activations when it builds, else blocked"),
    Setting("layer_loop", "MOONSHINE_LAYER_LOOP", "--layer-loop", parse_str,
            "scan (stacked layer weights in one loop) or unroll (one weight buffer per layer); auto is unroll, "
            "except scan for int8 on CPU with XLA's dot"),
    Setting("matmul", "MOONSHINE_MATMUL", "--matmul", parse_str,
            "projections: kernel (the CPU kernel: int8 read as int8, rows independent of the wave's width, built with "
            "the system C++ compiler at first use), xla (XLA's dot); auto is kernel on CPU for float32 and int8 "
            "when it builds, else xla"),
    Setting("tensor_parallel", "MOONSHINE_TENSOR_PARALLEL", "--tensor-parallel", parse_int,
            "devices one model is split over (heads, KV heads and the MLP's width; docs/sharding.md); above 1 it runs "
            "XLA's dot and full waves", commands=frozenset({"serve", "station", "batch"})),
    Setting("coordinator_address", "MOONSHINE_COORDINATOR_ADDRESS", "--coordinator-address", parse_str,
            "a group of processes: host:port of the JAX coordinator, which process 0 runs (its port + 1 carries the "
            "step calls)", commands=frozenset({"serve"})),
    Setting("num_processes", "MOONSHINE_NUM_PROCESSES", "--num-processes", parse_int,
            "a group of processes: how many (default: LWS_GROUP_SIZE, else 1)", commands=frozenset({"serve"})),
    Setting("process_id", "MOONSHINE_PROCESS_ID", "--process-id", parse_int,
            "a group of processes: this one's index, 0 serving HTTP (default: LWS_WORKER_INDEX or "
            "JOB_COMPLETION_INDEX)", commands=frozenset({"serve"})),
    Setting("host", "MOONSHINE_HOST", "--host", parse_str, "TCP bind address", commands=_LISTEN),
    Setting("port", "PORT", "--port", parse_int, "TCP port (PORT is honoured, as Cloud Run sets it)",
            commands=_LISTEN),
    Setting("uds", "MOONSHINE_UDS", "--uds", parse_str, "listen on this Unix socket instead of TCP",
            commands=_LISTEN),
    Setting("lanes", "MOONSHINE_BATCH_LANES", "--lanes", parse_int, "decode lanes, i.e. max concurrent requests"),
    Setting("wave_widths", "MOONSHINE_WAVE_WIDTHS", "--wave-widths", parse_str,
            "decode wave widths: auto (1, 2, 4, ... up to the lanes when every matmul runs on the CPU kernel, else "
            "only the lanes), full (every wave runs all lanes) or a list such as 1,4,16 (the lanes are added); a wave "
            "runs at the narrowest width that holds its live lanes, and each width is one more compiled program",
            commands=_LOCAL),
    Setting("prefill_budget", "MOONSHINE_PREFILL_BUDGET", "--prefill-budget", parse_str,
            "packed admission: rows per step holding prompt tokens from every prefilling lane and the decode tokens "
            f"riding with them; auto ({PACK_BUDGET_AUTO} where waves may run narrow, i.e. every matmul on the CPU "
            "kernel, else off), off (one prefill chunk per turn, decode in its own wave) or a number of rows, at "
            "least the lanes", commands=_LOCAL),
    Setting("max_seq", "MOONSHINE_MAX_SEQ", "--max-seq", parse_int,
            "positions per lane: prompt + max_new_tokens <= max_seq (serve, one process: by default the model's "
            "context length, or the longest whose arena and weights take half the free memory; else 2048)"),
    Setting("prefill_chunk", "MOONSHINE_PREFILL_CHUNK", "--prefill-chunk", parse_int,
            "prompt tokens per prefill step"),
    Setting("kv_block", "MOONSHINE_KV_BLOCK", "--kv-block", parse_int, "positions per attention KV block"),
    Setting("kv_windows", "MOONSHINE_KV_WINDOWS", "--kv-windows", parse_str,
            "sliding-window layers: ring (keep only their window, rounded up to the KV block; the tokens are the "
            "same) or full (every position, as global layers; llama.cpp's --swa-full)", commands=_LOCAL),
    Setting("kv_dtype", "MOONSHINE_KV_DTYPE", "--kv-dtype", parse_str,
            "the KV arena's dtype: auto (the activations': float32 on CPU), float32, bfloat16 (half the bytes) or "
            "int8 (with a float32 scale per position and head: about a quarter); k and v are rounded when written "
            "and read as the activations' dtype; on CPU the decode attention then takes the blocked walk",
            commands=_LOCAL),
    Setting("continuous", "MOONSHINE_CONTINUOUS_BATCH", "--continuous-batch", parse_bool,
            "continuous batching: on batches concurrent requests into each decode wave; off serves one request at a "
            "time", commands=_FRONT),
    Setting("prefix_reuse", "MOONSHINE_PREFIX_REUSE", "--prefix-reuse", parse_str,
            "reuse cached prompt KV: auto (every request), resume (only /generate with resume: true) or off",
            commands=_API),
    Setting("prefix_cache_ram", "MOONSHINE_PREFIX_CACHE_RAM", "--prefix-cache-ram", parse_int,
            "MiB of host memory for cached prompt KV beyond the lanes, least recently used evicted (default: a "
            "quarter of the available RAM, at most 8 GiB; 0: off)", commands=_LOCAL),
    Setting("prefix_cache_dir", "MOONSHINE_PREFIX_CACHE_DIR", "--prefix-cache-dir", parse_str,
            "directory for the prefix cache's disk tier: the host tier's entries are written there and a station "
            "restarted over it reuses them (default: none)", commands=_LOCAL),
    Setting("prefix_cache_disk_mb", "MOONSHINE_PREFIX_CACHE_DISK_MB", "--prefix-cache-disk-mb", parse_int,
            "MiB of files in --prefix-cache-dir, least recently used deleted (default: 4096)", commands=_LOCAL),
    Setting("speculative", "MOONSHINE_SPECULATIVE", "--speculative", parse_str,
            "speculative decoding: off, ngram (prompt-lookup drafts) or draft (a draft model's; --draft-model), "
            "verified in one step; the tokens are the same", commands=_LOCAL),
    Setting("draft_model", "MOONSHINE_DRAFT_MODEL", "--draft-model", parse_str,
            "speculative decoding with a draft model: its HF directory or .gguf file, with the model's vocabulary",
            commands=_LOCAL),
    Setting("draft_tokens", "MOONSHINE_DRAFT_TOKENS", "--draft-tokens", parse_int,
            "speculative decoding: the most tokens a request drafts a step", commands=_LOCAL),
    Setting("lora_modules", "MOONSHINE_LORA_MODULES", "--lora-modules", parse_lora_modules,
            "LoRA adapters served beside the model, as name=path (a PEFT directory or a GGUF LoRA file), several "
            "separated by spaces or commas; a request names one in `model` (docs/lora.md)",
            commands=_LOCAL),
    Setting("max_loras", "MOONSHINE_MAX_LORAS", "--max-loras", parse_int,
            "LoRA adapters resident at once (default: the --lora-modules given, at least 1 with "
            "--allow-runtime-lora)", commands=_LOCAL),
    Setting("max_lora_rank", "MOONSHINE_MAX_LORA_RANK", "--max-lora-rank", parse_int,
            "the highest LoRA rank a station holds (adapters above it are refused)", commands=_LOCAL),
    Setting("allow_runtime_lora", "MOONSHINE_ALLOW_RUNTIME_LORA", "--allow-runtime-lora", parse_bool,
            "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: both answer 404)",
            commands=_SERVE),
    Setting("max_queue", "MOONSHINE_MAX_QUEUE", "--max-queue", parse_int,
            "jobs waiting for a lane before new ones get 503", commands=_API),
    Setting("drain_s", "MOONSHINE_DRAIN_S", "--drain-s", parse_float,
            "seconds in-flight requests get to finish after SIGTERM", commands=_FRONT),
    Setting("max_body_bytes", "MOONSHINE_MAX_BODY_BYTES", "--max-body-bytes", parse_int,
            "largest request body accepted (413 past it)", commands=_FRONT),
    Setting("api_key", "MOONSHINE_API_KEY", "--api-key", parse_str,
            "API key: with it set, every route except /health and /ready needs 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')",
            commands=_FRONT),
    Setting("web", "MOONSHINE_WEB", "--web", parse_bool,
            "the chat page at / (static files in the package; off: / answers 404)", commands=_FRONT),
    Setting("chat_template", "MOONSHINE_CHAT_TEMPLATE", "--chat-template", parse_str,
            "the chat template, in place of the checkpoint's (or for a checkpoint without one): a Jinja file, or the "
            "template itself", commands=_API),
    Setting("served_model_name", "MOONSHINE_SERVED_MODEL_NAME", "--served-model-name", parse_names,
            "the model's name in /v1/models and in replies, or several comma-separated (replies carry the first); "
            "default: the checkpoint's file or directory name. Requests may name any model", commands=_API),
    Setting("reasoning_parser", "MOONSHINE_REASONING_PARSER", "--reasoning-parser", parse_str,
            "split <think>...</think> from the answer: qwen3, deepseek_r1 (the output starts in the thinking), none, "
            "or auto (qwen3 when the chat template writes </think>, else none)", commands=_API),
    Setting("responses_store_size", "MOONSHINE_RESPONSES_STORE_SIZE", "--responses-store-size", parse_int,
            "/v1/responses: stored responses kept in memory (oldest evicted first; lost on restart)",
            commands=_FRONT),
    Setting("responses_store_age_s", "MOONSHINE_RESPONSES_STORE_AGE_S", "--responses-store-age-s", parse_float,
            "/v1/responses: seconds a stored response is kept", commands=_FRONT),
    Setting("log_format", "MOONSHINE_LOG_FORMAT", "--log-format", parse_str,
            "log lines as plain text or as one JSON object per line (Cloud Run's structured logging): text or json"),
    Setting("compile_cache_dir", "MOONSHINE_COMPILE_CACHE_DIR", "--compile-cache-dir", parse_str,
            "JAX persistent compilation cache: a local path, a mounted volume or gs://bucket/dir (default off)"),
    Setting("layers", "MOONSHINE_LAYERS", "--layers", parse_str, "mesh station: the layer range A:B it holds",
            commands=frozenset({"station"})),
    Setting("stations", "MOONSHINE_MESH_STATIONS", "--stations", parse_str,
            "mesh host: the stations' base URLs, comma-separated",
            commands=frozenset({"host"})),
    Setting("mesh_token", "MOONSHINE_MESH_TOKEN", "--mesh-token", parse_str,
            "the bearer token stations require on /forward, /lm_head and /info (keep it secret)",
            commands=_MESH),
    Setting("insecure_mesh", "MOONSHINE_INSECURE_MESH", "--insecure-mesh", parse_bool,
            "allow a mesh without a token (a trusted network only)",
            commands=_MESH),
    Setting("mesh_recover_s", "MOONSHINE_MESH_RECOVER_S", "--mesh-recover-s", parse_float,
            "mesh host: seconds to wait for a lost station before failing the requests in flight",
            commands=frozenset({"host"})),
    Setting("mesh_hop_timeout_s", "MOONSHINE_MESH_HOP_TIMEOUT_S", "--mesh-hop-timeout-s", parse_float,
            "mesh host: timeout of one request to one station",
            commands=frozenset({"host"})),
    Setting("mesh_pipeline", "MOONSHINE_MESH_PIPELINE", "--mesh-pipeline", parse_bool,
            "mesh host: split the lanes into one group per station and overlap the groups' waves",
            commands=frozenset({"host"})),
)
BY_FIELD = {s.field: s for s in SETTINGS}


def default_name(field: str) -> str:
    """How an error names a setting nobody set: its environment variable (the flag is in --help)."""
    s = BY_FIELD[field]
    return s.env or s.flag
