"""Binary payloads, of the mesh (mesh/) and of a group's step calls (group/process_group.py): one JSON header line that
declares every array, then the arrays' raw bytes.

    {"meta": {...}, "arrays": [{"name": "x", "dtype": "bfloat16", "shape": [8, 1, 576]}, ...]}\\n<raw bytes>

Arrays are C-ordered and little-endian, concatenated in the order the header lists them; bf16 travels as bf16, never
upcast. The header carries data only (names, dtypes, shapes, plain JSON values), never code or graphs. Decoding
checks that the body holds exactly the bytes the header declares and raises `PayloadError` naming the field otherwise;
what the values must be (lanes, positions, the residual's shape and dtype) is the receiver's check.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

CONTENT_TYPE = "application/octet-stream"
MAX_HEADER_BYTES = 64 * 1024
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}

if sys.byteorder != "little":  # the wire is little-endian and arrays are sent as their memory
    raise ImportError("jaxstation.group.payload needs a little-endian host")


class PayloadError(ValueError):
    """A payload that does not decode; `field` names what is wrong (a header key or an array)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def encode(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """Header line plus raw bytes. Every array's dtype must be one of DTYPES."""
    specs, blobs = [], []
    for name, a in arrays.items():
        a = np.asarray(a, order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype not in _NAMES:
            raise PayloadError(name, f"dtype {a.dtype} cannot travel; use one of {', '.join(DTYPES)}")
        specs.append({"name": name, "dtype": _NAMES[a.dtype], "shape": list(a.shape)})
        blobs.append(a.tobytes())
    head = json.dumps({"meta": dict(meta), "arrays": specs}, separators=(",", ":")).encode()
    return b"".join([head, b"\n", *blobs])


def _shape(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise PayloadError(f"{name}.shape", f"must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def decode(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) from a payload, or PayloadError naming the field. Arrays are read-only views of `body`."""
    end = body.find(b"\n", 0, MAX_HEADER_BYTES + 1)
    if end < 0:
        raise PayloadError("header", f"no header line within the first {MAX_HEADER_BYTES} bytes")
    try:
        head = json.loads(body[:end])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError("header", f"not JSON: {e}") from None
    if not isinstance(head, dict) or set(head) != {"meta", "arrays"}:
        raise PayloadError("header", "must be an object with exactly the keys 'meta' and 'arrays'")
    meta, specs = head["meta"], head["arrays"]
    if not isinstance(meta, dict):
        raise PayloadError("meta", "must be an object")
    if not isinstance(specs, list):
        raise PayloadError("arrays", "must be a list")
    arrays: dict[str, np.ndarray] = {}
    offset = end + 1
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
            raise PayloadError(f"arrays[{i}]", "must be an object with exactly name, dtype and shape")
        name = spec["name"]
        if not isinstance(name, str) or not name or name in arrays:
            raise PayloadError(f"arrays[{i}].name", f"must be a new non-empty string, got {name!r}")
        if spec["dtype"] not in DTYPES:
            raise PayloadError(f"{name}.dtype", f"{spec['dtype']!r} is not one of {', '.join(DTYPES)}")
        dtype, shape = DTYPES[spec["dtype"]], _shape(name, spec["shape"])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + size > len(body):
            raise PayloadError(name, f"truncated: the header declares {size} bytes from offset {offset}, "
                                     f"the body has {len(body) - offset}")
        arrays[name] = np.frombuffer(body, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape)
        offset += size
    if offset != len(body):
        raise PayloadError("body", f"{len(body) - offset} bytes follow the arrays the header declares")
    return meta, arrays
