"""Batch invariance at the widths people run: a station over a file at Llama 3.1 8B's width (its first 2 layers, in
Q4_K_M's block formats with random codes, the default tokenizer's vocabulary; `bench.shapes.write_random_blocks`),
through the HTTP route: a request alone and the same request beside 7 others give the same tokens, greedy and seeded.
The file's K-quant matrices run the 8-row tiles of the integer products, its untied table is looked up from its blocks,
and its arena is the station's default bfloat16."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_util import ServerThread, wait_for

from bench import shapes
from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.server.station import Station

LANES, NEW = 8, 12
WIDE = dataclasses.replace(shapes.SHAPES["llama-3.1-8b"], layers=2, vocab=49152)


@pytest.fixture(scope="module")
def wide_station(tmp_path_factory: pytest.TempPathFactory):
    path = shapes.write_random_blocks(tmp_path_factory.mktemp("wide") / "llama-3.1-8b-2-layers.gguf", WIDE)
    config = StationConfig(model=str(path), lanes=LANES, max_seq=256, prefill_chunk=32, kv_block=128,
                           continuous=True, wave_widths="1,8", prefix_reuse="off")
    station = Station(config)
    with ServerThread(create_app(station)) as server, server.client(timeout=300) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, 600, "the station did not turn ready", 0.25)
        yield station, client


def _generate(client, tokens: list[int], seed: int | None) -> list[int]:
    body = {"tokens": tokens, "max_new_tokens": NEW, "ignore_eos": True}
    if seed is not None:
        body |= {"temperature": 0.9, "top_p": 0.95, "seed": seed}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["generated"]


def test_a_request_alone_equals_itself_beside_seven_others_at_8b_width(wide_station) -> None:
    station, client = wide_station
    assert station.plan.kv_dtype == "bfloat16" and station.plan.dtype == "gguf"
    prompts = [[(37 * i + 11 * j) % 49000 + 100 for j in range(9 + 5 * i)] for i in range(LANES)]
    seeds = [None, 7, None, 11, None, 13, None, 17]
    alone = [_generate(client, p, s) for p, s in zip(prompts[:2], seeds[:2], strict=True)]
    with ThreadPoolExecutor(LANES) as pool:
        together = list(pool.map(lambda ps: _generate(client, *ps), zip(prompts, seeds, strict=True)))
    assert together[:2] == alone
    assert len({tuple(t) for t in together}) > 1  # the lanes ran different requests
