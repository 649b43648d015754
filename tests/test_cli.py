"""The command line as a user meets it: real subprocesses, exit codes, and the first line they print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxstation

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "jaxstation", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"jaxstation {jaxstation.__version__}"
    assert jaxstation.__version__[0].isdigit()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_missing_model_path_is_one_line_without_traceback(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    r = run_cli(command, "--model", str(missing), *extra)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == f"error: model path {missing} does not exist"
    assert "Traceback" not in r.stderr + r.stdout
    # serve refuses before it starts listening
    assert "Uvicorn running" not in r.stderr + r.stdout and "Started server" not in r.stderr


def test_directory_without_config_and_non_gguf_file(tmp_path: Path) -> None:
    r = run_cli("serve", "--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and "has no config.json" in r.stderr.splitlines()[0]
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0")
    r = run_cli("generate", "--prompt", "hi", "--model", str(weights))
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == f"error: model path {weights} is neither an HF directory nor a .gguf file"


def test_help_shows_defaults_and_routes() -> None:
    top = run_cli("--help").stdout
    for route in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/metrics"):
        assert route in top
    serve = " ".join(run_cli("serve", "--help").stdout.split())  # argparse wraps lines
    for default in ("(default: 8) [env MOONSHINE_BATCH_LANES]", "(default: 2048) [env MOONSHINE_MAX_SEQ]",
                    "(default: 32) [env MOONSHINE_PREFILL_CHUNK]", "(default: 128) [env MOONSHINE_KV_BLOCK]",
                    "(default: 64) [env MOONSHINE_MAX_QUEUE]", "(default: 30.0) [env MOONSHINE_DRAIN_S]",
                    "(default: 1048576) [env MOONSHINE_MAX_BODY_BYTES]",
                    "(default: float32 on CPU, bfloat16 on a GPU) [env MOONSHINE_DTYPE]",
                    "(default: auto) [env MOONSHINE_ATTENTION]", "(default: auto) [env MOONSHINE_LAYER_LOOP]",
                    "(default: off) [env MOONSHINE_CONTINUOUS_BATCH]"):
        assert default in serve
    generate = " ".join(run_cli("generate", "--help").stdout.split())
    assert "--max-new-tokens MAX_NEW_TOKENS the most tokens to generate" in generate
    assert "--dtype {float32,bfloat16,int8} weight dtype; int8 is weight-only" in generate
