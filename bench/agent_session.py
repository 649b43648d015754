"""A coding agent's real sessions against a running station: Claude Code (`claude -p`) or Codex (`codex exec`), as
installed from npm: the newest version, or the one `--agent-version` names, installed once into
~/.cache/jaxstation-agents ($JAXSTATION_AGENTS_CACHE). Three runs, from a cold prefix cache (the station's is reset
first): session 1, its second turn, and a new session 2 with another prompt. For each, from the station's /metrics
before and after: the prompt tokens it prefilled (not reused), its requests and their time to first token, and the
wall time; the agent's exit code and last line; and, given the station's log (`--station-log`, the text format), the
access lines with a 4xx status written during the run. Writes JSON, with the agent's version.

Usage (a station on 127.0.0.1:8012 first, logging to a file, e.g. `jaxstation serve --model gemma-3-270m-q4_k_m.gguf
--max-seq 32768 --lanes 2 --chat-template docs/chat-templates/gemma3.jinja --continuous-batch --port 8012
2> station.log`):
  python -m bench.agent_session --agent claude --url http://127.0.0.1:8012 --station-log station.log
  python -m bench.agent_session --agent codex --agent-version 0.171.0 --url http://127.0.0.1:8012
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import add_name_arg, model_name, write_result

PROMPTS = ("Say hello.", "Now say goodbye.", "What is the capital of France?")
METRICS = {"prefilled": "jaxstation_prompt_tokens_total", "ttft_sum": "jaxstation_time_to_first_token_seconds_sum",
           "requests": "jaxstation_time_to_first_token_seconds_count"}
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
CACHE = Path(os.environ.get("JAXSTATION_AGENTS_CACHE", Path.home() / ".cache" / "jaxstation-agents"))
CLIENT_ERROR = re.compile(r"jaxstation\.access: \S+ \S+ 4\d\d ")


def install(agent: str, version: str | None) -> tuple[Path, str]:
    """The agent's executable at `version` (None: the newest on npm), installed into CACHE unless it is there, and
    the version."""
    package = PACKAGES[agent]
    if version is None:
        version = subprocess.run(["npm", "view", package, "version"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    prefix = CACHE / f"{agent}-{version}"
    binary = prefix / "node_modules" / ".bin" / agent
    if not binary.exists():
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-fund", "--no-audit", f"{package}@{version}"],
                       check=True)
    return binary, version


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {k: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for k, name in METRICS.items()}


def commands(agent: str, binary: str, url: str, home: Path, extra: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of session 1, its second turn and session 2, each with `extra` arguments."""
    if agent == "claude":
        env = {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256", "API_TIMEOUT_MS": "1800000"}  # a CPU's first prefill is long
        return [([binary, "-p", PROMPTS[0], *extra], env), ([binary, "-p", "--continue", PROMPTS[1], *extra], env),
                ([binary, "-p", PROMPTS[2], *extra], env)]
    (home / "config.toml").write_text(f'model = "m"\nmodel_provider = "station"\n\n[model_providers.station]\n'
                                      f'name = "station"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    env = {"CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}
    exec_ = [binary, "exec", "--skip-git-repo-check"]
    return [([*exec_, *extra, PROMPTS[0]], env), ([*exec_, "resume", "--last", *extra, PROMPTS[1]], env),
            ([*exec_, *extra, PROMPTS[2]], env)]


def run(argv: list[str], env: dict[str, str], url: str, timeout: float, log: Path | None) -> dict:
    start = log.stat().st_size if log else 0
    before, t0 = metrics(url), time.perf_counter()
    p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    wall, after = time.perf_counter() - t0, metrics(url)
    delta = {k: after[k] - before[k] for k in METRICS}
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    out = {"argv": argv[1:], "exit": p.returncode, "wall_s": round(wall, 2), "prefilled": int(delta["prefilled"]),
           "requests": int(delta["requests"]),
           "mean_ttft_s": round(delta["ttft_sum"] / delta["requests"], 2) if delta["requests"] else None,
           "last_line": lines[-1][:300] if lines else p.stderr.strip()[-300:]}
    if log:
        with log.open(encoding="utf-8", errors="replace") as f:
            f.seek(start)
            out["client_errors"] = [line.strip() for line in f if CLIENT_ERROR.search(line)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", choices=sorted(PACKAGES), required=True)
    ap.add_argument("--agent-version", help="the npm version to run (default: the newest)")
    ap.add_argument("--url", default="http://127.0.0.1:8012")
    ap.add_argument("--station-log", type=Path, help="the station's log file: each run records its 4xx access lines")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--extra", default="", help="more arguments for every run, e.g. --extra=\"--tools ''\"")
    add_name_arg(ap)
    args = ap.parse_args()
    binary, version = install(args.agent, args.agent_version)
    info = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]
    httpx.post(f"{args.url}/reset_prefix_cache", timeout=30).raise_for_status()
    with tempfile.TemporaryDirectory() as home:
        extra = shlex.split(args.extra)
        runs = [run(argv, env, args.url, args.timeout, args.station_log)
                for argv, env in commands(args.agent, str(binary), args.url, Path(home), extra)]
    reported = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
    path = write_result(f"agent_session_{args.agent}", {
        "agent": reported, "package": f"{PACKAGES[args.agent]}@{version}", "model": info["id"], "extra": args.extra,
        "max_model_len": info.get("max_model_len"), "runs": runs}, model=model_name(info["id"]), variant=args.name)
    print(path)
    for name, r in zip(("session 1", "its second turn", "session 2"), runs, strict=True):
        errors = f", {len(r['client_errors'])} 4xx" if "client_errors" in r else ""
        print(f"{name:16} exit {r['exit']} prefilled {r['prefilled']:6} in {r['requests']} requests{errors}, mean "
              f"ttft {r['mean_ttft_s']} s, wall {r['wall_s']} s: {r['last_line'][:80]}")


if __name__ == "__main__":
    main()
