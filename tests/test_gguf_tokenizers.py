"""GGUF `llama` tokenizers (SentencePiece BPE with byte fallback), Llama/Mistral style and Gemma style.

Token ids equal those transformers' tokenizer builds from the same file, on texts with leading and doubled spaces,
newlines, digits, accents, CJK, emoji, byte-fallback characters and control tokens: for two tiny vocabularies trained
with sentencepiece (`tests/fixtures/tokenizers`) and for Gemma 3 270M's own (262144 tokens). The reference ids were
made by `python scripts/make_fixtures.py sp-tokenizers` and `... gemma3-reference` (tests/reference/*.json say with
which versions).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, REFERENCE

from jaxstation.model.detokenizer import IncrementalDetokenizer
from jaxstation.model.gguf_file import GGUFFile
from jaxstation.model.loader import load_tokenizer
from jaxstation.model.tokenizer import Tokenizer

STYLES = ("llama-style", "gemma-style")
SP_REFERENCE = json.loads((REFERENCE / "sentencepiece_tokenizers.json").read_text(encoding="utf-8"))
GEMMA_REFERENCE = json.loads((REFERENCE / "gemma3_270m_reference.json").read_text(encoding="utf-8"))


def assert_reference_ids(tok: Tokenizer, cases: list[dict]) -> None:
    for case in cases:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids_plain"], case["text"]


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma3_270m: Path) -> Tokenizer:
    return load_tokenizer(gemma3_270m)


@pytest.mark.parametrize("style", STYLES)
def test_tiny_vocabularies_give_transformers_ids(style: str) -> None:
    tok = load_tokenizer(FIXTURES / "tokenizers" / f"{style}.gguf")
    assert not tok.byte_level and tok.add_bos
    assert_reference_ids(tok, SP_REFERENCE["styles"][style])


def test_gemma3_gives_transformers_ids(gemma_tokenizer: Tokenizer) -> None:
    # <eos> (the file's eos_token_id), then <end_of_turn>, a control token that ends a turn (as llama.cpp finds it)
    assert gemma_tokenizer.vocab_size == 262144 and (gemma_tokenizer.bos_id, gemma_tokenizer.eos_ids) == (2, (1, 106))
    assert gemma_tokenizer.decode([106]) == "<end_of_turn>"
    assert_reference_ids(gemma_tokenizer, GEMMA_REFERENCE["tokenizer_cases"])


def test_gemma3_streams_back_every_byte(gemma_tokenizer: Tokenizer) -> None:
    """Token by token, byte-fallback pieces and runs of spaces included, the text comes back whole."""
    for case in GEMMA_REFERENCE["tokenizer_cases"]:
        if "<" in case["text"]:  # control tokens are skipped when streaming
            continue
        stream = IncrementalDetokenizer(gemma_tokenizer)
        text = "".join(stream.push(i) for i in case["ids_plain"]) + stream.flush()
        assert text == case["text"] == gemma_tokenizer.decode(case["ids_plain"])


def test_llama_style_prefixes_a_space_and_gemma_style_does_not() -> None:
    llama, gemma = (load_tokenizer(FIXTURES / "tokenizers" / f"{s}.gguf") for s in STYLES)
    ids = llama.encode("Hello world", add_special_tokens=False)
    assert b"".join(llama.token_bytes(i) for i in ids) == b" Hello world" and llama.decode(ids) == "Hello world"
    ids = gemma.encode("Hello world", add_special_tokens=False)
    assert b"".join(gemma.token_bytes(i) for i in ids) == b"Hello world" == gemma.decode(ids).encode()


def test_add_eos_and_no_bos_from_the_file() -> None:
    fields = GGUFFile(FIXTURES / "tokenizers" / "llama-style.gguf").fields
    tok = Tokenizer.from_gguf({**fields, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == [*plain, 2] and not tok.add_bos


def test_scores_must_cover_the_vocabulary() -> None:
    fields = GGUFFile(FIXTURES / "tokenizers" / "llama-style.gguf").fields
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores has 3 entries for 420 tokens"):
        Tokenizer.from_gguf({**fields, "tokenizer.ggml.scores": [0.0, 0.0, 0.0]})


@pytest.mark.parametrize("style", STYLES)
def test_exported_as_an_hf_directory_it_tokenizes_the_same(tmp_path: Path, style: str) -> None:
    tok = load_tokenizer(FIXTURES / "tokenizers" / f"{style}.gguf")
    tok.save_hf_dir(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    assert (back.bos_id, back.eos_ids, back.add_bos, back.byte_level) == (tok.bos_id, tok.eos_ids, True, False)
    for case in SP_REFERENCE["styles"][style]:
        assert back.encode(case["text"]) == case["ids"], case["text"]
        assert back.decode(case["ids"]) == tok.decode(case["ids"])
