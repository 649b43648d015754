"""What a loaded GGUF model keeps in memory: its weights once, on the device, and nothing of the file it came from."""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np

from jaxstation.model.default_model import default_model_path
from jaxstation.model.loader import load_gguf, open_gguf


def test_a_loaded_gguf_keeps_neither_its_file_nor_a_float32_table() -> None:
    path = default_model_path()  # Q4_1 matrices, a tied Q8_0 embedding, F32 norms
    reader = open_gguf(path)
    mapped = weakref.ref(reader.tensors[0].data.base)  # the memory map every tensor of the file views
    assert isinstance(mapped(), np.memmap)
    cfg, params = load_gguf(path, "gguf", reader, layer_loop="unroll", matmul="kernel")
    del reader
    gc.collect()
    assert mapped() is None  # no weight aliases the file's bytes, so its pages leave the process with the reader
    leaves = jax.tree_util.tree_leaves(params)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)  # no host copy beside the device arrays
    tables = [leaf for leaf in leaves if cfg.vocab_size in leaf.shape]
    assert [t.dtype for t in tables] == [np.uint8]  # the tied embedding, in its blocks: no dequantized table
