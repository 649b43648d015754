"""The standard serving benchmarks, pointed at jaxstation and at llama-server from one shell, with one workload.

Clients (each run as its own command, so it may live in another virtual environment):
  aiperf     NVIDIA's (`pip install -e '.[clients]'`; no torch): `aiperf profile` on /v1/completions, streaming,
             synthetic prompts, `--extra-inputs ignore_eos:true` so every reply has exactly the asked-for length
  guidellm   vLLM's (`pip install guidellm`; it brings torch, so it is not in the extra): `guidellm run` with the
             openai_http backend on /v1/completions, streaming, synthetic_text data (it sends ignore_eos itself)
Systems: a station subprocess (`jaxstation serve --continuous-batch`, as many lanes as the highest concurrency) and
llama.cpp's `llama-server` (as many slots; scripts/build_llama_server.sh builds it), both on the default model's GGUF,
started one after the other on this machine.

Workload: 128 prompt tokens, 128 output tokens (EOS ignored), streaming, closed loop at concurrency 1, 8 and 32; each
level sends `--requests` requests (default 2 x concurrency, at least 16) after `concurrency` warm-up requests. Both
clients count tokens with the model's own tokenizer, written by `jaxstation export-tokenizer`.

Writes bench/results/clients-smollm2.json (one row per system, client and concurrency: output tok/s, TTFT
p50/p99, inter-token latency p50/p99, requests and errors) and each client's own summary JSON under
bench/results/runs/clients-<date>-<machine>/, and prints one table.

aiperf refuses a local tokenizer directory while HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: it then treats the
path as a Hub repo id. A local directory never touches the network, so this script runs the clients without those
two variables; by hand, run `env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE aiperf profile --tokenizer DIR ...`.

Usage:
  pip install -e '.[clients]' && scripts/build_llama_server.sh
  python -m bench.clients                                   # both systems, aiperf (and guidellm if on the PATH)
  python -m bench.clients --clients aiperf --concurrency 1 8 --requests 16
  python -m bench.clients --aiperf /venv/bin/aiperf --guidellm /other-venv/bin/guidellm --llama-server PATH
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import RESULTS, RUNS, fingerprint, read_bandwidth, write_result
from bench.peers import find_llama_server
from bench.workload import first_executable, free_port, llama_server_cmd, server_process, station_cmd

CLIENTS = ("aiperf", "guidellm")
SYSTEMS = ("jaxstation", "llama-server")
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def client_env() -> dict[str, str]:
    """This environment without the Hub's offline switches (see the module docstring)."""
    return {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}


def find_client(name: str, given: str | None) -> str | None:
    return first_executable(given, shutil.which(name))


def run_aiperf(binary: str, url: str, tokenizer: Path, concurrency: int, requests: int, isl: int, osl: int,
               work: Path) -> tuple[dict, dict]:
    """One aiperf run; returns (our row's metrics, aiperf's own summary JSON)."""
    cmd = [binary, "profile", "--model", "default", "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(tokenizer), "--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency), "--request-count", str(requests),
           "--warmup-request-count", str(concurrency), "--random-seed", "0", "--output-artifact-dir", str(work),
           "--ui-type", "none"]
    _run(cmd, work / "client.log")
    raw = json.loads((work / "profile_export_aiperf.json").read_text())

    def stat(metric: str, key: str) -> float | None:
        return (raw.get(metric) or {}).get(key)

    errors = sum(e.get("count", 0) for e in raw.get("error_summary") or [])
    return {"output_tok_s": stat("output_token_throughput", "avg"),
            "ttft_ms": {"p50": stat("time_to_first_token", "p50"), "p99": stat("time_to_first_token", "p99")},
            "itl_ms": {"p50": stat("inter_token_latency", "p50"), "p99": stat("inter_token_latency", "p99")},
            "requests": int(stat("request_count", "avg") or 0), "errors": errors}, raw


def run_guidellm(binary: str, url: str, tokenizer: Path, concurrency: int, requests: int, isl: int, osl: int,
                 work: Path) -> tuple[dict, dict]:
    """One guidellm run; returns (our row's metrics, guidellm's report: its config and each metric's summary)."""
    out = work / "guidellm.json"
    cmd = [binary, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--constraint", f"kind=max_requests,count={requests}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    _run(cmd, work / "client.log")
    report = json.loads(out.read_text())
    bench = report["benchmarks"][0]
    # the per-request records and the distributions' confidence intervals are large; keep each metric's summary
    m = {name: {"successful": {k: v for k, v in stats["successful"].items() if k not in ("pdf", "percentile_cis")}}
         if isinstance(stats, dict) and isinstance(stats.get("successful"), dict) else stats
         for name, stats in bench["metrics"].items()}
    raw = {"guidellm_config": report["config"], "strategy": bench["config"]["strategy"], "metrics": m}

    def pct(metric: str, p: str) -> float | None:
        return m[metric]["successful"]["percentiles"][p]

    totals = m["request_totals"]
    return {"output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms": {"p50": pct("time_to_first_token_ms", "p50"), "p99": pct("time_to_first_token_ms", "p99")},
            "itl_ms": {"p50": pct("inter_token_latency_ms", "p50"), "p99": pct("inter_token_latency_ms", "p99")},
            "requests": totals["successful"], "errors": totals["errored"] + totals["incomplete"]}, raw


RUNNERS = {"aiperf": run_aiperf, "guidellm": run_guidellm}


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=client_env()).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {rc}:\n{tail}")


def table(rows: list[dict]) -> str:
    def f(v: float | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = ["| system | client | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| requests (errors) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['system']} | {r['client']} | {r['concurrency']} | {r['note']} | | | | | |")
            continue
        lines.append(f"| {r['system']} | {r['client']} | {r['concurrency']} | {f(r['output_tok_s'])} "
                     f"| {f(r['ttft_ms']['p50'], 0)} | {f(r['ttft_ms']['p99'], 0)} | {f(r['itl_ms']['p50'])} "
                     f"| {f(r['itl_ms']['p99'])} | {r['requests']} ({r['errors']}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--clients", nargs="+", choices=CLIENTS, default=None,
                    help="default: every client found (aiperf, guidellm)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=None, help="per level (default: 2 x concurrency, at least 16)")
    ap.add_argument("--isl", type=int, default=128, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=128, help="output tokens")
    ap.add_argument("--dtype", nargs="+", default=["gguf"],
                    help="jaxstation's weights, one station per dtype in turn (llama.cpp reads the GGUF's Q4_1)")
    ap.add_argument("--aiperf", help="path of the aiperf command (default: PATH)")
    ap.add_argument("--guidellm", help="path of the guidellm command (default: PATH)")
    ap.add_argument("--llama-server", help="path of the llama-server binary (default: the build cache, then PATH)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--server-timeout", type=float, default=600.0)
    args = ap.parse_args()

    from jaxstation.model.default_model import default_model_path
    from jaxstation.model.loader import load_tokenizer

    binaries = {c: find_client(c, getattr(args, c)) for c in (args.clients or CLIENTS)}
    missing = [c for c, b in binaries.items() if b is None]
    if args.clients and missing:
        ap.error(f"not found: {', '.join(missing)} (pip install -e '.[clients]', or pass --{missing[0]} PATH)")
    clients = [c for c, b in binaries.items() if b is not None]
    if not clients:
        ap.error("no benchmark client found: pip install -e '.[clients]' (aiperf), or pass --aiperf PATH")
    lanes = max(args.concurrency)
    bandwidth = read_bandwidth()  # this machine, in this run: CPUs and their memory bandwidth vary
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    ctx = 128 * -(-(args.isl + args.osl + 64) // 128)  # room for a client's prompt a few tokens over --isl
    gguf = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="jaxstation-clients-"))
    tokenizer = work / "tokenizer"
    load_tokenizer(gguf).save_hf_dir(tokenizer)
    fp = fingerprint()
    raw_dir = Path(os.environ.get("JAXSTATION_BENCH_RESULTS") or RESULTS) / RUNS / \
        f"clients-{dt.date.today().isoformat()}-{fp['id']}"
    raw_dir.mkdir(parents=True, exist_ok=True)

    commands: dict[str, list[str]] = {}
    rows: list[dict] = []
    runs = [(f"jaxstation {d}", d) for d in args.dtype] if "jaxstation" in args.systems else []
    runs += [("llama-server", None)] if "llama-server" in args.systems else []
    for system, dtype in runs:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        if dtype is not None:
            cmd, ready = station_cmd(port, lanes, ctx, dtype=dtype, max_queue=4 * lanes), f"{base}/ready"
        else:
            binary = find_llama_server(args.llama_server)
            if binary is None:
                rows += [{"system": system, "client": c, "concurrency": k,
                          "note": "not built: run scripts/build_llama_server.sh"} for c in clients
                         for k in args.concurrency]
                continue
            cmd = llama_server_cmd(binary, str(gguf), port, lanes, ctx * lanes, args.threads)
            ready = f"{base}/health"
        commands[system] = cmd
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(server_process(cmd, ready, args.server_timeout,
                                                   log=work / f"{system.replace(' ', '-')}.log"))
            except (RuntimeError, OSError) as e:
                note = f"could not start: {str(e).splitlines()[0]}"
                rows += [{"system": system, "client": c, "concurrency": k, "note": note} for c in clients
                         for k in args.concurrency]
                continue
            for client in clients:
                for k in args.concurrency:
                    n = args.requests or max(16, 2 * k)
                    run_dir = work / f"{system.replace(' ', '-')}-{client}-c{k}"
                    try:
                        metrics, raw = RUNNERS[client](binaries[client], base, tokenizer, k, n, args.isl, args.osl,
                                                       run_dir)
                    except (RuntimeError, OSError, KeyError, ValueError) as e:
                        rows.append({"system": system, "client": client, "concurrency": k,
                                     "note": f"failed: {str(e).splitlines()[0][:120]}"})
                        print(f"{system} {client} c={k}: {e}", flush=True)
                        continue
                    own = raw_dir / f"{client}-{system.replace(' ', '-')}-c{k}.json"
                    own.write_text(json.dumps(raw, separators=(",", ":")))
                    rows.append({"system": system, "client": client, "concurrency": k, **metrics})
                    print(f"{system:18s} {client:8s} c={k:<3d} {metrics['output_tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{metrics['ttft_ms']['p50']:.0f} ms  ITL p50 {metrics['itl_ms']['p50']:.1f} ms  "
                          f"({metrics['requests']} requests, {metrics['errors']} errors)", flush=True)

    print(table(rows))
    path = write_result("clients", {
        "workload": {"prompt_tokens": args.isl, "output_tokens": args.osl, "concurrency": args.concurrency,
                     "streaming": True, "endpoint": "/v1/completions", "ignore_eos": True},
        "read_bandwidth": bandwidth, "station_dtypes": args.dtype,
        "lanes_or_slots": lanes, "threads": args.threads, "commands": commands,
        "client_versions": {c: _version(binaries[c]) for c in clients}, "raw_dir": str(raw_dir),
        "rows": rows, "table": table(rows)}, read_bandwidth=bandwidth)
    print(f"wrote {path}")


def _version(binary: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, env=client_env())
        return (out.stdout or out.stderr).strip().splitlines()[-1]
    return "unknown"


if __name__ == "__main__":
    main()
