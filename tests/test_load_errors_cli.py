"""A checkpoint the station cannot load stops `serve`, `generate` and a mesh station with one line that names the file
and what is wrong, no traceback, and a non-zero exit: real subprocesses on broken copies of the tiny fixtures.

`serve` and `station` check the config, the GGUF tensor types and the tokenizer model before they listen (exit 2); a
fault found only while the tensors load (a wrong shape) ends a started server with exit 1 and its one exit line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from gguf import GGMLQuantizationType as Q
from test_cli import run_cli
from test_gguf_types import fixture, rewrite_gguf, with_type

LLAMA_TOKENIZER = FIXTURES / "tokenizers" / "llama-style.gguf"


def unsupported_type(tmp: Path) -> tuple[Path, str]:
    path = with_type(tmp / "iq2.gguf", "blk.0.ffn_gate.weight", Q.IQ2_XXS)
    return path, f"tensor 'blk.0.ffn_gate.weight' in {path} has unsupported GGUF type IQ2_XXS; supported: F32, F16"


def unsupported_tokenizer(tmp: Path) -> tuple[Path, str]:
    path = rewrite_gguf(tmp / "t5.gguf", fixture("Q8_0"), tokenizer_from=LLAMA_TOKENIZER,
                        strings={"tokenizer.ggml.model": "t5"})
    return path, f"{path}: unsupported GGUF tokenizer model 't5' (tokenizer.ggml.model): served are 'gpt2', 'llama'"


def unknown_config_field(tmp: Path) -> tuple[Path, str]:
    path = Path(shutil.copytree(FIXTURES / "tiny-qwen2", tmp / "tiny-qwen2"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    return path, f"{path / 'config.json'}: unsupported config field(s) ['partial_rotary_factor'] in config.json"


def wrong_shape(tmp: Path) -> tuple[Path, str]:
    narrow = np.zeros((16, 256), np.float32)  # ffn_up is [32, 256]
    path = rewrite_gguf(tmp / "shape.gguf", fixture("F32"), {"blk.0.ffn_up.weight": (narrow, None)},
                        tokenizer_from=LLAMA_TOKENIZER)
    return path, f"tensor 'blk.0.ffn_up.weight' in {path} has shape (16, 256), expected (32, 256)"


@pytest.mark.parametrize("command,broken,code", [
    ("serve", unsupported_type, 2), ("generate", unsupported_tokenizer, 2), ("station", unknown_config_field, 2),
    ("serve", wrong_shape, 1), ("generate", wrong_shape, 2)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_load_failure_is_one_line_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
                                                    broken, code: int) -> None:
    path, message = broken(tmp_path)
    monkeypatch.setenv("MOONSHINE_MESH_TOKEN", "t" * 32)
    args = {"serve": ["--port", "0"], "generate": ["--prompt", "hi", "--max-new-tokens", "4"],
            "station": ["--port", "0", "--layers", "0:1"]}
    r = run_cli(command, "--model", str(path), *args[command], timeout=120)
    out = r.stderr + r.stdout
    assert r.returncode == code, out
    assert "Traceback" not in out
    lines = [line for line in r.stderr.splitlines() if message in line]
    assert len(lines) == 1, out
    if code == 2:  # refused before anything else ran (beyond logging the plan)
        said = [line for line in r.stderr.splitlines() if " INFO jaxstation.config.plan: plan: " not in line]
        assert said == [f"error: {lines[0].removeprefix('error: ')}"] and "Uvicorn running" not in out
