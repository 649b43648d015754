"""The prefix cache's disk tier (engine/prefix_disk.py): a restarted scheduler reuses what the last one wrote, files
of other settings, truncated, corrupt or half-written are skipped, an unusable directory is not fatal, the bytes stay
bound, ring entries keep their restart points; and on the default model, and with rings on tiny Gemma 3, a restart's
reuse gives a fresh prefill's bits."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, expected
from test_kv_windows import _engine, _prompt
from test_prefix_tier import GREEDY, SEEDED, TIMEOUT, assert_same_samples, ids, run, saved

from jaxstation.config.settings import ConfigError, MiB, resolve
from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.engine import Engine
from jaxstation.engine.prefix_disk import DiskTier
from jaxstation.engine.prefix_entries import TierEntry
from jaxstation.engine.prefix_files import engine_fingerprint
from jaxstation.engine.scheduler import Scheduler

FAKE = {"weights": "fake", "dtype": "float32", "kv_dtype": "float32", "chunk": 4}
LOGGER = "jaxstation.engine.prefix_disk"


def station(directory: Path, fingerprint: dict = FAKE, capacity: int = MiB) -> tuple[FakeEngine, Scheduler]:
    """A fresh fake engine and scheduler over the disk tier in `directory`, as a restarted process has."""
    fake = FakeEngine(lanes=2, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=MiB,
                      prefix_cache_disk=lambda: DiskTier(directory, capacity, fingerprint))
    sched.start()
    return fake, sched


def next_turn(prompt: list[int]) -> list[int]:
    return prompt + expected(prompt, 3) + [7]


CONVERSATIONS = [[10 * c + i for i in range(9)] for c in range(1, 4)]  # 8 tokens cached each, 16 bytes a token


def first_run(directory: Path) -> None:
    """Three conversations on two lanes, then a clean stop: one spilled (written then), two written at the stop."""
    _, sched = station(directory)
    for prompt in CONVERSATIONS:
        run(sched, prompt, 3)
    assert sched.drain(10)
    assert len(list(directory.glob("*.kv"))) == 3


def test_a_restarted_scheduler_resumes_every_conversation_from_disk(tmp_path: Path) -> None:
    first_run(tmp_path)
    fake, sched = station(tmp_path)
    try:
        for prompt in CONVERSATIONS:
            r = run(sched, next_turn(prompt), 2)
            assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(prompt), 2), 8)
        assert saved(sched, "disk") == 24 and not fake.errors
        value = sched.metrics.registry.get_sample_value
        assert value("jaxstation_prefix_cache_disk_load_seconds_count") == 3
        assert value("jaxstation_prefix_cache_disk_entries") >= 3
    finally:
        assert sched.drain(10)


def test_reset_prefix_cache_deletes_the_files(tmp_path: Path) -> None:
    first_run(tmp_path)
    fake, sched = station(tmp_path)
    try:
        assert sched.reset_prefix_cache().result(TIMEOUT) == 3 and not list(tmp_path.glob("*.kv"))
        r = run(sched, next_turn(CONVERSATIONS[0]), 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(CONVERSATIONS[0]), 2), 0)
    finally:
        assert sched.drain(10)
    assert len(list(tmp_path.glob("*.kv"))) == 1  # the clean stop wrote the lane


def test_files_of_other_settings_truncated_or_corrupt_are_skipped(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    first_run(tmp_path)
    for change in ({"weights": "other"}, {"dtype": "bfloat16"}, {"kv_dtype": "int8"}, {"chunk": 8}):
        caplog.clear()
        with caplog.at_level("INFO", logger=LOGGER):
            other = DiskTier(tmp_path, MiB, {**FAKE, **change})
        assert len(other) == 0 and sum("written for another model or settings" in r.getMessage()
                                       for r in caplog.records) == 3
        other.close()
    files = sorted(tmp_path.glob("*.kv"))
    data = files[0].read_bytes()
    files[0].write_bytes(data[:-5])  # truncated
    data = bytearray(files[1].read_bytes())
    data[-3] ^= 0xFF  # one flipped bit pattern in the arrays: the checksum fails at load
    files[1].write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        fake, sched = station(tmp_path)
        try:
            cached = []
            for prompt in CONVERSATIONS:
                r = run(sched, next_turn(prompt), 2)
                assert r.generated == expected(next_turn(prompt), 2)
                cached.append(r.timing["cached_tokens"])
            assert sorted(cached) == [0, 0, 8] and not fake.errors
        finally:
            assert sched.drain(10)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert f"skipping {files[0].name} (ValueError:" in messages[0] and "truncated" in messages[0]
    assert f"skipping {files[1].name} (ValueError: the checksum does not match: corrupt)" in messages[1]


def test_a_half_written_temporary_file_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first_run(tmp_path)
    whole = sorted(tmp_path.glob("*.kv"))[0]
    (tmp_path / f".{whole.name}.123.1.tmp").write_bytes(whole.read_bytes()[:40])  # a writer killed mid-write
    with caplog.at_level("WARNING", logger=LOGGER):
        tier = DiskTier(tmp_path, MiB, FAKE)
    assert len(tier) == 3 and not caplog.records
    assert all(tier.load(e) is not None for e in tier.entries())  # the complete files load
    tier.close()


def test_an_unusable_directory_turns_the_disk_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_bytes(b"not a directory")
    with caplog.at_level("WARNING", logger=LOGGER):
        fake, sched = station(blocked)
    try:
        assert [r.getMessage().startswith("prefix cache on disk: off, since") for r in caplog.records] == [True]
        assert sched.prefix_tier.disk is None
        for prompt in CONVERSATIONS:
            assert run(sched, prompt, 3).generated == expected(prompt, 3)
        assert not fake.errors
    finally:
        assert sched.drain(10)


def test_the_least_recently_used_files_go_first_within_the_bytes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MiB, FAKE)
    for k in range(3):
        tier.put(TierEntry(tuple(range(10 * k, 10 * k + 8)), 0, np.full((8, 2), k, np.int64)))
    tier.close()
    files = {e.tokens[0]: e for e in DiskTier(tmp_path, MiB, FAKE).entries()}
    size = files[10].nbytes + files[20].nbytes  # room for two
    for k, entry in files.items():  # written in order, a second apart
        os.utime(entry.path, (1000 + k, 1000 + k))
    tier = DiskTier(tmp_path, size, FAKE)  # the oldest (0) goes at start
    assert sorted(e.tokens[0] for e in tier.entries()) == [10, 20] and tier.evictions == 1
    found = tier.find(list(range(10, 18)) + [5], 0, 4)
    assert found.matched == found.reused == 8
    assert (tier.load(found.entry).kv == 1).all()  # touched: 10 is the most recent now
    tier.put(TierEntry(tuple(range(30, 38)), 0, np.full((8, 2), 3, np.int64)))
    tier.close()
    assert sorted(e.tokens[0] for e in tier.entries()) == [10, 30] and tier.nbytes <= size
    assert len(list(tmp_path.glob("*.kv"))) == 2


def _kv(n: int, fill: int) -> KVBuffers:
    return KVBuffers(np.full((1, n, 2), fill, np.float32), np.full((1, n, 2), -fill, np.float32))


def test_ring_files_keep_their_restart_points_and_restart_only_there(tmp_path: Path) -> None:
    """With rings a file holds its restart points and their windows and restarts at the furthest at or below the
    match; a file that extends another replaces it only where it holds every restart point of the other."""
    tier = DiskTier(tmp_path, MiB, FAKE)
    first, second = tuple(range(100, 108)), tuple(range(100, 116))
    tier.put(TierEntry(first, 0, _kv(8, 1), ((8, _kv(3, 8)),)))
    tier.put(TierEntry(second[:12] + (7, 7, 7, 7), 0, _kv(16, 2), ((16, _kv(3, 16)),)))  # extends first, not its point
    tier.close()
    tier = DiskTier(tmp_path, MiB, FAKE)
    assert sorted(e.restarts for e in tier.entries()) == [(8,), (16,)]  # first was not replaced
    found = tier.find(list(second[:12]) + [1, 2], 0, 4)
    assert (found.matched, found.reused, found.entry.tokens) == (8, 8, first)  # the other matches 12, restarts at 16
    loaded = tier.load(found.entry)
    assert loaded.windows[0][0] == 8 and (loaded.windows[0][1].k == 8).all() and (loaded.windows[0][1].v == -8).all()
    assert (loaded.kv.k == 1).all()
    assert tier.covers(first, 0, (8,)) and not tier.covers(first, 0, (4, 8))
    tier.put(TierEntry(second, 0, _kv(16, 3), ((8, _kv(3, 8)), (16, _kv(3, 16)))))  # holds first's point: replaces it
    tier.close()
    tier = DiskTier(tmp_path, MiB, FAKE)
    assert sorted((e.tokens[-1], e.restarts) for e in tier.entries()) == [(7, (16,)), (115, (8, 16))]
    found = tier.find(list(second) + [1], 0, 4)
    assert (found.entry.tokens, found.reused) == (second, 16)
    loaded = tier.load(found.entry)
    assert [n for n, _ in loaded.windows] == [8, 16] and (loaded.windows[1][1].k == 16).all()
    assert tier.find(list(second[:7]) + [1], 0, 4) is None  # below every restart point


def test_the_disk_settings() -> None:
    c = resolve(None, {"MOONSHINE_PREFIX_CACHE_DIR": "/cache", "MOONSHINE_PREFIX_CACHE_DISK_MB": "64"})
    assert (c.prefix_cache_dir, c.prefix_cache_disk_mb) == ("/cache", 64)
    with pytest.raises(ConfigError, match="MOONSHINE_PREFIX_CACHE_DISK_MB=0 must be >= 1"):
        resolve(None, {"MOONSHINE_PREFIX_CACHE_DISK_MB": "0"})


# ---- the default model ------------------------------------------------------------------------------------------

def test_a_restart_reuses_the_disk_tier_with_a_fresh_prefills_bits(engine: Engine, tmp_path: Path) -> None:
    fingerprint = engine_fingerprint(engine)
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=64 * MiB,
                      prefix_cache_disk=lambda: DiskTier(tmp_path, 64 * MiB, fingerprint))
    sched.start()
    first = ids(1, 70)
    try:
        r1 = run(sched, first, 4, SEEDED)
    finally:
        assert sched.drain(10)  # the clean stop writes first's lane
    assert len(list(tmp_path.glob("*.kv"))) == 1
    engine.reset()  # a fresh arena, as a new process has
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=64 * MiB,
                      prefix_cache_disk=lambda: DiskTier(tmp_path, 64 * MiB, engine_fingerprint(engine)))
    sched.start()
    try:
        target = first + r1.generated + ids(2, 9)
        hit = run(sched, target, 6, SEEDED)
        assert hit.timing["cached_tokens"] == 64 and saved(sched, "disk") == 64
        fresh = run(sched, target, 6, SEEDED, reuse=False)
        assert_same_samples(hit, fresh)
        assert run(sched, ids(3, 20), 1, GREEDY).generated
    finally:
        assert sched.drain(TIMEOUT)


def test_a_restart_reuses_a_ring_entry_from_disk_with_a_fresh_prefills_bits(tmp_path: Path) -> None:
    """Tiny Gemma 3 with rings (a 32-slot ring, a window of 8): a 25-token prompt and a 30-token reply, which
    overwrites the window before 24 in the ring, then a clean stop writes the lane's prefix with its restart points
    at 16 (inner: every 16 tokens) and 24 (the prompt's end), their windows copied as the prompt's prefill passed
    them. A fresh engine over the directory restores it for the next turn and restarts at 24, and for a prompt that
    diverges at 21 at 16: their tokens and logprobs equal a fresh prefill's. The ring's fingerprint differs from the
    full arena's, so its files are never loaded there."""
    ring = _engine("tiny-gemma3", "ring")
    vocab = ring.cfg.vocab_size
    fingerprint = engine_fingerprint(ring)
    full = engine_fingerprint(_engine("tiny-gemma3", "full"))
    assert fingerprint["layout"]["window"] == ring.cfg.sliding_window and "rings" not in full["layout"]
    assert fingerprint != full
    sched = Scheduler(ring, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB,
                      prefix_cache_disk=lambda: DiskTier(tmp_path, 16 * MiB, fingerprint))
    sched.start()
    first = _prompt(20, 25, vocab)
    try:
        reply = run(sched, first, 30)
    finally:
        assert sched.drain(10)
    assert [e.restarts for e in DiskTier(tmp_path, 16 * MiB, fingerprint).entries()] == [(16, 24)]
    assert not DiskTier(tmp_path, 16 * MiB, full).entries()
    again = _engine("tiny-gemma3", "ring")  # a new process's engine
    sched = Scheduler(again, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB,
                      prefix_cache_disk=lambda: DiskTier(tmp_path, 16 * MiB, engine_fingerprint(again)))
    sched.start()
    try:
        target = first + reply.generated + _prompt(21, 3, vocab)
        hit = run(sched, target, 4, SEEDED)
        assert hit.timing["cached_tokens"] == 24 and saved(sched, "disk") == 24
        assert_same_samples(hit, run(sched, target, 4, SEEDED, reuse=False))
    finally:
        assert sched.drain(TIMEOUT)
    again = _engine("tiny-gemma3", "ring")
    sched = Scheduler(again, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB,
                      prefix_cache_disk=lambda: DiskTier(tmp_path, 16 * MiB, engine_fingerprint(again)))
    sched.start()
    try:
        target = first[:21] + _prompt(22, 9, vocab)  # diverges inside the first prompt, past its inner point
        hit = run(sched, target, 4, SEEDED)
        assert hit.timing["cached_tokens"] == 16 and saved(sched, "disk") == 16
        assert_same_samples(hit, run(sched, target, 4, SEEDED, reuse=False))
    finally:
        assert sched.drain(TIMEOUT)
