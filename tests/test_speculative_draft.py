"""Speculative decoding with a draft model (engine/draft.py, config/draft.py): a request's tokens, logprobs and finish
reason with a draft model's drafts verified in one step equal those without speculation, bit for bit (greedy and
seeded, k = 1, 3 and 7, alone and beside requests that speculate and that do not, both scheduler modes, the default
model's GGUF blocks, float32 and int8 weights, and the tiny fixtures with a smaller draft); a draft whose vocabulary
differs is refused in one line naming both files.

The default model drafts for itself here (its only model with the same vocabulary), on an engine of the shared
engines' shape, so its programs are theirs; tiny-qwen2 has a 1-layer draft (tests/fixtures/tiny-qwen2-draft) whose
drafts mostly fail, which exercises the rejections."""

from __future__ import annotations

from pathlib import Path

import gguf
import openai
import pytest
from conftest import FIXTURES, WIDE_SHAPE, engine_config, station_plan
from server_util import ServerThread, metric, wait_for
from test_cli import run_cli
from test_gguf_types import rewrite_gguf
from test_speculative_engine import GREEDY, SEEDED, accepted, jobs_for, run

from jaxstation.app import create_app
from jaxstation.config.draft import check_draft, load_draft
from jaxstation.config.plan import load_planned, planned_engine
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.draft import DraftModel
from jaxstation.engine.engine import Engine
from jaxstation.engine.jobs import Job
from jaxstation.engine.speculative import NgramProposer, Speculation
from jaxstation.model.loader import LoadedModel, model_source
from jaxstation.server.station import Station

TINY_DRAFT = FIXTURES / "tiny-qwen2-draft" / "model.gguf"
TINY_F32 = FIXTURES / "tiny-qwen2"  # the same weights in safetensors: float32
# 8 lanes, so that four requests leave rows for drafts; the HTTP station has the same shape, and so the same programs
TINY_SHAPE = {"lanes": 8, "max_seq": 256, "prefill_chunk": 32, "kv_block": 128, "prefill_budget": 32}


@pytest.fixture(scope="module")
def prompt(default_model: LoadedModel) -> list[int]:
    from test_speculative_engine import TEXT

    return default_model.tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def draft(default_model: LoadedModel) -> DraftModel:
    """The default model drafting, at the shared engine's shape (its programs are `engine`'s)."""
    config = engine_config()
    return DraftModel(planned_engine(default_model, config, station_plan(config)))


@pytest.fixture(scope="module")
def wide_draft(default_model: LoadedModel) -> DraftModel:
    return DraftModel(Engine(default_model, **WIDE_SHAPE, attention="kernel"))


def drafted(sched) -> float:
    return sched.metrics.registry.get_sample_value("jaxstation_spec_decode_num_draft_tokens_total")


_PLAIN: dict[tuple, tuple] = {}


def plain(engine: Engine, prompts: list[list[int]], sampling, n: int = 16) -> list[tuple]:
    """Each prompt's run alone without speculation (each prompt run once per engine, sampling and length)."""
    for p in prompts:
        key = (id(engine), tuple(p), sampling, n)
        if key not in _PLAIN:
            _PLAIN[key] = run(engine, jobs_for([p], sampling, n), None)[0][0]
    return [_PLAIN[id(engine), tuple(p), sampling, n] for p in prompts]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3])
def test_alone_a_draft_model_changes_no_bit(engine: Engine, draft: DraftModel, prompt: list[int], sampling, k: int
                                            ) -> None:
    spec, sched = run(engine, jobs_for([prompt], sampling), Speculation(draft, k=k))
    assert spec == plain(engine, [prompt], sampling)
    assert accepted(sched) > 0
    if sampling == GREEDY:  # the model drafting for itself, greedy: its catch-up holds the request's k/v exactly
        assert accepted(sched) == drafted(sched)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "serialized"])
def test_beside_one_other_a_draft_model_changes_no_bit(engine: Engine, draft: DraftModel, prompt: list[int],
                                                       continuous: bool) -> None:
    prompts = [prompt, prompt[5:]]
    spec, sched = run(engine, jobs_for(prompts, SEEDED), Speculation(draft, k=3), continuous)
    assert spec == plain(engine, prompts, SEEDED)
    assert accepted(sched) > 0


@pytest.mark.parametrize("others", [3, 7])
def test_seven_drafts_a_step_beside_others(wide_engine: Engine, wide_draft: DraftModel, prompt: list[int],
                                           others: int) -> None:
    """16 lanes: up to 7 drafts of the oldest request beside 3 or 7 others, one of which does not speculate."""
    prompts = [prompt] + [prompt[3 * i:] for i in range(1, others + 1)]
    spec, sched = run(wide_engine, jobs_for(prompts, GREEDY, n=10, opt_out=2), Speculation(wide_draft, k=7, rows=16))
    assert spec == plain(wide_engine, prompts, GREEDY, n=10)
    assert accepted(sched) > 0


def test_int8_weights_with_the_gguf_draft(int8_engine: Engine, draft: DraftModel, prompt: list[int]) -> None:
    prompts = [prompt, prompt[7:]]
    spec, sched = run(int8_engine, jobs_for(prompts, SEEDED, n=10), Speculation(draft, k=3))
    assert spec == plain(int8_engine, prompts, SEEDED, n=10)
    assert accepted(sched) > 0


def test_max_tokens_and_a_stop_id_inside_an_accepted_run(engine: Engine, draft: DraftModel, prompt: list[int]
                                                         ) -> None:
    for n in (2, 3, 5):
        spec, _ = run(engine, jobs_for([prompt], GREEDY, n=n), Speculation(draft, k=3))
        assert spec == plain(engine, [prompt], GREEDY, n) and len(spec[0][0]) == n
    [(tokens, _, _)] = plain(engine, [prompt], GREEDY)
    stop = frozenset({tokens[6]})
    jobs = [Job(tokens=prompt, max_new_tokens=12, stop_ids=stop) for _ in range(2)]
    alone, _ = run(engine, jobs[:1], None)
    spec, sched = run(engine, jobs[1:], Speculation(draft, k=7))
    assert spec == alone and alone[0][2] == "stop" and len(alone[0][0]) <= 6
    assert accepted(sched) > 0


def tiny_station_config(draft: Path, **settings) -> StationConfig:
    return StationConfig(**{"model": str(TINY_F32), **TINY_SHAPE, "speculative": "draft", "draft_model": str(draft),
                            **settings})


@pytest.fixture(scope="module")
def tiny_engine() -> Engine:
    """tiny-qwen2's float32 weights (its safetensors directory)."""
    config = tiny_station_config(TINY_DRAFT)
    plan = station_plan(config)
    return planned_engine(load_planned(config, plan), config, plan)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_float32_weights_and_a_smaller_draft_on_the_tiny_fixtures_beside_others(tiny_engine: Engine, sampling
                                                                                ) -> None:
    """tiny-qwen2 with its 1-layer draft (GGUF; its drafts mostly fail), with its own weights as the draft (whose
    drafts stand) and with prompt lookup: four requests, one of which does not speculate, as each alone without
    speculation."""
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    for proposer in (load_draft(tiny_station_config(TINY_DRAFT)), load_draft(tiny_station_config(TINY_F32)),
                     NgramProposer()):
        spec, sched = run(tiny_engine, jobs_for(prompts, sampling, n=24, opt_out=1), Speculation(proposer, k=3, rows=8))
        assert spec == plain(tiny_engine, prompts, sampling, n=24)
        assert drafted(sched) > 0
        if isinstance(proposer, DraftModel) and proposer.engine.cfg.num_layers == tiny_engine.cfg.num_layers:
            assert accepted(sched) > 0 and (sampling != GREEDY or accepted(sched) == drafted(sched))


def test_a_draft_whose_vocabulary_differs_is_refused_in_one_line_naming_both_files() -> None:
    default = model_source(None)
    with pytest.raises(ConfigError) as e:
        check_draft(StationConfig(speculative="draft", draft_model=str(TINY_DRAFT)))
    assert str(e.value) == (f"MOONSHINE_DRAFT_MODEL: the draft model {TINY_DRAFT} has a vocabulary of 256 tokens and "
                            f"the model {default} one of 49152; a draft model must share the model's vocabulary")
    r = run_cli("serve", "--port", "0", "--speculative", "draft", "--draft-model", str(TINY_DRAFT), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    said = [line for line in r.stderr.splitlines() if " INFO " not in line]
    assert said == [f"error: {str(e.value).replace('MOONSHINE_DRAFT_MODEL', '--draft-model')}"]
    for settings in ({"speculative": "draft"}, {"speculative": "ngram", "draft_model": str(TINY_DRAFT)}):
        with pytest.raises(ConfigError, match="MOONSHINE_SPECULATIVE=draft and MOONSHINE_DRAFT_MODEL go together"):
            StationConfig(**settings)


def test_a_draft_whose_tokens_are_spelled_otherwise_is_refused(tmp_path: Path) -> None:
    """The same vocabulary size, tokens 0 and 1 swapped: refused, naming the first token that differs."""
    tokens = gguf.GGUFReader(TINY_DRAFT).fields["tokenizer.ggml.tokens"].contents()
    path = rewrite_gguf(tmp_path / "swapped.gguf", TINY_DRAFT, values={"tokenizer.ggml.tokens": [tokens[1], tokens[0],
                                                                                               *tokens[2:]]})
    check_draft(tiny_station_config(TINY_DRAFT))  # the same tokenizer: nothing to refuse
    with pytest.raises(ConfigError) as e:
        check_draft(tiny_station_config(path))
    assert str(e.value) == (f"MOONSHINE_DRAFT_MODEL: token 0 of the draft model {path} is b'\\x01' and of the model "
                            f"{TINY_F32} b'\\x00'; a draft model must share the model's vocabulary")


def test_over_http_with_the_openai_client() -> None:
    """A station on tiny-qwen2 drafting with its 1-layer draft (the programs of the test above): a chat completion
    that speculates has the text and logprobs of one that opts out."""
    station = Station(tiny_station_config(TINY_DRAFT, continuous=True, drain_s=5))
    with ServerThread(create_app(station)) as server, server.client() as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        kw = {"model": "tiny-qwen2", "messages": [{"role": "user", "content": "abcabcabc"}], "max_tokens": 24,
              "temperature": 0, "logprobs": True, "top_logprobs": 2}
        spec = client.chat.completions.create(**kw)
        plain = client.chat.completions.create(**kw, extra_body={"speculative": False})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert spec.choices[0].logprobs == plain.choices[0].logprobs
        assert spec.usage.completion_tokens == plain.usage.completion_tokens == 24
        text = http.get("/metrics").text
        assert metric(text, "jaxstation_spec_decode_num_draft_tokens_total") > 0
        assert metric(text, "jaxstation_step_seconds_count", {"kind": "draft"}) > 0
