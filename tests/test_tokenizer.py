"""Tests for jaxstation.model.tokenizer against the HF reference data in tests/reference/."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxstation.model.default_model import default_model_path
from jaxstation.model.detokenizer import IncrementalDetokenizer
from jaxstation.model.gguf_file import GGUFFile
from jaxstation.model.tokenizer import Tokenizer

REFERENCE = Path(__file__).resolve().parent / "reference"


@pytest.fixture(scope="module")
def reader() -> GGUFFile:
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def tok(reader: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(reader.fields)


def test_the_gguf_reader_reads_what_the_gguf_package_reads(reader: GGUFFile) -> None:
    theirs = gguf.GGUFReader(default_model_path())
    assert {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")} == reader.fields
    assert len(theirs.tensors) == len(reader.tensors) == 272
    for a, b in zip(theirs.tensors, reader.tensors, strict=True):
        assert (a.name, int(a.tensor_type), tuple(a.shape.tolist())) == (b.name, b.tensor_type, b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def _reference(name: str) -> Path:
    path = REFERENCE / name
    assert path.is_file(), f"reference file {path} is missing"
    return path


def _metadata(base: GGUFFile | None, **overrides) -> dict:
    """`base`'s metadata, some keys replaced (with '.' spelled as '__')."""
    fields = dict(base.fields) if base is not None else {}
    fields.update({key.replace("__", "."): value for key, value in overrides.items()})
    return fields


# ------------------------------------------------------------------------------------------------ parity with HF
def test_parity_with_hf_tokenizer_cases(tok):
    data = json.loads(_reference("tokenizer_cases.json").read_text(encoding="utf-8"))
    assert data["cases"]
    for case in data["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text
        assert tok.encode(text, add_special_tokens=False) == case["ids_add_special_tokens_false"], text
        assert [tok.backend.id_to_token(i) for i in case["ids"]] == case["tokens"], text
        assert tok.decode(case["ids"]) == case["decoded"], text
        assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"], text
        if case["roundtrip_exact"]:
            assert tok.decode(tok.encode(text)) == text


def test_special_tokens_matched_whole(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.is_special(1) and tok.is_special(2) and tok.is_special(0)
    assert not tok.is_special(tok.encode("Hello")[0])
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_chat_template_matches_hf(tok):
    ref = json.loads(_reference("smollm2_hf_reference.json").read_text(encoding="utf-8"))
    npz = np.load(_reference("smollm2_hf_reference.npz"))
    p1 = next(p for p in ref["prompts"] if p["index"] == 1)
    rendered = tok.apply_chat_template(p1["messages"], add_generation_prompt=True)
    assert rendered == p1["text"]
    # HF added no BOS (bos_added false) and neither do we: add_bos is False for this model.
    assert tok.encode(rendered, add_special_tokens=True) == npz["p1_prompt_ids"].tolist()
    assert tok.encode(rendered, add_special_tokens=False) == npz["p1_prompt_ids"].tolist()
    # The plain prompts too.
    for p in ref["prompts"]:
        assert tok.encode(p["text"]) == npz[f"p{p['index']}_prompt_ids"].tolist()


def test_chat_template_without_generation_prompt_and_errors(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    no_template = Tokenizer(tok.backend, bos_id=None, eos_ids=[2], add_bos=False, chat_template=None, byte_level=True)
    with pytest.raises(ValueError, match="chat template"):
        no_template.apply_chat_template(msgs)


def test_chat_template_jinja_features(tok):
    import jinja2

    t = Tokenizer(
        tok.backend,
        bos_id=1,
        eos_ids=[2],
        add_bos=False,
        byte_level=True,
        chat_template=(
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}"
            "{% endif %}{{ m | tojson }}{% endfor %}{{ eos_token }}{% if add_generation_prompt %}GEN{% endif %}"
        ),
    )
    out = t.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<|im_start|>{"role": "user", "content": "é"}<|im_end|>GEN'
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        t.apply_chat_template([{"role": "bad", "content": ""}])


# ------------------------------------------------------------------------------------------------ model facts
def test_default_model_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1
    assert tok.eos_ids == (2,)
    assert tok.add_bos is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.encode("Hello world") == [19556, 905]  # no BOS prepended
    assert tok.token_bytes(19556) == b"Hello"
    assert tok.token_bytes(905) == b" world"
    assert tok.token_bytes(2) == b"<|im_end|>"


def test_add_bos_from_gguf(reader):
    t = Tokenizer.from_gguf(_metadata(reader, tokenizer__ggml__add_bos_token=True))
    assert t.add_bos is True
    assert t.encode("Hello world") == [1, 19556, 905]
    assert t.encode("Hello world", add_special_tokens=False) == [19556, 905]


# ------------------------------------------------------------------------------------------------ terminal ids
def test_terminal_ids(tok):
    vocab = tok.backend.get_vocab()
    for s in (".", "!", "?"):
        assert vocab[s] in tok.terminal_ids, s
    quoted = [s for s in ('."', ".'", '?"', '!"', ").", ".)", ".\u00e2\u0122\u013f") if s in vocab]  # last: ".”"
    assert '."' in quoted and len(quoted) >= 4
    for s in quoted:
        assert vocab[s] in tok.terminal_ids, s
    ellipsis = "".join(chr(c) for c in (0xE2, 0x0122, 0xA6))  # "…" spelled byte-level
    if ellipsis in vocab:
        assert vocab[ellipsis] in tok.terminal_ids
    for s in ("Hello", ",", "\u0120the", "\u0120and", ".,", '".' + "x" if '".x' in vocab else ":"):
        assert vocab[s] not in tok.terminal_ids, s
    assert not any(tok.is_special(i) for i in tok.terminal_ids)
    assert 2 not in tok.terminal_ids and 1 not in tok.terminal_ids


def test_terminal_ids_are_the_same_when_computed_again(tok):
    assert tok._compute_terminal_ids() == tok.terminal_ids


# ------------------------------------------------------------------------------------------------ detokenizer
TEXTS = [
    "naïve café 😀 日本語 — ok",
    "emoji 👩‍👩‍👧 and flags 🇯🇵, 漢字かなカナ。",
    "Ünïcödé straße ﬁnancial ±∞ ✓",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_roundtrip(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    for piece in pieces:
        assert "\ufffd" not in piece
    tail = detok.flush()
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert detok.text == text


def test_incremental_detokenizer_split_character(tok):
    text = "naïve café 😀 日本語 — ok"
    ids = tok.encode(text)
    # tokens that are not complete UTF-8 on their own (e.g. "Ġ\xc3" + "\x9c" for "Ü", emoji bytes)
    incomplete = [pos for pos, i in enumerate(ids) if not _is_utf8(tok.token_bytes(i))]
    assert incomplete, "expected at least one token that is not complete UTF-8 on its own"
    # positions where the stream so far ends in the middle of a character
    mid_char = [pos for pos in range(len(ids)) if not _is_utf8(b"".join(tok.token_bytes(i) for i in ids[: pos + 1]))]
    assert mid_char
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    # a push that leaves the stream mid-character returns exactly the characters it completed, and a token
    # inside a character (neither starting nor finishing one) returns ""
    emitted = b""
    for pos in range(len(ids)):
        stream = b"".join(tok.token_bytes(j) for j in ids[: pos + 1])
        complete = stream
        while not _is_utf8(complete):
            complete = complete[:-1]
        assert pieces[pos] == complete[len(emitted) :].decode("utf-8"), pos
        emitted = complete
    assert any(pieces[pos] == "" for pos in mid_char)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_incremental_detokenizer_emoji_bytes(tok):
    # "😀" is four bytes; feed it as single-byte tokens: three pushes give "", the fourth the emoji.
    vocab = tok.backend.get_vocab()
    from jaxstation.model.gguf_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    byte_ids = [vocab[spell[b]] for b in "😀".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in byte_ids] == ["", "", "", "😀"]
    assert detok.flush() == ""
    # an unfinished character at the end comes out as a replacement on flush
    detok = IncrementalDetokenizer(tok)
    assert detok.push(byte_ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_special_tokens(tok):
    text = "<|im_start|>user\nHi 😀!<|im_end|>\n"
    ids = tok.encode(text)
    skip = IncrementalDetokenizer(tok)
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    skipped = "".join(skip.push(i) for i in ids) + skip.flush()
    kept = "".join(keep.push(i) for i in ids) + keep.flush()
    assert skipped == tok.decode(ids, skip_special_tokens=True) == "user\nHi 😀!\n"
    assert kept == tok.decode(ids) == text


# ------------------------------------------------------------------------------------------------ HF dir
def test_from_hf_dir(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "add_bos_token": False,
            }
        ),
        encoding="utf-8",
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}), encoding="utf-8")
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.vocab_size == tok.vocab_size
    assert hf.bos_id == 1
    assert hf.eos_ids == (2, 5)
    assert hf.add_bos is False
    data = json.loads(_reference("tokenizer_cases.json").read_text(encoding="utf-8"))
    for case in data["cases"]:
        assert hf.encode(case["text"]) == tok.encode(case["text"]) == case["ids"]
        assert hf.decode(case["ids"]) == case["decoded"]
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    assert all(hf.token_bytes(i) == tok.token_bytes(i) for i in range(0, tok.vocab_size, 97))
    assert hf.terminal_ids == tok.terminal_ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(msgs) == tok.apply_chat_template(msgs)

    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}), encoding="utf-8")
    hf2 = Tokenizer.from_hf_dir(tmp_path)
    assert hf2.apply_chat_template(msgs) == "Hi!"
    assert hf2.eos_ids == (2, 7)


def test_export_tokenizer_reads_back_token_for_token(tok, tmp_path):
    from jaxstation.cli import main

    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    back = Tokenizer.from_hf_dir(tmp_path / "tok")
    assert (back.vocab_size, back.bos_id, back.eos_ids, back.add_bos) == (tok.vocab_size, 1, tok.eos_ids, False)
    assert back.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    msgs = [{"role": "user", "content": "Hi"}]
    assert back.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


# ------------------------------------------------------------------------------------------------ GGUF variants
def test_gguf_unknown_model_raises():
    fake = _metadata(None, tokenizer__ggml__model="t5", tokenizer__ggml__tokens=["<unk>"])
    with pytest.raises(ValueError, match="'t5'.*'gpt2', 'llama'"):
        Tokenizer.from_gguf(fake)
    with pytest.raises(ValueError, match="None"):
        Tokenizer.from_gguf(_metadata(None))


def test_gguf_unknown_pre_tokenizer_raises():
    fake = _metadata(None, tokenizer__ggml__model="gpt2", tokenizer__ggml__pre="martian-bpe")
    with pytest.raises(ValueError, match="martian-bpe"):
        Tokenizer.from_gguf(fake)


def test_gguf_gpt2_pre_tokenizer(reader):
    t = Tokenizer.from_gguf(_metadata(reader, tokenizer__ggml__pre="gpt2"))
    assert t.encode("Hello world") == [19556, 905]
    assert t.decode(t.encode("naïve café 😀")) == "naïve café 😀"


def test_tiny_written_gguf(tmp_path):
    """A tiny byte-level vocabulary written with gguf.GGUFWriter and read back."""
    from jaxstation.model.gguf_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = ["<s>", "</s>"] + [spell[b] for b in range(256)] + ["ab", "Ġab", "Ġab."]
    merges = ["a b", "Ġ ab", "Ġab ."]
    types = [3, 3] + [1] * 259
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = Tokenizer.from_gguf(GGUFFile(path).fields)
    assert t.vocab_size == len(tokens)
    assert (t.bos_id, t.eos_ids, t.add_bos) == (0, (1,), True)
    ids = t.encode("ab ab.</s>")
    assert ids == [0, 258, 259, 2 + ord("."), 1]  # GPT-2's split keeps "." apart from " ab"
    assert t.decode(ids, skip_special_tokens=True) == "ab ab."
    assert t.terminal_ids == frozenset({2 + ord("."), 2 + ord("!"), 2 + ord("?"), 260})
