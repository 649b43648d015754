"""The model's choices a user names in a setting: weight dtypes, layer loops, how projections multiply, and a mesh
station's layer range. Plain Python, no JAX: the command line parses and checks its settings before it imports JAX."""

from __future__ import annotations

import dataclasses

GGUF_WEIGHTS = ("gguf", "gguf-exact")  # a GGUF file's blocks as stored: integer products, or float32's exact bits
# gguf, gguf-exact: a GGUF file's blocks as stored, on the CPU kernel, multiplied in integers or float32-exact
WEIGHT_DTYPES = ("float32", "bfloat16", "int8", *GGUF_WEIGHTS)
LAYER_LOOPS = ("scan", "unroll")
MATMULS = ("xla", "kernel")  # how projections multiply: XLA's dot, or the CPU kernel over KernelWeights


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """Layers [start, stop) of a model: what one mesh station holds."""

    start: int
    stop: int

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """'A:B' -> layers [A, B)."""
        a, sep, b = text.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise ValueError(f"a layer range is 'A:B' with integers 0 <= A < B, got {text!r}")
        r = cls(int(a), int(b))
        if r.start >= r.stop:
            raise ValueError(f"a layer range is 'A:B' with A < B, got {text!r}")
        return r

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"
