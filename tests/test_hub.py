"""Models by name from a Hugging Face Hub: `jaxstation download` (and --model on the other commands) with the real
`huggingface_hub` client, HF_ENDPOINT pointing at a local Hub (tests/hub_util.py) that serves fixture repositories
made here from the tiny Gemma 3 checkpoint: a safetensors repository, a GGUF one with several quants, a split GGUF,
a gated one, and one of a format the station does not read. Each command is a process of its own, so that the
client reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE as a user's would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from hub_util import TOKEN, LocalHub, local_hub, split_gguf
from server_util import wait_for

from jaxstation.model.gguf_file import GGUFFile

GEMMA = FIXTURES / "tiny-gemma3"
GGUF = (GEMMA / "model.gguf").read_bytes()
SAFETENSORS = "test-org/tiny-gemma3"
QUANTS = "test-org/tiny-gemma3-GGUF"
NO_DEFAULT = "test-org/no-default-GGUF"
SPLIT = "test-org/split-GGUF"
GATED = "test-org/gated-GGUF"
BIN_ONLY = "test-org/bin-only"
BIG = "big-F32.gguf"  # the file whose download is cut halfway: 24 MiB, past the client's first 10 MiB chunk


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes | Path]]:
    parts = split_gguf(GEMMA / "model.gguf", tmp_path_factory.mktemp("split"), "tiny-gemma3-Q4_K_M", 3)
    return {
        SAFETENSORS: {**{f: GEMMA / f for f in ("config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json")},
                      "pytorch_model.bin": b"not read", "README.md": b"# tiny", "onnx/model.onnx": b"not read"},
        QUANTS: {"tiny-gemma3-Q4_K_M.gguf": GGUF, "tiny-gemma3-Q8_0.gguf": GGUF + b"\0" * 64,
                 "tiny-gemma3-F16.gguf": GGUF + b"\0" * 32, BIG: bytes(range(256)) * (24 << 12),
                 "mmproj-tiny-gemma3-F16.gguf": b"GGUF", "README.md": b"# quants"},
        NO_DEFAULT: {"tiny-Q8_0.gguf": GGUF + b"\0" * 64, "tiny-F16.gguf": GGUF + b"\0" * 32,
                     "mmproj-tiny-F16.gguf": b"GGUF"},
        SPLIT: {p.name: p for p in parts},
        GATED: {"tiny-gemma3-Q4_K_M.gguf": GGUF},
        BIN_ONLY: {"config.json": GEMMA / "config.json", "pytorch_model.bin": b"weights", "README.md": b"# bin"},
    }


@pytest.fixture(scope="module")
def hub(repos: dict[str, dict[str, bytes | Path]]):
    with local_hub(repos, gated=frozenset({GATED})) as server:
        yield server


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh HF_HOME: an empty Hugging Face cache for each test."""
    return tmp_path / "hf-home"


def jaxstation(hub: LocalHub | None, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxstation", *args], capture_output=True, text=True, timeout=120,
                          env=_env(hub, home, env))


def _env(hub: LocalHub | None, home: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LLAMA_CACHE"))}
    # a Hub nobody answers on when there is none: a closed port of the loopback
    env.update(HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9", HF_HOME=str(home), **extra)
    return env


def download(hub: LocalHub | None, home: Path, name: str, *args: str, **env: str) -> Path:
    done = jaxstation(hub, home, "download", name, *args, **env)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def refusal(hub: LocalHub | None, home: Path, *args: str, **env: str) -> str:
    """The one error line a command that fails writes."""
    done = jaxstation(hub, home, *args, **env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_safetensors_repository_by_name(hub: LocalHub, home: Path) -> None:
    path = download(hub, home, SAFETENSORS)
    assert path.parent.name == "snapshots" and path.parent.parent.name == "models--test-org--tiny-gemma3"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]  # no *.bin, no README, no onnx/
    assert (path / "model.safetensors").read_bytes() == (GEMMA / "model.safetensors").read_bytes()
    # another command runs it by name: the tokenizer the checkpoint holds
    out = home.parent / "tokenizer"
    done = jaxstation(hub, home, "export-tokenizer", str(out), "--model", SAFETENSORS)
    assert done.returncode == 0, done.stderr
    assert (out / "tokenizer.json").read_bytes() == (GEMMA / "tokenizer.json").read_bytes()


def test_a_quant_by_tag_the_default_and_the_smallest(hub: LocalHub, home: Path, repos: dict) -> None:
    path = download(hub, home, f"{QUANTS}:q8_0")  # the tag in any case, as llama.cpp's -hf takes it
    assert path.name == "tiny-gemma3-Q8_0.gguf" and path.read_bytes() == repos[QUANTS]["tiny-gemma3-Q8_0.gguf"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-gemma3-Q8_0.gguf"]  # that quant only
    assert download(hub, home, QUANTS).name == "tiny-gemma3-Q4_K_M.gguf"  # no tag: Q4_K_M
    assert download(hub, home, NO_DEFAULT).name == "tiny-F16.gguf"  # no Q4_K_M: the smallest, never a projector


def test_a_split_gguf_downloads_every_part_and_loads_whole(hub: LocalHub, home: Path) -> None:
    path = download(hub, home, f"{SPLIT}:Q4_K_M")
    assert path.name == "tiny-gemma3-Q4_K_M-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [f"tiny-gemma3-Q4_K_M-0000{i}-of-00003.gguf"
                                                             for i in (1, 2, 3)]
    whole, split = GGUFFile(GEMMA / "model.gguf"), GGUFFile(path)
    assert [t.name for t in split.tensors] == [t.name for t in whole.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(whole.tensors, split.tensors, strict=True))


def test_the_cache_serves_without_the_hub(hub: LocalHub, home: Path) -> None:
    path = download(hub, home, f"{QUANTS}:Q8_0")
    assert download(hub, home, f"{QUANTS}:Q8_0", HF_HUB_OFFLINE="1") == path
    assert download(None, home, f"{QUANTS}:Q8_0") == path  # a Hub that cannot be reached: the cache
    assert refusal(None, home, "download", f"{QUANTS}:Q4_K_M", HF_HUB_OFFLINE="1") == (
        f"error: test-org/tiny-gemma3-GGUF has no GGUF file of quant Q4_K_M; its quants: Q8_0 (files: "
        f"tiny-gemma3-Q8_0.gguf) (in the cache, at {path.parent}: HF_HUB_OFFLINE is set)")
    assert refusal(None, home, "download", SAFETENSORS, HF_HUB_OFFLINE="1") == (
        f"error: HF_HUB_OFFLINE is set, and {SAFETENSORS} is not in the cache ({home}/hub)")
    no_network = refusal(None, home, "download", SAFETENSORS)
    assert no_network.startswith("error: cannot reach the Hub at http://127.0.0.1:9 (")
    assert no_network.endswith(f"), and {SAFETENSORS} is not in the cache ({home}/hub)")


def test_llama_cpp_s_own_cache(tmp_path: Path, home: Path) -> None:
    llama = tmp_path / "llama.cpp"
    llama.mkdir()
    (llama / "test-org_flat-GGUF_flat-Q4_K_M.gguf").write_bytes(GGUF)
    assert download(None, home, "test-org/flat-GGUF", HF_HUB_OFFLINE="1", LLAMA_CACHE=str(llama)) == (
        llama / "test-org_flat-GGUF_flat-Q4_K_M.gguf")


def test_a_revision(hub: LocalHub, home: Path) -> None:
    path = download(hub, home, QUANTS, "--revision", hub.sha(QUANTS))
    assert path.parent.name == hub.sha(QUANTS)
    assert refusal(hub, home, "download", QUANTS, "--revision", "v9") == (
        f"error: {QUANTS} has no revision 'v9' on the Hub ({hub.url}/{QUANTS})")
    # serve fetches the model it names before anything loads, and refuses as download does
    assert refusal(hub, home, "serve", "--model", QUANTS, "--revision", "v9").startswith(
        f"error: {QUANTS} has no revision 'v9'")
    assert refusal(hub, home, "serve", "--model", str(GEMMA), "--revision", "v9") == (
        f"error: --revision='v9' pins a Hub model's revision, and the model {GEMMA} is not one (org/name)")


def test_each_refusal_is_one_line(hub: LocalHub, home: Path) -> None:
    assert refusal(hub, home, "download", "test-org/nothing-here") == (
        f"error: no model test-org/nothing-here on the Hub ({hub.url}/test-org/nothing-here; a private one needs "
        "HF_TOKEN), and no local path test-org/nothing-here")
    assert refusal(hub, home, "download", f"{QUANTS}:Q2_K") == (
        f"error: {QUANTS} has no GGUF file of quant Q2_K; its quants: F16, F32, Q4_K_M, Q8_0 (files: {BIG}, "
        "tiny-gemma3-F16.gguf, tiny-gemma3-Q4_K_M.gguf, tiny-gemma3-Q8_0.gguf)")
    assert refusal(hub, home, "download", BIN_ONLY) == (
        f"error: {BIN_ONLY} holds no safetensors checkpoint (config.json and *.safetensors) and no .gguf file; it "
        "holds README.md, config.json, pytorch_model.bin")
    assert refusal(hub, home, "download", GATED) == (
        f"error: {GATED} is a gated model: accept its terms at {hub.url}/{GATED} and set HF_TOKEN to a token of that "
        f"account (HF_TOKEN is not set), and {GATED} is not in the cache ({home}/hub)")
    assert download(hub, home, GATED, HF_TOKEN=TOKEN).name == "tiny-gemma3-Q4_K_M.gguf"


def test_a_download_cut_halfway_resumes(hub: LocalHub, home: Path, repos: dict) -> None:
    """The connection closes halfway through a file: the client asks for the rest (a Range from the bytes it wrote,
    its 10 MiB chunks) and the file is whole."""
    hub.cut, hub.ranges[:] = BIG, []
    path = download(hub, home, f"{QUANTS}:F32")
    assert hub.ranges == [None, f"bytes={10 << 20}-"]
    assert path.read_bytes() == repos[QUANTS][BIG]


def test_a_killed_download_leaves_no_file_read_as_whole(hub: LocalHub, home: Path, repos: dict) -> None:
    hub.hold = BIG
    hub.half_sent.clear()
    hub.release.clear()
    folder = home / "hub" / "models--test-org--tiny-gemma3-GGUF"
    proc = subprocess.Popen([sys.executable, "-m", "jaxstation", "download", f"{QUANTS}:F32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(hub, home, {}))
    try:
        wait_for(hub.half_sent.is_set, 60, "the download did not start")
        wait_for(lambda: any(p.stat().st_size for p in folder.glob("blobs/*.incomplete")), 60,
                 "the download wrote nothing")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        hub.hold = None
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(folder.glob("snapshots/*/*"))  # the partial file is never in a snapshot
    [partial] = folder.glob("blobs/*.incomplete")  # the killed process's own partial file, never read
    assert 0 < partial.stat().st_size < len(repos[QUANTS][BIG])
    hub.ranges[:] = []
    path = download(hub, home, f"{QUANTS}:F32")
    assert hub.ranges == [None]  # the next start fetches the file again whole (docs/python.md)
    assert path.read_bytes() == repos[QUANTS][BIG]
