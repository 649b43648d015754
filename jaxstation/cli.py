"""`jaxstation generate` runs one prompt on a one-lane engine; `jaxstation serve` runs the station server;
`jaxstation batch` answers an OpenAI batch file; `jaxstation download` fetches a Hub model; `jaxstation station
--layers A:B` and `jaxstation host --stations URL,...` run a model split across a mesh.

The command line imports JAX, the engine, the model and the server only once a command needs them: `--version`,
`--help` and a refused setting or model path answer without them."""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jaxstation import __version__
from jaxstation.config.flags import COMMANDS, SETTINGS
from jaxstation.config.gpu_memory import use_gpu_memory_fraction
from jaxstation.config.hub_model import local_model, local_path
from jaxstation.config.settings import DTYPES, ConfigError, StationConfig, add_arguments, resolve
from jaxstation.model.source import CheckpointError, model_source

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from jaxstation.group.process_group import Group
    from jaxstation.server.station import Station


def _plugin_error_in_one_line(record: logging.LogRecord) -> bool:
    """A JAX plug-in that cannot start logs its traceback: the CUDA image on a machine without a GPU driver
    (`cuInit(0) failed`). Keep one line, the error itself: JAX then runs on the backends that started (CPU)."""
    if record.exc_info and record.exc_info[1] is not None:
        error = record.exc_info[1]
        record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
        record.args, record.exc_info, record.exc_text = (), None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _import_jax() -> None:
    """Import JAX, then keep its loggers to warnings: JAX takes the `jax` logger's level at import for its own logging
    setting (and with one set, adds a handler of its own), so the level is set after it."""
    import jax  # noqa: F401

    logging.getLogger("jax").setLevel(logging.WARNING)  # not the backend probe's INFO lines


def cmd_generate(args: argparse.Namespace) -> int:
    args.model = local_path(args.model, args.revision)
    model_source(args.model)  # a path that names no checkpoint is refused before JAX loads
    _import_jax()
    from jaxstation.config.plan import load_planned, planned_engine, startup_plan
    from jaxstation.engine.engine import generate
    from jaxstation.engine.rows import SamplingParams
    from jaxstation.model.loader import checkpoint_config, load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)  # the template already holds any special tokens
    else:
        prompt = tok.encode(args.prompt)
    cfg = checkpoint_config(args.model)
    block = 128 if cfg.max_position >= 128 else 1 << (cfg.max_position.bit_length() - 1)  # a short model's: smaller
    chunk = min(32, block)
    max_seq = _round_up(len(prompt) + args.max_new_tokens, block)
    if max_seq > cfg.max_position:
        print(f"error: prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
              f"{cfg.max_position} positions", file=sys.stderr)
        return 2
    station = StationConfig(model=args.model, dtype=args.dtype, lanes=1, max_seq=max_seq, prefill_chunk=chunk,
                            kv_block=block, sources={"dtype": "--dtype"} if args.dtype else {})
    plan = startup_plan(station, cfg)  # the backend's defaults for the rest
    engine = planned_engine(load_planned(station, plan), station, plan)
    engine.warmup()  # compile outside the timed run
    seed = args.seed if args.seed is not None else secrets.randbelow(1 << 32)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)
    t1 = time.perf_counter()
    out = generate(engine, prompt, args.max_new_tokens, sampling, stop_ids=frozenset(tok.eos_ids))
    elapsed = time.perf_counter() - t1
    print(tok.decode(out, skip_special_tokens=True))
    seed_note = f", seed {seed}" if args.temperature > 0 else ""
    print(f"[prompt {len(prompt)} tokens, generated {len(out)} tokens in {elapsed:.2f} s: "
          f"{len(out) / elapsed if elapsed > 0 else 0.0:.1f} tokens/s; load + compile {t1 - t0:.1f} s{seed_note}]",
          file=sys.stderr)
    return 0


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    args.model = local_path(args.model, args.revision)
    model_source(args.model)
    _import_jax()
    from jaxstation.model.loader import load_tokenizer

    load_tokenizer(args.model).save_hf_dir(args.out)
    print(args.out)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    print(local_path(args.name, args.revision))
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from jaxstation.offline.batch_file import answered, check_input

    config = resolve(args, command="batch")
    source, output = Path(args.input), Path(args.output)
    total = check_input(source)  # files a batch cannot run over are refused before the model loads
    answered(output)
    config = local_model(config)
    model_source(config.model)
    _import_jax()
    from jaxstation.offline.batch import run_batch
    from jaxstation.offline.station import open_station

    station = open_station(config)
    try:
        summary = run_batch(station, source, output, total, use_tqdm=not args.quiet)
    finally:
        station.shutdown(0)
    stopped = f"; stopped by {signal.Signals(summary.signal).name}, run it again to answer the rest" \
        if summary.signal else ""
    print(f"{summary.lines} lines written to {output} in {summary.seconds:.1f} s ({summary.errors} errors; "
          f"{summary.prompt_tokens} prompt and {summary.generated_tokens} generated tokens){stopped}", file=sys.stderr)
    return 128 + summary.signal if summary.signal else 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = local_model(resolve(args, command="serve"))
    model_source(config.model)  # a path that names no checkpoint is refused before JAX loads
    _import_jax()
    from jaxstation.app import station_and_app
    from jaxstation.config.draft import check_draft
    from jaxstation.config.plan import auto_max_seq
    from jaxstation.group.process_group import initialize, process_group, serve_follower
    from jaxstation.model.loader import checkpoint_config
    from jaxstation.server.serve import serve, warmup_only

    cfg = checkpoint_config(config.model)  # a bad checkpoint is refused here, before the server announces it listens
    check_draft(config)  # as a draft model whose vocabulary differs
    group = process_group(config)
    if group is None and "max_seq" not in config.sources:  # a group's processes keep the fixed default, alike
        config = auto_max_seq(config, cfg)
    if group is None:
        return warmup_only(config) if args.warmup_only else serve(config, station_and_app)
    if args.warmup_only:
        raise ConfigError("--warmup-only compiles one process's steps; a group of processes compiles them together "
                          "when it starts")
    initialize(group, config)
    if not group.leader:
        return serve_follower(config, group)
    return serve(config, lambda c: _group_leader(c, group))


def _group_leader(config: StationConfig, group: Group) -> tuple[Starlette, Station]:
    """Process 0 of a group: the station, its engine's step calls sent to every follower; a lost follower fails the
    requests in flight (503) before the process exits."""
    from jaxstation.app import station_and_app
    from jaxstation.group.process_group import Leader

    leader = Leader(group)
    app, station = station_and_app(config, engine_factory=leader.engine_factory)
    leader.on_lost = lambda: station.scheduler is not None and station.scheduler.drain(0)
    return app, station


def cmd_station(args: argparse.Namespace) -> int:
    config = local_model(resolve(args, command="station"))
    if config.layers is None:
        raise ConfigError("a mesh station needs its layer range: --layers A:B (MOONSHINE_LAYERS)")
    config.check_mesh_security()
    model_source(config.model)
    _import_jax()
    from jaxstation.mesh.station import serve_station
    from jaxstation.model.loader import checkpoint_config

    checkpoint_config(config.model)  # as serve: a bad checkpoint is refused before the station listens
    return serve_station(config)


def cmd_host(args: argparse.Namespace) -> int:
    config = local_model(resolve(args, command="host"))
    if not config.station_urls:
        raise ConfigError("a mesh host needs its stations: --stations URL,URL,... (MOONSHINE_MESH_STATIONS)")
    config.check_mesh_security()
    _import_jax()
    from jaxstation.mesh.host import create_host_app
    from jaxstation.server.serve import serve

    return serve(config, create_host_app)


_ABOUT = """\
A batched, batch-invariant LLM serving station for Llama/Mistral-family models.

`serve` answers POST /generate (token ids in, token ids out) and the OpenAI-compatible routes
POST /v1/completions, POST /v1/chat/completions (with streaming), GET /v1/models, POST /tokenize and
POST /detokenize, GET /tokenizer_info, plus GET /health, GET /ready, GET /metrics and GET /openapi.json.
`generate` runs one prompt and prints the text; `batch` answers an OpenAI batch file (one JSON request a line)
into another; `download` fetches a Hugging Face Hub model (org/name, or org/name:QUANT) and prints its path;
`export-tokenizer` writes the model's tokenizer as an HF tokenizer directory. --model takes a checkpoint's path or a
Hub model's name everywhere."""


MODEL_HELP = ("HF directory, .gguf file, or a Hugging Face Hub model: org/name, or org/name:QUANT for one quant of a "
              "GGUF repository (default: the embedded SmolLM2)")
REVISION_HELP = "a Hub model's branch, tag or commit (default: main)"


def _command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int], help_: str,
             description: str) -> argparse.ArgumentParser:
    """A command's parser, running `func`."""
    parser = sub.add_parser(name, help=help_, description=description)
    parser.set_defaults(func=func, command_parser=parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxstation", description=_ABOUT,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxstation {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt and print the text")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128,
                     help="the most tokens to generate; it stops earlier at the model's end-of-sequence token "
                          "(default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--top-k", type=int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 is off")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--revision", default=None, help=REVISION_HELP)
    gen.add_argument("--dtype", default=None, choices=DTYPES,
                     help="weight dtype; gguf keeps a GGUF model's blocks as stored and multiplies integers, "
                     "gguf-exact keeps them with float32's exact bits, int8 is weight-only (default: gguf on CPU for a "
                     "GGUF model, else float32; bfloat16 on a GPU)")
    gen.set_defaults(func=cmd_generate, command_parser=gen)

    exp = _command(sub, "export-tokenizer", cmd_export_tokenizer,
                   "write the model's tokenizer as a Hugging Face tokenizer directory",
                   "Writes tokenizer.json, tokenizer_config.json and generation_config.json: the directory that "
                   "transformers' AutoTokenizer and benchmark clients such as aiperf and guidellm take as --tokenizer.")
    exp.add_argument("out", help="the directory to write (created if missing)")
    exp.add_argument("--model", default=None, help=MODEL_HELP)
    exp.add_argument("--revision", default=None, help=REVISION_HELP)

    dl = _command(sub, "download", cmd_download, "fetch a Hugging Face Hub model into the HF cache and print its path",
                  "Downloads what the station reads of a Hub model (a safetensors checkpoint, or one GGUF file and its "
                  "parts) into the Hugging Face cache, or finds it there, and prints the path --model takes (image "
                  "builds, air-gapped copies). HF_TOKEN for gated models, HF_HUB_OFFLINE=1 to use the cache only.")
    dl.add_argument("name", help="org/name, or org/name:QUANT for one quant of a GGUF repository")
    dl.add_argument("--revision", default=None, help=REVISION_HELP)

    bat = _command(sub, "batch", cmd_batch, "answer an OpenAI batch file (JSON lines) into another, with no server",
                   "Reads OpenAI Batch API input lines (custom_id, method POST, url /v1/chat/completions or "
                   "/v1/completions, body) and appends one output line per input (id, custom_id, response "
                   "{status_code, request_id, body} or error), each body what the route answers. Run again over the "
                   "same output to answer the lines it lacks. Flags override the environment variables named in each "
                   "help line.")
    bat.add_argument("-i", "--input", required=True, help="the batch input file (.jsonl)")
    bat.add_argument("-o", "--output", required=True, help="the output file (.jsonl), appended to")
    bat.add_argument("--quiet", action="store_true", help="no progress bar")
    add_arguments(bat, "batch")

    srv = sub.add_parser("serve", help="run the /generate station server",
                         description="Flags override the environment variables named in each help line.")
    add_arguments(srv, "serve")
    srv.add_argument("--warmup-only", action="store_true",
                     help="load the model and compile every step shape (filling MOONSHINE_COMPILE_CACHE_DIR), then "
                          "exit 0 without serving; run it at image build time or as a deploy step")
    srv.set_defaults(func=cmd_serve, command_parser=srv)

    for name, func, help_ in (
            ("station", cmd_station, "run a mesh station holding the layers --layers A:B (/forward, /lm_head)"),
            ("host", cmd_host, "run the scheduler and every route over mesh stations (--stations URL,URL,...)")):
        p = sub.add_parser(name, help=help_, description="Flags override the environment variables named in each "
                                                         "help line.")
        add_arguments(p, name)
        p.set_defaults(func=func, command_parser=p)
    return parser


def _other_commands(flag: str) -> list[str]:
    """The commands that take `flag` (a setting's), for an error that says where it belongs."""
    name = flag.split("=")[0]
    return [c for c in COMMANDS if any(s.flag == name and c in s.commands for s in SETTINGS)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = args.command_parser  # errors show the command's usage, not the top level's
    if unknown:
        where = _other_commands(unknown[0])
        hint = f" ({unknown[0].split('=')[0]} is a flag of: {', '.join(f'jaxstation {c}' for c in where)})" if where \
            else ""
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.command == "generate":
        if args.max_new_tokens < 1:
            command_parser.error("--max-new-tokens must be >= 1")
        if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
            command_parser.error("need --temperature >= 0, --top-k >= 0 and --top-p in (0, 1]")
    use_gpu_memory_fraction()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").addFilter(_plugin_error_in_one_line)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not huggingface_hub's every request to the Hub
    try:
        return args.func(args)
    except (ConfigError, CheckpointError) as e:  # the user's mistake: say what it is, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
