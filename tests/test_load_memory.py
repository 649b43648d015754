"""What a loaded GGUF model keeps in memory: its weights once, on the device, and nothing of the file it came from."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from bench import shapes
from bench.shapes import Shape
from jaxstation.config import memory
from jaxstation.config.settings import GiB
from jaxstation.model.default_model import default_model_path
from jaxstation.model.loader import checkpoint_weight_bytes, load_gguf, open_gguf
from jaxstation.model.quant import GGUFBlocks, take_rows


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


def test_the_weights_in_memory_are_the_files_bytes(gemma3_270m) -> None:
    """The default model (Q4_1, a tied Q8_0 table) and Gemma 3 (Q4_K_M's mix) hold their matrices as the file stores
    them: the loaded weights are the file's tensor bytes, which the memory plan counts before loading, within the
    norms' float32 and the 2% the plan allows."""
    for path in (default_model_path(), gemma3_270m):
        _, params = load_gguf(path, "gguf", layer_loop="unroll", matmul="kernel")
        planned = checkpoint_weight_bytes(path, "gguf")
        stored = sum(t.data.nbytes for t in open_gguf(path).tensors)
        assert stored <= params.nbytes <= planned <= stored * 1.02, path


def test_an_untied_gguf_table_stays_in_its_blocks(tmp_path) -> None:
    """A model with its own head: the embedding table is only looked up, from its blocks (`take_rows` gives the
    dequantized rows bit for bit), not a float32 table four to eight times its size."""
    tiny = Shape("llama", 49152, 256, 512, 1, 4, 2, 64, 512, 10000.0, tied=False)  # the default tokenizer's vocabulary
    path = shapes.write_random_blocks(tmp_path / "untied.gguf", tiny)
    cfg, params = load_gguf(path, "gguf", layer_loop="unroll", matmul="kernel")
    assert not cfg.tie_word_embeddings and params.lm_head is not None
    assert params.embed.w.dtype == np.uint8 and params.embed.blocks == "Q4_KR"
    ids = jnp.asarray([0, 17, 49151], jnp.int32)
    table = next(t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    dense = GGUFBlocks(np.asarray(table.data), "Q4_K", (cfg.vocab_size, cfg.hidden_size)).dequantize()
    assert np.array_equal(np.asarray(take_rows(params.embed, ids, jnp.float32)), dense[np.asarray(ids)])


def test_free_memory_is_memavailable_or_a_containers_room(tmp_path) -> None:
    """MemAvailable counts the page cache Linux can reclaim (MemFree does not); a cgroup's limit less its usage, plus
    its inactive file cache, where it is smaller (v2 and v1 layouts)."""
    meminfo = dict(line.split(":") for line in open("/proc/meminfo").read().splitlines())
    assert memory._meminfo_available() == int(meminfo["MemAvailable"].split()[0]) * 1024
    v2 = tmp_path / "v2"
    (v2 / "station").mkdir(parents=True)
    for name, text in (("memory.max", str(4 * GiB)), ("memory.current", str(3 * GiB)),
                       ("memory.stat", f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n")):
        (v2 / "station" / name).write_text(text + "\n")
    (tmp_path / "cgroup2").write_text("0::/station\n")
    assert memory._cgroup_room(v2, tmp_path / "cgroup2") == GiB + GiB // 2
    (v2 / "station" / "memory.max").write_text("max\n")
    assert memory._cgroup_room(v2, tmp_path / "cgroup2") is None
    v1 = tmp_path / "v1" / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    for name, text in (("memory.limit_in_bytes", str(2 * GiB)), ("memory.usage_in_bytes", str(GiB)),
                       ("memory.stat", "cache 5\ntotal_inactive_file 1024\n")):
        (v1 / name).write_text(text + "\n")
    (tmp_path / "cgroup1").write_text("5:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert memory._cgroup_room(tmp_path / "v1", tmp_path / "cgroup1") == GiB + 1024
