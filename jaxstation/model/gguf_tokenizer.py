"""A GGUF file's tokenizer, built on HF `tokenizers` from its `tokenizer.*` metadata, the way transformers' GGUF
converter and llama.cpp build it: byte-level BPE (`tokenizer.ggml.model` "gpt2") with the regex splits
`tokenizer.ggml.pre` names, or SentencePiece BPE with byte fallback ("llama") in the Llama/Mistral or the Gemma style.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE

# GGUF token types (llama.cpp's `LLAMA_TOKEN_TYPE_*`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GPT-2's split, which `ByteLevel(use_regex=True)` applies by itself.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regex splits llama.cpp applies before byte-level BPE (`llama-vocab.cpp`). `None` means
# GPT-2's split alone. The starcoder family (smollm among them) isolates every digit first, then splits as GPT-2
# does: that is `Digits(individual_digits=True)` + `ByteLevel`, as in SmolLM2's own tokenizer.json.
_DIGITS = "digits"
_GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (),
    "gpt2": (),
    "gpt-2": (),
    "phi-2": (),
    "jina-es": (),
    "jina-de": (),
    "jina-v2-es": (),
    "jina-v2-de": (),
    "smollm": (_DIGITS,),
    "starcoder": (_DIGITS,),
    "refact": (_DIGITS,),
    "command-r": (_DIGITS,),
    "codeshell": (_DIGITS,),
    "exaone": (_DIGITS,),
    "minerva-7b": (_DIGITS,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "megrez": (_QWEN2_SPLIT,),
}


END_OF_TURN = frozenset({"<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>"})


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def is_byte_level_spelling(token: str) -> bool:
    table = unicode_to_bytes()
    return all(ch in table for ch in token)


def _field(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key)
    return default if value is None else value


def gguf_backend(meta: Mapping[str, Any]) -> tuple[RustTokenizer, dict[str, Any]]:
    """The tokenizer a GGUF file's `tokenizer.*` metadata describes (`GGUFFile.fields`: key -> plain value), and the
    rest of `Tokenizer`'s arguments: its special ids, whether it adds BOS, its chat template, its spelling."""
    model = check_gguf_tokenizer(meta)
    tokens: list[str] = list(_field(meta, "tokenizer.ggml.tokens", []))
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    token_type = list(_field(meta, "tokenizer.ggml.token_type", []))
    byte_level = model == "gpt2"
    tok = _byte_level_bpe(meta, tokens) if byte_level else _sentencepiece_bpe(meta, tokens)
    vocab = tok.get_vocab()
    spelled = is_byte_level_spelling if byte_level else (lambda t: True)
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_type, strict=False) if kind == _TOKEN_TYPE_CONTROL and spelled(t)]
    # User-defined tokens are matched whole in text too (llama.cpp), but are ordinary text when decoding.
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_type, strict=False)
            if kind == _TOKEN_TYPE_USER_DEFINED and spelled(t) and vocab.get(t) is not None]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    bos_id = _field(meta, "tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(v)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (v := _field(meta, key)) is not None
    ]
    # a control token that ends a turn ends generation too, as llama.cpp finds them (Gemma's files name none)
    eos_ids += [i for i, (t, kind) in enumerate(zip(tokens, token_type, strict=False))
                if kind == _TOKEN_TYPE_CONTROL and t in END_OF_TURN and i not in eos_ids]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = bool(_field(meta, "tokenizer.ggml.add_bos_token", not byte_level)) and bos_id is not None
    add_eos = bool(_field(meta, "tokenizer.ggml.add_eos_token", False)) and bool(eos_ids)
    pad_id = _field(meta, "tokenizer.ggml.padding_token_id")
    unk_id = _field(meta, "tokenizer.ggml.unknown_token_id")
    if add_bos or add_eos:
        tok.post_processor = _framing((tokens[int(bos_id)], int(bos_id)) if add_bos else None,
                                      (tokens[eos_ids[0]], eos_ids[0]) if add_eos else None)
    elif byte_level:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, {"bos_id": None if bos_id is None else int(bos_id), "eos_ids": eos_ids, "add_bos": add_bos,
                 "chat_template": _field(meta, "tokenizer.chat_template"), "byte_level": byte_level,
                 "pad_id": None if pad_id is None else int(pad_id), "unk_id": None if unk_id is None else int(unk_id)}


GGUF_TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece BPE with byte fallback
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def check_gguf_tokenizer(meta: Mapping[str, Any]) -> str:
    """The GGUF tokenizer model the metadata names (`tokenizer.ggml.model`), if it is one the station builds (and for
    byte-level BPE, a pre-tokenizer it knows)."""
    model = _field(meta, "tokenizer.ggml.model")
    if model not in GGUF_TOKENIZER_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model): served are "
                         f"{', '.join(repr(m) for m in GGUF_TOKENIZER_MODELS)}")
    if model == "gpt2" and (pre := _field(meta, "tokenizer.ggml.pre", "default")) not in _GGUF_PRE_SPLITS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
    return model


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str]) -> RustTokenizer:
    """GPT-2 style BPE over bytes spelled as printable characters, split first as `tokenizer.ggml.pre` names."""
    pre = _field(meta, "tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in _field(meta, "tokenizer.ggml.merges", [])]
    spelling = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        key = t if is_byte_level_spelling(t) else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    tok = RustTokenizer(BPE(vocab, merges, fuse_unk=False))
    steps: list[Any] = []
    for split in _GGUF_PRE_SPLITS[pre]:
        if split == _DIGITS:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    use_regex = not any(s not in (_DIGITS,) for s in _GGUF_PRE_SPLITS[pre])
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str]) -> RustTokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model` "llama"): spaces are `▁`, a character outside the vocabulary is its
    UTF-8 bytes as `<0xNN>` tokens, and pieces merge in the order of their scores. The file lists no merges, so they
    are the vocabulary's own: every split of a piece into two pieces, ranked by the piece's score. Llama and Mistral
    prefix the text with a space (`tokenizer.ggml.add_space_prefix`, true unless stated). Gemma (its architectures)
    prefixes nothing, spells runs of spaces as spaces in the file, and ranks its pieces by their place in the
    vocabulary, not by the scores it stores."""
    gemma = _field(meta, "general.architecture") in _GEMMA_ARCHITECTURES
    if gemma:  # runs of spaces as `▁`s, as the text will spell them
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = list(_field(meta, "tokenizer.ggml.scores", []))
        if len(scores) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        rank = dict(zip(tokens, scores, strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = _field(meta, "tokenizer.ggml.unknown_token_id")
    tok = RustTokenizer(BPE(vocab, _merges_by_rank(vocab, rank), fuse_unk=True, byte_fallback=True,
                            unk_token=None if unk_id is None else tokens[int(unk_id)]))
    prefix = bool(_field(meta, "tokenizer.ggml.add_space_prefix", not gemma))
    if prefix:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok



def _framing(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """BOS before and/or EOS after each sequence ((token, id) pairs, None where the file adds none)."""
    def sequence(part: str, type_id: int) -> list[str]:
        return ([f"{bos[0]}:{type_id}"] if bos else []) + [f"${part}:{type_id}"] + (
            [f"{eos[0]}:{type_id}"] if eos else [])

    return processors.TemplateProcessing(single=sequence("A", 0), pair=sequence("A", 0) + sequence("B", 1),
                                         special_tokens=[end for end in (bos, eos) if end])

def _merges_by_rank(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each piece's splits into two pieces, the best-ranked piece's
    first; a piece's splits with the longer left part first (no two of one piece's splits tie), and pieces of equal
    rank in the vocabulary's order."""
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        found.extend((piece[:i], piece[i:], score) for i in range(1, len(piece))
                     if piece[:i] in vocab and piece[i:] in vocab)
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # stable: equal keys keep the order above
    return [(left, right) for left, right, _ in found]
