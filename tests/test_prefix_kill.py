"""The disk tier across a killed process: a station (`python -m jaxstation serve --prefix-cache-dir`) SIGKILLed just
after the requests that queue its prefix files, whatever it was writing then, leaves complete files that a restarted
station reuses with the killed one's tokens, and temporary files that it never reads (and deletes once old)."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
from conftest import FIXTURES
from server_util import free_port, station_process, wait_for

from jaxstation.engine.prefix_disk import STALE_TMP_S
from jaxstation.engine.prefix_files import MAGIC

ROOT = Path(__file__).resolve().parents[1]
# tiny Gemma 3 (a window of 8) keeps rings of 144 slots: restart points every 32 tokens (two windows, a chunk)
SHAPE = ["--lanes", "4", "--max-seq", "256", "--prefill-chunk", "32", "--kv-block", "16"]


def file_header(path: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the token ids, the restart points) in a prefix file's header."""
    with path.open("rb") as f:
        assert f.read(len(MAGIC)) == MAGIC
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        return tuple(header["tokens"]), tuple(header["restarts"])


def serve(directory: Path) -> tuple[list[str], int]:
    port = free_port()
    return [sys.executable, "-m", "jaxstation", "serve", "--model", str(FIXTURES / "tiny-gemma3"), "--port", str(port),
            *SHAPE, "--prefix-cache-dir", str(directory)], port


def test_a_killed_stations_complete_files_are_reused_and_its_temporary_files_ignored(tmp_path: Path) -> None:
    """Tiny Gemma 3 with rings, eight 100-token prompts on four lanes: the last four take the first four's lanes,
    which queues those four prefixes (96 tokens, restart points at 32, 64 and 96) for files. The station is SIGKILLed
    as soon as one file is complete; two half-written temporary files are put beside them, as writers killed
    mid-write leave, one of them two hours old. A restarted station over the directory reuses every complete file (96
    cached tokens), prefills the rest in full, and gives the killed station's tokens, which it computed without any
    reuse; it deletes the old temporary file and leaves the recent one."""
    directory = tmp_path / "kv"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    prompts = [np.random.default_rng(seed).integers(3, 256, 100).tolist() for seed in range(8)]
    cmd, port = serve(directory)
    with station_process(cmd, port, tmp_path / "first.log", 120, env=env, cwd=ROOT) as (proc, client):
        first = [client.post("/generate", json={"tokens": p, "max_new_tokens": 4, "resume": True}).json()
                 for p in prompts]
        assert [r["timing"]["cached_tokens"] for r in first] == [0] * 8
        wait_for(lambda: list(directory.glob("*.kv")), 10, "no prefix file written")
        proc.kill()
        proc.wait()
    headers = [file_header(p) for p in directory.glob("*.kv")]
    assert all(restarts == (32, 64, 96) for _, restarts in headers)  # inside each prompt and at its end
    complete = {tokens for tokens, _ in headers}
    assert complete <= {tuple(p[:96]) for p in prompts[:4]}
    whole = sorted(directory.glob("*.kv"))[0]
    fresh, stale = directory / f".{whole.name}.999.1.tmp", directory / f".{whole.name}.999.2.tmp"
    for tmp in (fresh, stale):
        tmp.write_bytes(whole.read_bytes()[:200])
    os.utime(stale, (time.time() - 2 * STALE_TMP_S,) * 2)
    cmd, port = serve(directory)
    with station_process(cmd, port, tmp_path / "second.log", 120, env=env, cwd=ROOT) as (proc, client):
        for prompt, ref in zip(prompts, first, strict=True):
            r = client.post("/generate", json={"tokens": prompt, "max_new_tokens": 4, "resume": True}).json()
            assert r["timing"]["cached_tokens"] == (96 if tuple(prompt[:96]) in complete else 0)
            assert r["generated"] == ref["generated"]
    assert "skipping" not in (tmp_path / "second.log").read_text()
    assert fresh.exists() and not stale.exists()  # a recent one may be another process's write in progress
