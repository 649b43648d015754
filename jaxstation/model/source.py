"""Which checkpoint a model path names, checked without reading it, and the error a checkpoint that cannot be loaded
raises. Plain Python, no JAX: the command line refuses a path that names no checkpoint before it imports JAX."""

from __future__ import annotations

import re
from pathlib import Path

from jaxstation.model.default_model import default_model_path

SPLIT_NAME = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's split parts


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the tensor or file."""


def model_source(path: str | Path | None) -> Path:
    """The checkpoint a model path names, checked without reading it: an HF directory with a config.json, or a
    .gguf file; None is the embedded default model. Raises CheckpointError saying what is wrong with the path."""
    if path is None:
        try:
            return default_model_path()
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None
    source = Path(path)
    if not source.exists():
        raise CheckpointError(f"model path {source} does not exist")
    if source.is_symlink() and source.suffix != ".gguf":  # what it links to (the image's /opt/jaxstation/model); a
        source = source.resolve()  # .gguf link stays, beside its other parts (the Hugging Face cache's snapshots)
    if source.is_dir():
        for name in ("config.json", "tokenizer.json"):
            if not (source / name).is_file():
                raise CheckpointError(f"model directory {source} has no {name}: an HF model directory holds "
                                      "config.json, tokenizer.json and *.safetensors")
        return source
    if source.suffix != ".gguf":
        raise CheckpointError(f"model path {source} is neither an HF directory nor a .gguf file")
    return source
