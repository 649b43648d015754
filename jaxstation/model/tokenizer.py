"""Tokenization for the station: a thin layer over HF `tokenizers` (Rust).

A `Tokenizer` is built either from a Hugging Face model directory (`tokenizer.json` and friends) or from the
metadata of a GGUF file (byte-level BPE, `tokenizer.ggml.model == "gpt2"`, or SentencePiece BPE with byte fallback,
"llama"), the way transformers' GGUF converter and llama.cpp build it. It also renders chat templates as transformers
does, knows the raw bytes of every token, and precomputes which tokens end a sentence (`terminal_ids`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE

from jaxstation.model.chat_template import compile_template

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

# Closing quotes and brackets that may follow a sentence's final punctuation, and that punctuation itself.
_CLOSERS = "\"'”’“‘)]}»›」』】〕〉》）］｝"
_TERMINALS = (".", "!", "?", "…", "。", "！", "？")


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
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
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level_spelling(token: str) -> bool:
    table = _unicode_to_bytes()
    return all(ch in table for ch in token)


def _byte_level_bytes(token: str) -> bytes:
    table = _unicode_to_bytes()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:  # stored raw (llama.cpp writes undecodable or user-defined tokens as text)
        return token.encode("utf-8")


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(token: str) -> bytes:
    m = _SP_BYTE.fullmatch(token)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _field(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key)
    return default if value is None else value


def _token_content(token: Any) -> str | None:
    """A special token as tokenizer_config.json states it: a string, or a dict with `content`."""
    if token is None:
        return None
    if isinstance(token, dict):
        return token.get("content")
    return str(token)


class Tokenizer:
    """Encode/decode, chat templates, token bytes and sentence-terminal tokens for one vocabulary."""

    def __init__(
        self,
        tokenizer: RustTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        byte_level: bool,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.byte_level = byte_level

        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_content = {i: t.content for i, t in added.items()}

        id_to_str = [""] * self.vocab_size
        for s, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                id_to_str[i] = s
        self._token_strs = id_to_str
        raw = _byte_level_bytes if byte_level else _sentencepiece_bytes
        self._token_bytes: list[bytes] = [
            self._added_content[i].encode("utf-8") if i in self._added_content else raw(s)
            for i, s in enumerate(id_to_str)
        ]
        self.bos_token = bos_token if bos_token is not None else self._content(bos_id)
        self.eos_token = (
            eos_token if eos_token is not None else self._content(self.eos_ids[0] if self.eos_ids else None)
        )
        self.pad_id, self.unk_id = pad_id, unk_id
        self.pad_token, self.unk_token = self._content(pad_id), self._content(unk_id)
        self.terminal_ids: frozenset[int] = self._compute_terminal_ids()

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, and if present `chat_template.jinja` and
        `generation_config.json` from a Hugging Face model directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"missing file {path / 'tokenizer.json'}: an HF model directory needs its tokenizer")
        tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_path = path / "chat_template.jinja"
        if jinja_path.is_file():
            chat_template = jinja_path.read_text(encoding="utf-8")

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        bos_id = tok.token_to_id(bos_token) if bos_token is not None else None
        pad_token, unk_token = _token_content(config.get("pad_token")), _token_content(config.get("unk_token"))
        eos_ids: list[int] = []
        if eos_token is not None and tok.token_to_id(eos_token) is not None:
            eos_ids.append(tok.token_to_id(eos_token))

        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
            gen_eos = gen.get("eos_token_id")
            if isinstance(gen_eos, int):
                eos_ids.append(gen_eos)
            elif isinstance(gen_eos, list):
                eos_ids.extend(int(i) for i in gen_eos)
            if bos_id is None and isinstance(gen.get("bos_token_id"), int):
                bos_id = gen["bos_token_id"]

        add_bos = config.get("add_bos_token")
        if add_bos is None:  # whatever the tokenizer.json post-processor does
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(with_special) and with_special[0] == bos_id
        byte_level = _is_byte_level_json(json.loads((path / "tokenizer.json").read_text(encoding="utf-8")))
        return cls(
            tok,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=chat_template,
            byte_level=byte_level,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_id=tok.token_to_id(pad_token) if pad_token is not None else None,
            unk_id=tok.token_to_id(unk_token) if unk_token is not None else None,
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file's `tokenizer.*` metadata describes (`GGUFFile.fields`: key -> plain value):
        byte-level BPE (`tokenizer.ggml.model` "gpt2") or SentencePiece BPE ("llama")."""
        model = check_gguf_tokenizer(meta)
        tokens: list[str] = list(_field(meta, "tokenizer.ggml.tokens", []))
        if not tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens")
        token_type = list(_field(meta, "tokenizer.ggml.token_type", []))
        byte_level = model == "gpt2"
        tok = _byte_level_bpe(meta, tokens) if byte_level else _sentencepiece_bpe(meta, tokens)
        vocab = tok.get_vocab()
        spelled = _is_byte_level_spelling if byte_level else (lambda t: True)
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
        return cls(
            tok,
            bos_id=None if bos_id is None else int(bos_id),
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_field(meta, "tokenizer.chat_template"),
            byte_level=byte_level,
            pad_id=None if pad_id is None else int(pad_id),
            unk_id=None if unk_id is None else int(unk_id),
        )

    def save_hf_dir(self, path: str | Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` into `path`, as a Hugging Face
        model directory holds them: what `from_hf_dir` and transformers' `AutoTokenizer` read back, token for token.
        Benchmark clients (aiperf, guidellm) count tokens with such a directory."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
        }
        for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                            ("pad_token", self.pad_token), ("unk_token", self.unk_token),
                            ("chat_template", self.chat_template)):
            if value is not None:
                config[name] = value
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
        generation = {"eos_token_id": list(self.eos_ids)}
        if self.bos_id is not None:
            generation["bos_token_id"] = self.bos_id
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------------------------------------------- api
    @property
    def backend(self) -> RustTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (a special token: its text, UTF-8 encoded)."""
        return self._token_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the chat template the way transformers does."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; cannot apply one")
        context: dict[str, Any] = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context.update(kwargs)
        return compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    # ---------------------------------------------------------------------------------------------------- helpers
    def _content(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < self.vocab_size:
            return None
        if token_id in self._added_content:
            return self._added_content[token_id]
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def _compute_terminal_ids(self) -> frozenset[int]:
        closers = _CLOSERS
        special = self._special_ids
        out = []
        for i, raw in enumerate(self._token_bytes):
            if i in special:
                continue
            text = raw.decode("utf-8", errors="ignore").rstrip().rstrip(closers).rstrip()
            if text.endswith(_TERMINALS):
                out.append(i)
        return frozenset(out)


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
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        key = t if _is_byte_level_spelling(t) else "".join(spelling[b] for b in t.encode("utf-8"))
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
    first; a piece's splits with the longer left part first, then by their parts' ids."""
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        if len(splits) > 1:
            splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, score) for left, right in splits)
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # stable: equal keys keep the order above
    return [(left, right) for left, right, _ in found]


def _is_byte_level_json(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer.json spells its vocabulary GPT-2 byte-level style (a ByteLevel decoder somewhere)."""

    def has_byte_level(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(has_byte_level(v) for v in node.values())
        if isinstance(node, list):
            return any(has_byte_level(v) for v in node)
        return False

    return has_byte_level(spec.get("decoder")) or has_byte_level(spec.get("pre_tokenizer"))
