"""Tokenization for the station: a thin layer over HF `tokenizers` (Rust).

A `Tokenizer` is built either from a Hugging Face model directory (`tokenizer.json` and friends) or from the
metadata of a GGUF file (`gguf_tokenizer`: byte-level BPE, or SentencePiece BPE with byte fallback), the way
transformers' GGUF converter and llama.cpp build it. It also renders chat templates as transformers does, knows the raw
bytes of every token, and precomputes which tokens end a sentence (`terminal_ids`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from jaxstation.model.chat_template import compile_template
from jaxstation.model.gguf_tokenizer import gguf_backend, unicode_to_bytes

# Closing quotes and brackets that may follow a sentence's final punctuation, and that punctuation itself.
_CLOSERS = "\"'”’“‘)]}»›」』】〕〉》）］｝"
_TERMINALS = (".", "!", "?", "…", "。", "！", "？")


def _byte_level_bytes(token: str) -> bytes:
    table = unicode_to_bytes()
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


def _token_content(token: Any) -> str | None:
    """A special token as tokenizer_config.json states it: a string, or a dict with `content`."""
    if token is None:
        return None
    if isinstance(token, dict):
        return token.get("content")
    return str(token)


class _Spellings:
    """Every token's raw bytes, packed into one buffer with an offset per token: for Gemma's 262,144 tokens, 24 MiB less
    than a list of `bytes` objects beside the list of the tokens' strings."""

    def __init__(self, tokenizer: RustTokenizer, vocab_size: int, added: Mapping[int, str], byte_level: bool) -> None:
        texts = [""] * vocab_size
        for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if 0 <= i < vocab_size:
                texts[i] = text
        raw = _byte_level_bytes if byte_level else _sentencepiece_bytes
        spelled = [added[i].encode("utf-8") if i in added else raw(text) for i, text in enumerate(texts)]
        self._ends = np.cumsum([len(b) for b in spelled], dtype=np.int64)  # [vocab]
        self._data = b"".join(spelled)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._ends):
            raise IndexError(f"token id {token_id} is outside the vocabulary ({len(self._ends)})")
        start = int(self._ends[token_id - 1]) if token_id else 0
        return self._data[start:int(self._ends[token_id])]

    def containing(self, needles: Sequence[bytes]) -> list[int]:
        """The ids of the tokens whose bytes contain any of `needles`, ascending (one search of the buffer)."""
        found = re.finditer(b"|".join(re.escape(n) for n in needles), self._data)
        starts = np.fromiter((m.start() for m in found), np.int64)
        ids = np.unique(np.searchsorted(self._ends, starts, side="right"))
        return [int(i) for i in ids if any(n in self[int(i)] for n in needles)]  # not a match across two tokens


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

        self._spellings = _Spellings(tokenizer, self.vocab_size, self._added_content, byte_level)
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
        tok, arguments = gguf_backend(meta)
        return cls(tok, **arguments)

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
        return self._spellings[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with another chat template."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the chat template the way transformers does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; start the station with --chat-template to give it one")
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
        return self._spellings[token_id].decode("utf-8", errors="replace")

    def _compute_terminal_ids(self) -> frozenset[int]:
        out = []
        for i in self._spellings.containing([t.encode("utf-8") for t in _TERMINALS]):  # the only candidates
            text = self._spellings[i].decode("utf-8", errors="ignore").rstrip().rstrip(_CLOSERS).rstrip()
            if i not in self._special_ids and text.endswith(_TERMINALS):
                out.append(i)
        return frozenset(out)


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
