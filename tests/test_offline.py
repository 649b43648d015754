"""Offline serving: the Python API (`LLM.generate`, `LLM.chat`) and OpenAI batch files (`jaxstation batch`), each
against what a served station answers. One `LLM` on the default model (4 lanes, 512 positions) serves the module,
its station also served over HTTP for the references; one on tiny Gemma 3 checks a second family. A prompt's tokens
from `LLM.generate`, run beside the others, equal `/generate`'s for it alone, greedy and seeded; a batch line's
reply equals its route's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import FIXTURES, SERVE_SHAPE_FLAGS
from server_util import ServerThread, wait_for

from jaxstation import LLM, SamplingParams
from jaxstation.app import create_app
from jaxstation.cli import build_parser
from jaxstation.offline.batch import run_batch
from jaxstation.offline.batch_file import BatchFileError, check_input

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol():
    """The default model's LLM, and its station over HTTP: (llm, http client)."""
    with LLM(**SHAPE) as llm, ServerThread(create_app(llm.station)) as server, server.client(timeout=120) as http:
        yield llm, http


def alone(http: httpx.Client, tokens: list[int], params: SamplingParams) -> list[int]:
    """`/generate`'s tokens for one prompt, sent alone."""
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "seed": params.seed}
    r = http.post("/generate", json={"tokens": tokens, "max_new_tokens": params.max_tokens, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["generated"]


def equal_to_generate_alone(llm: LLM, http: httpx.Client, prompts: list, greedy: dict, sampled: dict) -> None:
    """Every prompt twice, greedy and seeded, each with its own max_tokens so that they end out of order: run all at
    once by `LLM.generate`, then each alone through `/generate`."""
    params = [SamplingParams(**greedy, max_tokens=4 + 3 * (i % 4)) for i in range(len(prompts))]
    params += [SamplingParams(**sampled, seed=100 + i, max_tokens=14 - 3 * (i % 4)) for i in range(len(prompts))]
    outputs = llm.generate(prompts * 2, params, use_tqdm=False)
    for prompt, output, sp in zip(prompts * 2, outputs, params, strict=True):
        tokens = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
        assert output.prompt_token_ids == tokens and output.prompt == (prompt if isinstance(prompt, str) else None)
        assert output.outputs[0].token_ids == alone(http, tokens, sp)


def test_generate_equals_generate_alone_in_input_order(smol) -> None:
    llm, http = smol
    prompts = ["The capital of France is", "Once upon a time, in a city by the sea, there", [504, 3575, 282, 4649],
               "Hi", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
                      28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    equal_to_generate_alone(llm, http, prompts, {"temperature": 0}, {"temperature": 0.8, "top_p": 0.95})


def test_tiny_gemma3_equals_generate_alone() -> None:
    shape = {"lanes": 4, "max_seq": 64, "prefill_chunk": 8, "kv_block": 16, "prefill_budget": "16",
             "kv_dtype": "float32"}  # the families' station's shape (tests/test_families.py)
    with LLM(str(FIXTURES / "tiny-gemma3" / "model.gguf"), **shape) as llm, \
            ServerThread(create_app(llm.station)) as server, server.client(timeout=120) as http:
        prompts = [[5, 6, 7], list(range(40, 61)), [200, 100, 9, 9, 9, 9, 9, 9, 9, 9], [42]]
        equal_to_generate_alone(llm, http, prompts, {"temperature": 0}, {"temperature": 1.0})


def test_text_chat_logprobs_and_stops_are_the_routes(smol) -> None:
    llm, http = smol
    [chat] = llm.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    reply = http.post("/v1/chat/completions", json={"messages": CAPITAL, "temperature": 0, "max_tokens": 24}).json()
    assert chat.outputs[0].text == reply["choices"][0]["message"]["content"]
    assert len(chat.prompt_token_ids) == reply["usage"]["prompt_tokens"]
    assert len(chat.outputs[0].token_ids) == reply["usage"]["completion_tokens"]
    params = SamplingParams(temperature=0, max_tokens=16, stop=["\n"], logprobs=2)
    [out] = llm.generate("The capital of France is", params, use_tqdm=False)
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16, "stop": ["\n"], "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == (choice["text"], choice["finish_reason"]) == (
        " Paris.", "stop")
    lp = choice["logprobs"]
    assert [next(iter(e.values())) for e in out.outputs[0].logprobs] == lp["token_logprobs"][:len(out.outputs[0]
                                                                                                   .logprobs)]
    assert all(len(e) >= 2 for e in out.outputs[0].logprobs)


def test_bad_settings_and_params_name_the_field(smol) -> None:
    llm, _ = smol
    with pytest.raises(ValueError, match=r"^SamplingParams: temperature: input should be less than or equal to 2"):
        SamplingParams(temperature=3)
    with pytest.raises(TypeError, match=r"^unknown setting port; the settings are: model, revision, "):
        LLM(port=8000)
    with pytest.raises(ValueError, match=r"^lanes=0 must be >= 1$"):
        LLM(lanes=0)
    with pytest.raises(ValueError, match=r"^dtype=gguf needs the CPU kernel \(matmul=kernel or auto, on CPU\)$"):
        LLM(dtype="gguf", matmul="xla", **SHAPE)  # refused by the plan, before anything loads
    with pytest.raises(ValueError, match=r"^prompt 1: the prompt \(1 tokens\) plus max_tokens \(600\) exceeds"):
        llm.generate(["a", [5]], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=600)], use_tqdm=False)


def batch_lines(n: int) -> list[dict]:
    """n batch requests: chat and completions, greedy and seeded, a few tokens each."""
    lines = []
    for i in range(n):
        chat = i % 2 == 0
        body = {"model": "x", "max_tokens": 3 + i % 5, **({"temperature": 0} if i % 3 else {"seed": i})}
        body |= {"messages": [{"role": "user", "content": f"Count to {i}."}]} if chat else {"prompt": f"{i} and"}
        lines.append({"custom_id": f"request-{i}", "method": "POST",
                      "url": "/v1/chat/completions" if chat else "/v1/completions", "body": body})
    return lines


def written(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def same_reply(body: dict) -> dict:
    """A reply less what differs between two answers to one request: its id and time, and how many prompt tokens
    the prefix cache held (the batch ran the prompt first)."""
    usage = {k: v for k, v in body.get("usage", {}).items() if k != "prompt_tokens_details"}
    return {k: v for k, v in body.items() if k not in ("id", "created", "usage")} | ({"usage": usage} if usage else {})


def test_a_batch_file_answers_as_the_routes(smol, tmp_path: Path) -> None:
    llm, http = smol
    lines = batch_lines(47)
    text = [json.dumps(line) for line in lines]
    text.insert(10, '{"custom_id": "not json",')
    text.insert(20, json.dumps({**lines[3], "custom_id": "embeddings", "url": "/v1/embeddings"}))
    invalid = {**lines[5], "custom_id": "invalid", "body": {**lines[5]["body"], "temperature": 5}}
    text.insert(30, json.dumps(invalid))
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(text) + "\n")
    summary = run_batch(llm.station, source, out, check_input(source), use_tqdm=False)
    assert (summary.lines, summary.errors) == (50, 3)
    results = {r["custom_id"]: r for r in written(out)}
    assert len(results) == 50
    assert results[None]["error"]["code"] == "invalid_json" and results[None]["response"] is None
    assert results["embeddings"]["error"] == {
        "code": "invalid_request",
        "message": "line 21: url '/v1/embeddings' is not served in a batch (served: /v1/chat/completions, "
                   "/v1/completions)"}
    with ThreadPoolExecutor(4) as pool:  # the routes' replies, four at a time
        replies = list(pool.map(lambda line: http.post(line["url"], json=line["body"]), [*lines, invalid]))
    for line, reply in zip([*lines, invalid], replies, strict=True):
        got = results[line["custom_id"]]
        assert got["error"] is None and got["id"].startswith("batch_req_")
        assert got["response"]["status_code"] == reply.status_code
        assert same_reply(got["response"]["body"]) == same_reply(reply.json()), line["custom_id"]
    assert results["invalid"]["response"]["body"]["error"]["param"] == "temperature"


def test_a_killed_batch_run_restarts_where_it_stopped(smol, tmp_path: Path) -> None:
    llm, _ = smol
    lines = [{**line, "body": {**line["body"], "max_tokens": 32}} for line in batch_lines(50)]
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.Popen([sys.executable, "-m", "jaxstation", "batch", "-i", str(source), "-o", str(out),
                             "--quiet", *SERVE_SHAPE_FLAGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 20, 300, "20 lines were not written")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    first = written(out)  # whole lines only
    assert 20 <= len(first) < 50 and "stopped by SIGTERM, run it again to answer the rest" in err
    with out.open("a") as f:
        f.write('{"id": "batch_req_cut", "custom_')  # a line a kill cut short: dropped, and run again
    summary = run_batch(llm.station, source, out, check_input(source), use_tqdm=False)
    assert summary.lines == 50 - len(first)
    results = written(out)
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_a_batch_file_with_a_custom_id_twice_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "requests.jsonl"
    lines = batch_lines(3)
    source.write_text("".join(json.dumps(line) + "\n" for line in [*lines, lines[1]]))
    with pytest.raises(BatchFileError, match=r"custom_id 'request-1' is on lines 2 and 4; each line's custom_id must "
                                             "be unique"):
        check_input(source)


def test_help_lists_download_and_batch() -> None:
    top = build_parser().format_help()
    assert "download" in top and "batch" in top
