"""The mesh's binary codec: every dtype and shape round-trips bit for bit; truncated bodies and lying headers are
refused with the field named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxstation.group.payload import DTYPES, PayloadError, decode, encode

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5)]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_and_shape_round_trips(dtype):
    rng = np.random.default_rng(0)
    arrays = {}
    for i, shape in enumerate(SHAPES):
        raw = rng.integers(0, 256, int(np.prod(shape)) * DTYPES[dtype].itemsize, dtype=np.uint8)
        arrays[f"a{i}"] = raw.view(DTYPES[dtype]).reshape(shape)  # arbitrary bit patterns, NaNs included
    meta = {"wave": "decode", "n_blocks": 3, "nested": {"ok": [1, 2]}}
    got_meta, got = decode(encode(meta, arrays))
    assert got_meta == meta
    assert list(got) == list(arrays)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert got[name].tobytes() == a.tobytes(), name


def test_bfloat16_travels_as_two_bytes():
    x = np.arange(8, dtype=np.float32).astype(DTYPES["bfloat16"])
    body = encode({}, {"x": x})
    assert len(body) == body.index(b"\n") + 1 + 16
    assert decode(body)[1]["x"].dtype == DTYPES["bfloat16"]


def test_non_contiguous_arrays_are_sent_in_c_order():
    a = np.arange(12, dtype=np.int32).reshape(3, 4).T
    np.testing.assert_array_equal(decode(encode({}, {"a": a}))[1]["a"], a)


def test_an_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(PayloadError, match="x: dtype float64 cannot travel"):
        encode({}, {"x": np.zeros(2)})


def _body(specs, payload: bytes, meta=None) -> bytes:
    return json.dumps({"meta": meta or {}, "arrays": specs}).encode() + b"\n" + payload


def test_a_truncated_body_is_refused():
    body = encode({}, {"lanes": np.arange(4, dtype=np.int32), "x": np.zeros((4, 8), np.float32)})
    for cut in (1, 64, len(body) - body.index(b"\n") - 2):
        with pytest.raises(PayloadError) as e:
            decode(body[:-cut])
        assert e.value.field in ("x", "lanes") and "truncated" in e.value.message


@pytest.mark.parametrize(("specs", "payload", "field", "message"), [
    ([{"name": "x", "dtype": "float32", "shape": [2]}], b"\0" * 12, "body", "4 bytes follow"),
    ([{"name": "x", "dtype": "float32", "shape": [4]}], b"\0" * 8, "x", "truncated"),
    ([{"name": "x", "dtype": "float64", "shape": [1]}], b"\0" * 8, "x.dtype", "not one of"),
    ([{"name": "x", "dtype": "float32", "shape": [-1]}], b"", "x.shape", "non-negative"),
    ([{"name": "x", "dtype": "float32", "shape": "4"}], b"", "x.shape", "non-negative"),
    ([{"name": "x", "dtype": "float32", "shape": [1.5]}], b"", "x.shape", "non-negative"),
    ([{"name": "x", "dtype": "int32", "shape": [1]}, {"name": "x", "dtype": "int32", "shape": [1]}], b"\0" * 8,
     "arrays[1].name", "new non-empty"),
    ([{"name": "x", "dtype": "int32"}], b"", "arrays[0]", "exactly name, dtype and shape"),
    ([{"name": "x", "dtype": "int32", "shape": [1], "code": "import os"}], b"\0" * 4, "arrays[0]", "exactly"),
    ({"name": "x"}, b"", "arrays", "must be a list"),
])
def test_a_lying_or_malformed_header_is_refused(specs, payload, field, message):
    with pytest.raises(PayloadError) as e:
        decode(_body(specs, payload))
    assert e.value.field == field and message in e.value.message


@pytest.mark.parametrize(("body", "message"), [
    (b"no newline at all", "no header line"),
    (b"{not json}\n", "not JSON"),
    (b"[1, 2]\n", "exactly the keys"),
    (b'{"meta": {}, "arrays": [], "graph": "x"}\n', "exactly the keys"),
    (b'{"meta": [], "arrays": []}\n', "must be an object"),
    (b"\xff\xfe\n", "not JSON"),
])
def test_a_header_that_is_not_the_declared_json_is_refused(body, message):
    with pytest.raises(PayloadError, match=message):
        decode(body)
