"""V2 tensors in process (issue 49): the kernels of the array path against their plain
references (``criteo.hash_feature``, numpy's normalisation), and the binary body's
framing (``v2.split_body``) on its edge cases."""
import json
import struct

import numpy as np
import pytest

from mpips.data import criteo
from mpips.kernels import tsv_parse as K
from mpips.serving import v2
from mpips.serving.instances import BadInput


def blob(values):
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


@pytest.mark.parametrize("bucket", [0, 1000001])
def test_bytes_columns_ids_equal_hash_feature(bucket):
    rng = np.random.default_rng(4)
    n, S = 17, 5
    cols = [[bytes(rng.integers(32, 127, rng.integers(0, 12)).astype(np.uint8)) for _ in range(n)]
            for _ in range(S)]
    parts = [blob(c) for c in cols]
    parts[2] = b""                                          # column 2: not given
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    starts[2] = -1
    ends = starts + np.array([len(p) for p in parts])
    data = np.frombuffer(b"".join(parts), np.uint8)
    ids = np.empty((n, S), np.int64)
    filled = np.zeros(n, np.uint8)
    assert K.bytes_columns_ids(data, starts, ends, n, bucket, ids, filled) == (K.BYTES_OK, -1, n)
    for s in range(S):
        for k in range(n):
            raw = b"" if s == 2 else cols[s][k]
            assert ids[k, s] == criteo.hash_feature(s, raw, bucket)
    want = np.array([any(len(cols[s][k]) for s in range(S) if s != 2) for k in range(n)])
    assert np.array_equal(filled.astype(bool), want)


@pytest.mark.parametrize("raw,status,where", [
    (blob([b"ab"]) + b"\x05\0\0\0abc", K.BYTES_PAST_END, 1),
    (blob([b"ab"]) + b"\x01\0", K.BYTES_PAST_END, 1),
    (blob([b"ab", b"cd"]) + b"x", K.BYTES_TRAILING, 2),
    (blob([b"a\nb", b"cd"]), K.BYTES_FORBIDDEN, 0),
    (blob([b"ab", b"c\0"]), K.BYTES_FORBIDDEN, 1),
])
def test_bytes_columns_ids_refuse(raw, status, where):
    data = np.frombuffer(raw, np.uint8)
    out = K.bytes_columns_ids(data, np.array([0], np.int64), np.array([len(raw)], np.int64), 2,
                              0, np.empty((2, 1), np.int64), np.zeros(2, np.uint8))
    assert out == (status, 0, where)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_columns_equal_numpy(dtype):
    rng = np.random.default_rng(1)
    x = rng.uniform(-5, 500, (13, 40)).astype(dtype)
    x[rng.random((13, 40)) < 0.3] = np.nan
    x[:, 7] = np.nan                                       # a row with no dense value
    norm = criteo.make_norm()
    out = np.empty((40, 13), np.float32)
    filled = np.empty(40, np.uint8)
    assert K.dense_columns(x, norm, out, filled) == (-1, -1)
    x64 = x.astype(np.float64)
    want = np.where(np.isnan(x64), 0.0, (x64 - norm[0][:, None]) / norm[1][:, None])
    assert np.array_equal(out, want.T.astype(np.float32))
    assert np.array_equal(filled.astype(bool), ~np.isnan(x).all(axis=0))
    x[3, 5] = -np.inf
    assert K.dense_columns(x, norm, out, filled) == (3, 5)


def body(head, tail=b""):
    text = json.dumps(head).encode()
    return text + tail, str(len(text))


def test_split_body_assigns_each_input_its_bytes():
    b, hl = body({"inputs": [{"name": "I1", "parameters": {"binary_data_size": 8}},
                             {"name": "C1", "data": ["x"]},
                             {"name": "C2", "parameters": {"binary_data_size": 3}}]},
                 b"12345678abc")
    head, inputs = v2.split_body(b, hl)
    assert bytes(inputs[0]["raw"]) == b"12345678" and bytes(inputs[2]["raw"]) == b"abc"
    assert "raw" not in inputs[1] and head["inputs"] is inputs


@pytest.mark.parametrize("head,tail,hl,words", [
    ({"inputs": [{"name": "I1", "parameters": {"binary_data_size": 9}}]}, b"12345678", None,
     "inputs[0] (I1).parameters.binary_data_size: 9 bytes, but only 8"),
    ({"inputs": [{"name": "I1", "parameters": {"binary_data_size": 7}}]}, b"12345678", None,
     "1 bytes after the binary tensors"),
    ({"inputs": [{"name": "I1", "parameters": {"binary_data_size": -1}}]}, b"", None,
     "inputs[0] (I1).parameters.binary_data_size: expected a byte count"),
    ({"inputs": [{"name": "I1", "parameters": {"binary_data_size": 1}, "data": [1]}]}, b"x",
     None, "not both"),
    ({"inputs": [{"name": "I1", "data": [1]}]}, b"", "-3", "'-3' is not a length"),
    ({"inputs": [{"name": "I1", "data": [1]}]}, b"", "99999", "is not a length within"),
    ({"inputs": [{"name": "I1", "data": [1]}]}, b"", "1e3", "'1e3' is not a length"),
])
def test_split_body_edge_cases(head, tail, hl, words):
    b, good = body(head, tail)
    with pytest.raises(BadInput, match=None) as e:
        v2.split_body(b, hl if hl is not None else good)
    assert words in str(e.value) and e.value.status == 400


def test_raw_tensor_sizes_and_bytes_elements():
    t = {"name": "I1", "datatype": "FP32", "shape": [3], "raw": b"\0" * 8}
    with pytest.raises(BadInput, match=r"inputs\[0\] \(I1\): 8 bytes of binary data for shape"):
        v2.raw_array(t, "inputs[0] (I1)", 100)
    assert v2.bytes_elements(blob([b"a", b"", b"bc"]), 3, "w") == [b"a", b"", b"bc"]
    with pytest.raises(BadInput, match="element 1"):
        v2.bytes_elements(blob([b"a"]) + b"\x07\0\0\0", 2, "w")
