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


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["serve", "--lanes", "0"], ["station", "--port", "0"],
                                  ["generate", "--prompt", "hi", "--model", "nonexistent"], ["batch", "--help"],
                                  ["download", "--help"], ["batch", "-i", "nonexistent.jsonl", "-o", "out.jsonl"]])
def test_help_version_and_refused_settings_answer_without_importing_jax(args: list[str]) -> None:
    """What needs no model answers without JAX, the engine or the server: an instant --help."""
    code = ("import sys\nfrom jaxstation.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('jax', 'jaxstation.engine.engine', 'jaxstation.server.station') "
            "if m in sys.modules))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60)
    assert r.stdout.splitlines()[-1] == "[]", r.stdout + r.stderr


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
    (tmp_path / "config.json").write_text("{}")  # a directory with weights' config but no tokenizer: refused the same
    r = run_cli("serve", "--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and r.stderr.splitlines()[0] == (
        f"error: model directory {tmp_path} has no tokenizer.json: an HF model directory holds config.json, "
        "tokenizer.json and *.safetensors")
    assert "Traceback" not in r.stderr + r.stdout and "Uvicorn running" not in r.stderr + r.stdout
    (tmp_path / "config.json").unlink()
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
                    "(default: gguf on CPU for a GGUF model where the CPU kernel builds, else float32; "
                    "bfloat16 on a GPU) [env MOONSHINE_DTYPE]",
                    "(default: auto) [env MOONSHINE_ATTENTION]", "(default: auto) [env MOONSHINE_LAYER_LOOP]",
                    "(default: off) [env MOONSHINE_CONTINUOUS_BATCH]"):
        assert default in serve
    generate = " ".join(run_cli("generate", "--help").stdout.split())
    assert "--max-new-tokens MAX_NEW_TOKENS the most tokens to generate" in generate
    assert ("--dtype {float32,bfloat16,int8,gguf,gguf-exact} weight dtype; gguf keeps a GGUF model's blocks as stored "
            "and multiplies integers") in generate


def test_a_corrupt_model_file_is_one_line_on_serve(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not a GGUF file" * 100)
    for command, extra in (("serve", ["--port", "0"]), ("generate", ["--prompt", "hi"])):
        r = run_cli(command, "--model", str(fake), *extra)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.splitlines()[0].startswith(f"error: cannot read GGUF file {fake}"), r.stderr
        assert "Traceback" not in r.stderr + r.stdout and "Uvicorn running" not in r.stderr + r.stdout


@pytest.mark.parametrize("args, env, named", [
    (["--lanes", "0"], {}, "error: --lanes=0 must be >= 1"),
    ([], {"MOONSHINE_BATCH_LANES": "0"}, "error: MOONSHINE_BATCH_LANES=0 must be >= 1"),
    (["--port", "99999"], {}, "error: --port=99999 must be a TCP port in [0, 65535]"),
    (["--prefix-cache-ram", "-2"], {}, "error: --prefix-cache-ram=-2 must be >= 0 MiB (0: off)"),
    (["--max-seq", "100"], {}, "error: --max-seq=100 must be a multiple of MOONSHINE_PREFILL_CHUNK=32"),
    (["--prefill-chunk", "48"], {"MOONSHINE_MAX_SEQ": "100"}, "error: MOONSHINE_MAX_SEQ=100 must be a multiple of "
                                                              "--prefill-chunk=48"),
])
def test_errors_name_what_the_user_typed(args: list[str], env: dict, named: str, monkeypatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = run_cli("serve", *args)
    assert r.returncode == 2 and r.stderr.splitlines()[0] == named, r.stderr


def test_each_command_takes_only_the_flags_it_uses() -> None:
    r = run_cli("serve", "--layers", "0:13", "--stations", "http://127.0.0.1:9")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("jaxstation serve: error: unrecognized arguments: --layers 0:13 --stations "
                                         "http://127.0.0.1:9 (--layers is a flag of: jaxstation station)")
    helps = {c: " ".join(run_cli(c, "--help").stdout.split()) for c in ("serve", "station", "host")}
    for flag in ("--layers", "--stations", "--mesh-token", "--mesh-pipeline", "--insecure-mesh"):
        assert flag not in helps["serve"], flag
    for flag in ("--api-key", "--continuous-batch", "--stations", "--drain-s", "--wave-widths"):
        assert flag not in helps["station"], flag
    assert "--layers" not in helps["host"] and "--stations" in helps["host"] and "--layers" in helps["station"]
    batch = " ".join(run_cli("batch", "--help").stdout.split())
    for flag in ("--port", "--api-key", "--continuous-batch", "--drain-s", "--web", "--layers"):
        assert flag not in batch, flag
    for flag in ("--model", "--revision", "--lanes", "--max-seq", "--speculative", "--max-queue", "--lora-modules"):
        assert flag in batch, flag
    assert "every route except /health and /ready needs 'Authorization: Bearer <key>'" in helps["serve"]


def test_a_bad_generate_flag_prints_generate_usage() -> None:
    r = run_cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: jaxstation generate"), r.stderr
    assert r.stderr.splitlines()[-1] == ("jaxstation generate: error: need --temperature >= 0, --top-k >= 0 and "
                                         "--top-p in (0, 1]")


def test_a_jax_plugin_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    """The CUDA image on a machine without a GPU driver: the CUDA plug-in's initialize() raises. The station logs one
    line naming the error, no traceback, and runs on CPU. A plug-in of the same kind stands in for it here."""
    plugin = tmp_path / "jax_plugins" / "no_driver"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "def initialize():\n    raise RuntimeError('operation cuInit(0) failed: Unknown CUDA error 303')\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as in the image: JAX picks its backends
    r = subprocess.run([sys.executable, "-m", "jaxstation", "generate", "--prompt", "hi", "--max-new-tokens", "2",
                        "--model", str(ROOT / "tests/fixtures/tiny-qwen2")], capture_output=True, text=True,
                       env={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "jax_plugins.no_driver" in ln]
    assert len(lines) == 1 and lines[0].endswith(
        "WARNING jax._src.xla_bridge: Jax plugin configuration error: Exception when calling "
        "jax_plugins.no_driver.initialize(): RuntimeError: operation cuInit(0) failed: Unknown CUDA error 303"), lines


def test_a_chat_template_that_does_not_render_names_its_file_and_line(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}\n{% for m in messages %}\n{{ m['content'] | nosuchfilter }}\n{% endfor %}\n")
    r = run_cli("serve", "--chat-template", str(template), "--port", "0")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == f"error: --chat-template: {template}, line 3: No filter named 'nosuchfilter'."
    assert "Traceback" not in r.stderr + r.stdout
    r = run_cli("serve", "--served-model-name", "a,,b", "--port", "0")
    assert r.stderr.splitlines()[0] == "error: --served-model-name='a,,b' must be one name or several, comma-separated"
