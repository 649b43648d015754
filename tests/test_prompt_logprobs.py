"""Scoring prompts: prefill's prompt logprobs, `/v1/completions` with `echo`, and `/tokenizer_info`.

The oracle is `forward_full` (one causal pass, no cache): echo's prompt logprobs must equal its log_softmax at every
position within 1e-4 in float32, for prompts longer than one prefill chunk, alone or beside a busy wave (bitwise).
transformers' reference (tests/reference) holds the top-64 logits at every position and the full logits only at the
last one, so it fixes each position's logprobs up to one unknown normaliser: the test checks what that determines
exactly (differences of logprobs at a position, the top-1 token, and the full distribution at the last position) and
bounds the rest. The station and engine here serve the default model's blocks float32-exact (weights "gguf-exact"):
the oracle's 1e-4 and transformers' bounds are float32's; with integer products a row's 8-bit rounding can move with
the last bit of its input, so the chunked scoring and the one-pass oracle part by up to a rounding step.
"""

from __future__ import annotations

import threading

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import oracle_logits
from server_util import ServerThread, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
ORACLE_ATOL = 1e-4
ORACLE_PAD = 128
HF_ATOL = 1e-3  # the parity tests' tolerance for logits against transformers
LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a wooden press adapted from those used for wine. Within fifty years "
        "presses were running in more than two hundred cities across Europe, and the price of a book had fallen so far "
        "that merchants, students and craftsmen could own a few.")


def logsumexp(x: np.ndarray) -> float:
    return float(np.logaddexp.reduce(x))


def oracle_logprobs(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """log_softmax of forward_full's logits [n, vocab]: row i is the distribution of token i + 1. The ids are padded
    at their end to a multiple of ORACLE_PAD (a causal pass: no row reads a later one), so every prompt here shares
    one compiled oracle."""
    padded = np.zeros(-(-len(ids) // ORACLE_PAD) * ORACLE_PAD, np.int32)
    padded[:len(ids)] = ids
    return np.asarray(jax.nn.log_softmax(oracle_logits(model, jnp.asarray(padded)), axis=-1))[:len(ids)]


@pytest.fixture(scope="module")
def station(exact_model: LoadedModel):
    st = Station(StationConfig(**SHAPE, dtype="gguf-exact", continuous=True, drain_s=5), model=exact_model)
    with ServerThread(create_app(st)) as server, server.client(timeout=120) as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        yield st, server, http


def echo(http: httpx.Client, prompt, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the engine --------------------------------------------------------------------------------------------------
def test_prefill_scored_equals_oracle_and_plain_prefill(exact_engine, exact_model) -> None:
    engine = exact_engine
    ids = exact_model.tokenizer.encode(LONG)
    assert len(ids) > 2 * engine.chunk  # three chunks
    lp = oracle_logprobs(exact_model, ids)
    scored, plain = [], None
    for start in range(0, len(ids), engine.chunk):
        sample, rows = engine.prefill_scored(3, ids, start, SamplingParams())
        scored += rows
    for start in range(0, len(ids), engine.chunk):
        plain, _ = engine.prefill(3, ids, start, SamplingParams())
    assert [s.token for s in scored] == ids[1:]
    ours = np.array([s.logprob for s in scored])
    np.testing.assert_allclose(ours, lp[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=ORACLE_ATOL)
    top_ids = np.array([[t for t, _ in s.top] for s in scored])
    top_lp = np.array([[v for _, v in s.top] for s in scored])
    np.testing.assert_array_equal(top_ids[:, 0], lp[:-1].argmax(-1))
    np.testing.assert_allclose(top_lp, np.take_along_axis(lp[:-1], top_ids, -1), rtol=0, atol=ORACLE_ATOL)
    assert sample == plain  # scoring the prompt leaves the first generated token and its logprobs bit for bit


# ---- /v1/completions with echo -----------------------------------------------------------------------------------
def check_against_oracle(reply: dict, ids: list[int], lp: np.ndarray, prompt_text: str) -> None:
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    n = len(ids)
    assert len(logprobs["tokens"]) == n + 1 and reply["usage"] == {
        "prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
        "prompt_tokens_details": {"cached_tokens": 0}}  # scored prompts never reuse KV
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ours = np.array(logprobs["token_logprobs"][1:], np.float64)
    expected = np.concatenate([lp[np.arange(n - 1), ids[1:]], [lp[-1].max()]])  # the prompt, then greedy's pick
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ORACLE_ATOL)
    for i, top in enumerate(logprobs["top_logprobs"][1:]):
        # its own token and the model's top-1 (one entry when they coincide)
        assert max(top.values()) == pytest.approx(lp[i].max(), abs=ORACLE_ATOL)
        assert logprobs["tokens"][i + 1] in top and top[logprobs["tokens"][i + 1]] == logprobs["token_logprobs"][i + 1]
        assert len(top) in (1, 2)
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[n] == len(prompt_text)
    for i in range(n):  # each token's text sits at its offset
        assert choice["text"][offsets[i]:offsets[i + 1]] == logprobs["tokens"][i], i


def test_echo_logprobs_equal_oracle_for_a_multi_chunk_prompt(station, exact_model) -> None:
    _, _, http = station
    ids = exact_model.tokenizer.encode(LONG)
    assert len(ids) > 2 * SHAPE["prefill_chunk"]  # three chunks
    lp = oracle_logprobs(exact_model, ids)
    reply = echo(http, LONG)
    check_against_oracle(reply, ids, lp, LONG)
    # token ids in, the same logprobs out
    by_ids = echo(http, ids)
    assert by_ids["choices"][0]["logprobs"] == reply["choices"][0]["logprobs"]


def test_echo_beside_a_busy_wave_is_bitwise_equal_to_alone(station, exact_model) -> None:
    st, _, http = station
    alone = echo(http, LONG, logprobs=5)
    stop = threading.Event()
    errors: list[str] = []

    def busy(i: int) -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"Story {i}: once upon a time",
                                                    "max_tokens": 60, "temperature": 0.8, "seed": i})
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: st.scheduler.busy_lanes >= 3, 60, "the busy wave did not start")
        beside = [echo(http, LONG, logprobs=5) for _ in range(2)]
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors
    for b in beside:
        assert b["choices"] == alone["choices"]


def test_echo_score_only_list_of_prompts_in_order(station, exact_model) -> None:
    _, _, http = station
    tok = exact_model.tokenizer
    prompts = ["The capital of France is Paris", "Water boils at one hundred degrees", LONG]
    reply = echo(http, prompts, max_tokens=0)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    total = 0
    for prompt, choice in zip(prompts, reply["choices"], strict=True):
        ids = tok.encode(prompt)
        total += len(ids)
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        lp = oracle_logprobs(exact_model, ids)
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        np.testing.assert_allclose(got[1:], lp[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=ORACLE_ATOL)
    assert reply["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # echo without logprobs: the text only; with generation, prompt then completion
    plain = http.post("/v1/completions", json={"prompt": prompts[0], "echo": True, "max_tokens": 3,
                                               "temperature": 0}).json()
    alone = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 3, "temperature": 0}).json()
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == prompts[0] + alone["choices"][0]["text"]


def test_echo_generation_equals_plain_generation(station) -> None:
    """Scoring the prompt does not change what is generated, nor the generated tokens' logprobs."""
    _, _, http = station
    kw = {"model": MODEL, "prompt": LONG, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    plain = http.post("/v1/completions", json=kw).json()["choices"][0]
    echoed = http.post("/v1/completions", json={**kw, "echo": True}).json()["choices"][0]
    assert echoed["text"] == LONG + plain["text"]
    n = len(plain["logprobs"]["tokens"])
    assert echoed["logprobs"]["tokens"][-n:] == plain["logprobs"]["tokens"]
    assert echoed["logprobs"]["token_logprobs"][-n:] == plain["logprobs"]["token_logprobs"]
    assert [o - len(LONG) for o in echoed["logprobs"]["text_offset"][-n:]] == plain["logprobs"]["text_offset"]
    for mine, theirs in zip(echoed["logprobs"]["top_logprobs"][-n:], plain["logprobs"]["top_logprobs"], strict=True):
        assert theirs.items() <= mine.items()  # echo adds the position's own token


def test_a_stop_token_is_listed_last_in_logprobs(station, exact_model, smollm_reference) -> None:
    """The reference chat prompt's greedy answer ends with EOS: one token before it, echo with max_tokens 1 must
    still list one entry past the prompt (lm-eval drops the last entry as the generated one)."""
    _, _, http = station
    answer = smollm_reference["p1_greedy_ids"].tolist()
    assert answer[-1] == 2
    ids = smollm_reference["p1_prompt_ids"].tolist() + answer[:-1]
    lp = oracle_logprobs(exact_model, ids)
    reply = echo(http, ids)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == exact_model.tokenizer.decode(ids)
    assert reply["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["tokens"][-1] == "<|im_end|>"
    assert logprobs["token_logprobs"][-1] == pytest.approx(lp[-1, 2], abs=ORACLE_ATOL)
    assert logprobs["text_offset"][-1] == len(choice["text"])
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64,
                                                   "temperature": 0, "logprobs": True}).json()["choices"][0]
    assert chat["finish_reason"] == "stop" and chat["logprobs"]["content"][-1]["token"] == "<|im_end|>"
    assert "<|im_end|>" not in chat["message"]["content"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "echo": True, "logprobs": 6}, "logprobs"),
])
def test_echo_refusals_name_the_field(station, body: dict, param: str) -> None:
    _, _, http = station
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- against transformers' reference -----------------------------------------------------------------------------
@pytest.mark.parametrize("p", ["p0", "p1", "p2"])
def test_echo_agrees_with_transformers_reference(p, station, exact_model, smollm_reference) -> None:
    """The reference has top-64 logits at every position and full logits at the last one only.

    - At each prompt position, logprob differences cancel the normaliser: lp(token) - lp(top-1) must equal
      logit(token) - max logit wherever the token is in the top 64, and the top-1 token must agree.
    - The normaliser itself is bounded: logsumexp of the top 64 <= it <= that plus (vocab - 64) tokens at the 64th
      logit; so each prompt token's logprob lies between the bounds this gives.
    - At the last position everything is known: the generated token's logprob and the top 5 equal log_softmax of the
      full logits.
    """
    _, _, http = station
    ids = smollm_reference[f"{p}_prompt_ids"].tolist()
    top_ids, top_logits = smollm_reference[f"{p}_top64_ids"], smollm_reference[f"{p}_top64_logits"]
    last = smollm_reference[f"{p}_last_logits"].astype(np.float64)
    vocab = exact_model.cfg.vocab_size
    reply = echo(http, ids, logprobs=5)
    lp = reply["choices"][0]["logprobs"]
    got = lp["token_logprobs"]
    checked = 0
    for i in range(1, len(ids)):
        row_ids, row = top_ids[i - 1], top_logits[i - 1].astype(np.float64)
        top = lp["top_logprobs"][i]
        best = max(top.values())
        assert top[exact_model.tokenizer.token_bytes(int(row_ids[row.argmax()])).decode("utf-8", "replace")] == best
        lse_lo = logsumexp(row)
        lse_hi = np.logaddexp(lse_lo, np.log(vocab - 64) + row.min())
        hit = np.flatnonzero(row_ids == ids[i])
        if hit.size:
            checked += 1
            logit = row[hit[0]]
            assert got[i] - best == pytest.approx(logit - row.max(), abs=2 * HF_ATOL), i
            assert logit - lse_hi - HF_ATOL <= got[i] <= logit - lse_lo + HF_ATOL, i
        else:  # outside the top 64: below the 64th logit
            assert got[i] <= row.min() - lse_lo + HF_ATOL, i
    assert checked >= (len(ids) - 1) // 2  # most prompt tokens are in the model's top 64
    full = last - logsumexp(last)
    assert got[-1] == pytest.approx(full.max(), abs=HF_ATOL)  # greedy's pick
    assert sorted(lp["top_logprobs"][-1].values(), reverse=True) == pytest.approx(np.sort(full)[::-1][:5],
                                                                                  abs=HF_ATOL)


# ---- /tokenizer_info ---------------------------------------------------------------------------------------------
def test_tokenizer_info_fields_equal_the_tokenizer(station, exact_model) -> None:
    _, _, http = station
    tok = exact_model.tokenizer
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token == "<|im_end|>" and info["eos_token_id"] == tok.eos_ids[0] == 2
    assert info["bos_token"] == tok.bos_token == "<|im_start|>" and info["bos_token_id"] == tok.bos_id == 1
    assert info["pad_token"] == tok.pad_token and info["pad_token_id"] == tok.pad_id == 2  # the GGUF's padding id
    assert info["unk_token"] == tok.unk_token and info["unk_token_id"] == tok.unk_id == 0
    assert info["chat_template"] == tok.chat_template and info["add_bos_token"] is tok.add_bos is False
    assert info["vocab_size"] == tok.vocab_size == exact_model.cfg.vocab_size
    assert info["model_max_length"] == SHAPE["max_seq"] and info["tokenizer_class"]
    # what lm-eval's RemoteTokenizer does with them: encode each special token without special tokens added
    for name in ("eos", "bos", "pad"):
        r = http.post("/tokenize", json={"prompt": info[f"{name}_token"], "add_special_tokens": False}).json()
        assert r["tokens"] == [info[f"{name}_token_id"]]
    assert http.post("/detokenize", json={"tokens": [2]}).json() == {"prompt": "<|im_end|>"}

