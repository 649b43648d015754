"""The reasoning parser (jaxstation/openai/reasoning.py) on scripted text streams, piece by piece as tokens arrive,
and the chat template's `enable_thinking` reaching a Qwen3-style template."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxstation.chat.reasoning import ReasoningStream, after_thinking, pick_parser
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.constraints import ConstraintSpec, mask_words
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai.parse import parse_chat

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen3"
# Qwen3's chat template, its generation prompt as released: thinking off writes an empty thinking block
QWEN3_TAIL = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}")
# DeepSeek-R1 distills' generation prompt opens the thinking for the model
R1_TAIL = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
MESSAGES = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def split(parser: str, pieces: list[str], prompt_opens: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    """(thinking, answer, what each piece showed) of pieces fed as a choice's text arrives."""
    stream = ReasoningStream(parser, prompt_opens)
    shown = [stream.push(piece) for piece in pieces] + [stream.finish()]
    return "".join(t for t, _ in shown), "".join(a for _, a in shown), shown


@pytest.mark.parametrize("parser, pieces, opens, thinking, answer", [
    ("qwen3", ["<th", "ink>Let me", " think</th", "ink>\n\nHello"], False, "Let me think", "Hello"),
    ("qwen3", ["\n<think>", "abc", "def"], False, "abcdef", ""),  # no closing tag: all thinking
    ("qwen3", ["Hello", " world"], False, "", "Hello world"),  # thinking off: no tags, all answer
    ("qwen3", ["<", "b>bold"], False, "", "<b>bold"),  # a tag's prefix that turns out not to be one
    ("qwen3", ["abc</", "think>", "x"], True, "abc", "x"),  # the prompt opened the thinking
    ("deepseek_r1", ["abc</think>", "\nx"], False, "abc", "x"),  # R1 starts in the thinking
    ("deepseek_r1", ["<think>", "\nabc</think>ok"], False, "\nabc", "ok"),  # an opening tag written anyway
    ("deepseek_r1", ["all", " thought"], False, "all thought", ""),
])
def test_the_split(parser, pieces, opens, thinking, answer) -> None:
    got_thinking, got_answer, _ = split(parser, pieces, opens)
    assert (got_thinking, got_answer) == (thinking, answer)
    whole = split(parser, ["".join(pieces)], opens)  # at once or char by char: the same split
    chars = split(parser, list("".join(pieces)), opens)
    assert whole[:2] == chars[:2] == (thinking, answer)


def test_a_split_tag_is_held_until_the_next_piece_decides() -> None:
    _, _, shown = split("qwen3", ["<think>abc</th", "ink>Hi"])
    assert shown == [("abc", ""), ("", "Hi"), ("", "")]


def test_auto_picks_from_the_template() -> None:
    assert pick_parser("auto", MESSAGES + QWEN3_TAIL) == "qwen3"
    assert pick_parser("auto", MESSAGES) is None and pick_parser("auto", None) is None
    assert pick_parser("none", MESSAGES + QWEN3_TAIL) is None
    assert pick_parser("deepseek_r1", MESSAGES) == "deepseek_r1"


def tokenizer(tmp_path: Path, template: str) -> Tokenizer:
    shutil.copytree(FIXTURE, tmp_path / "model", ignore=shutil.ignore_patterns("*.gguf", "*.safetensors", "*.npz"))
    (tmp_path / "model" / "chat_template.jinja").write_text(template)
    return Tokenizer.from_hf_dir(tmp_path / "model")


@pytest.mark.parametrize("thinking, ends", [(None, "<|im_start|>assistant\n"), (True, "<|im_start|>assistant\n"),
                                            (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n")])
def test_enable_thinking_reaches_a_qwen3_template(tmp_path, thinking, ends) -> None:
    tok = tokenizer(tmp_path, MESSAGES + QWEN3_TAIL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    req = parse_chat(body, tok, tok.vocab_size, 256, frozenset(tok.eos_ids), False, reasoning="qwen3")
    assert tok.decode(req.prompts[0]).endswith(ends)
    assert (req.reasoning, req.prompt_opens) == ("qwen3", False)


def test_a_template_that_opens_the_thinking(tmp_path) -> None:
    tok = tokenizer(tmp_path, MESSAGES + R1_TAIL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = parse_chat(body, tok, tok.vocab_size, 256, frozenset(tok.eos_ids), False, reasoning="qwen3")
    assert req.prompt_opens
    assert parse_chat(body, tok, tok.vocab_size, 256, frozenset(tok.eos_ids), False).reasoning is None


@pytest.mark.parametrize("setting, message", [
    ({"reasoning_parser": "qwen"}, "MOONSHINE_REASONING_PARSER='qwen' must be one of auto, qwen3, deepseek_r1, none"),
    ({"responses_store_size": 0}, "MOONSHINE_RESPONSES_STORE_SIZE=0 must be >= 1"),
    ({"responses_store_age_s": 0.0}, "MOONSHINE_RESPONSES_STORE_AGE_S=0.0 must be > 0"),
])
def test_the_settings_refuse_what_cannot_work(setting, message) -> None:
    with pytest.raises(ConfigError) as e:
        StationConfig(**setting)
    assert str(e.value) == message


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def held(grammars, tok: Tokenizer, spec: ConstraintSpec, text: str) -> str:
    """How `text`, tokenized, fares under the compiled `spec`: 'finished', 'open' (allowed, not complete) or the token
    it refuses."""
    constraint = grammars.compile(spec)
    for t in tok.encode(text, add_special_tokens=False):
        row = np.zeros(mask_words(grammars.vocab), np.int32)
        constraint.fill(row)
        if not (row[t // 32] >> (t % 32)) & 1:
            return tok.decode([t])
        constraint.advance(t)
    return "finished" if constraint.finished else "open"


@pytest.mark.parametrize("parser, opens, text, fate", [
    ("qwen3", False, '<think>I think </thi> a lot</think>\n{"a": 1}', "finished"),  # free thinking, then the schema
    ("qwen3", False, '{"a": 1}', "finished"),  # thinking off: the schema from the start
    ("qwen3", False, "<think>x</think>hello", "hello"),  # after the thinking, the schema holds
    ("qwen3", False, '{"a":' + " " * 20 + "1}", " " * 20),  # JSON whitespace stays bounded
    ("qwen3", True, 'x</think>{"a": 1}', "finished"),  # the prompt opened the thinking
    ("deepseek_r1", False, '{"a": 1}', "open"),  # R1 starts in the thinking: that JSON was thought
])
def test_a_json_constraint_holds_the_answer_after_the_thinking(grammars, default_model, parser, opens, text,
                                                               fate) -> None:
    spec = after_thinking(ConstraintSpec("json", SCHEMA, "response_format"), parser, opens)
    assert spec.field == "response_format" and held(grammars, default_model.tokenizer, spec, text) == fate


def test_other_constraints_hold_the_whole_output() -> None:
    regex = ConstraintSpec("regex", "[a-z]+", "structured_outputs.regex")
    assert after_thinking(regex, "qwen3", False) is regex
