"""A GGUF file's metadata and tensor table, read straight from a memory map.

The gguf package's reader builds a numpy view for every part of every metadata field, which for a vocabulary of 49152
tokens and as many merges takes seconds; this reader takes a fraction of a second for the same file and hands out the
same things: metadata as plain Python values (arrays become lists) and each tensor's bytes as a numpy view in the
layout `gguf.dequantize` takes. It reads GGUF versions 2 and 3, little-endian, and raises GGUFError, saying what is
wrong and where, for a file that is not GGUF, is truncated, or lists a tensor twice, of an unknown type or past its
end.

A split model (llama.cpp's `gguf-split`: `NAME-00001-of-00003.gguf` and its siblings, each holding some of the
tensors, the first also the metadata) is read whole from its first part: the other parts are found beside it by name.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

from jaxstation.model.source import SPLIT_NAME

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type id -> the little-endian format of a scalar of that type, for struct and numpy alike (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# element types whose tensor data is a typed array; every other type is blocks of bytes
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    data: np.ndarray  # typed [*reversed(shape)], or uint8 [*reversed(shape[1:]), bytes per row] for block types


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0
        self.raw = memoryview(buf)

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"truncated at byte {self.pos} (needs {n} more bytes, the file has {len(self.buf)})")
        out = self.raw[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise GGUFError(f"unknown metadata value type {kind} at byte {self.pos}")
        return self.scalar(_SCALARS[kind])


def split_parts(path: Path) -> list[Path]:
    """The files of the model whose first part is `path`: all its parts in order, or [path] for a file not split."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """`fields`: the metadata, key -> value; `tensors`: the tensor table in file order (of every part, for a split
    model)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.fields, self.tensors = _read(path)
        count = int(self.fields.get("split.count", 1))
        if count <= 1:
            return
        if int(self.fields.get("split.no", 0)) != 0:
            raise GGUFError(f"part {int(self.fields['split.no']) + 1} of a model split in {count}: pass its first part")
        parts = split_parts(path)
        if len(parts) != count:
            raise GGUFError(f"split in {count} parts, but its name does not end in -00001-of-{count:05d}.gguf")
        seen = {t.name for t in self.tensors}
        for part in parts[1:]:
            if not part.is_file():
                raise GGUFError(f"part {part.name} of the split model is missing")
            for t in _read(part)[1]:
                if t.name in seen:
                    raise GGUFError(f"tensor {t.name!r} is listed twice (in {part.name} too)")
                seen.add(t.name)
                self.tensors.append(t)
        if len(self.tensors) != int(self.fields.get("split.tensors.count", len(self.tensors))):
            raise GGUFError(f"its parts hold {len(self.tensors)} tensors, not the {self.fields['split.tensors.count']} "
                            "that split.tensors.count says")


def _read(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """One file's metadata and tensor table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if bytes(cur.take(4)) != MAGIC:
        raise GGUFError("not a GGUF file (its first bytes are not 'GGUF')")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} (this reader takes 2 and 3, little-endian)")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        table.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, kind, offset in table:
        if name in seen:
            raise GGUFError(f"tensor {name!r} is listed twice")
        seen.add(name)
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown type {kind}") from None
        shape = tuple(reversed(dims))
        if dims and dims[0] % block:
            raise GGUFError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block}")
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        begin = start + offset
        if begin + n_bytes > len(buf):
            raise GGUFError(f"tensor {name!r} ends at byte {begin + n_bytes}, past the file's {len(buf)}")
        raw = buf[begin:begin + n_bytes]
        if kind in _TYPED:
            data = raw.view(_TYPED[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], dims[0] // block * type_size)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return fields, tensors
