"""The schema object: TOML loading, validation messages, storage round trip, ids by name."""
import json

import pytest

from mpips.data.criteo import hash_feature, splitmix64_finalise
from mpips.data.slot import slot_feature_id
from mpips.schema import Schema, SchemaError, feasign_salt, hash_seed, load_schema

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _hash_from_seed(seed, raw):
    h = seed
    for b in raw:
        h = ((h ^ b) * 0x100000001B3) & _M
    h = splitmix64_finalise(h)
    return h - (1 << 64) if h >= (1 << 63) else h


def _write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_criteo_default_shape_and_round_trip():
    s = Schema.criteo()
    assert (s.n_dense, s.n_sparse, s.one_hot, s.is_criteo) == (13, 26, True, True)
    assert s.dense_names == tuple(f"I{k}" for k in range(1, 14))
    assert Schema.from_dict(json.loads(s.to_json())) == s
    assert Schema.from_dict(None) == s  # files written before schemas are Criteo
    assert s.diff(Schema.criteo()) == ""


@pytest.mark.parametrize("raw", [b"", b"68fd1e64", b"\x00\xff odd bytes"])
def test_criteo_slot_names_keep_todays_ids(raw):
    s = Schema.criteo()
    for k, seed in enumerate(s.hash_seeds()):
        assert _hash_from_seed(seed, raw) == hash_feature(k, raw)


def test_feasign_salts_keep_todays_slot_ids():
    # slot files name slots 1..26; Criteo's C<k> read from slot files is slot k
    for k in range(1, 27):
        for name in (str(k), f"C{k}"):
            salt = feasign_salt(name)
            h = splitmix64_finalise((12345 + salt * _GOLDEN) & _M)
            assert (h - (1 << 64) if h >= (1 << 63) else h) == slot_feature_id(k - 1, 12345)


def test_ids_follow_names_not_positions():
    assert hash_seed("site_id") != hash_seed("app_id")
    assert hash_seed("site_id") == hash_seed("site_id")
    assert feasign_salt("site_id") != feasign_salt("app_id")
    assert feasign_salt("site_id") >= (1 << 63) > feasign_salt("300")  # never a decimal slot's salt


def test_csv_schema_from_toml(tmp_path):
    s = load_schema(_write(tmp_path, """
format = "csv"
label = "click"
[[dense]]
names = ["price", "age"]
norm = "log1p"
[[sparse]]
names = ["site_id", "app_id"]
[[sparse]]
names = ["genres"]
separator = "|"
max_len = 5
pooling = "mean"
"""))
    assert (s.n_dense, s.n_sparse, s.one_hot) == (2, 3, False)
    assert (s.delimiter, s.header) == (",", True)
    assert s.sparse_names == ("site_id", "app_id", "genres")
    assert s.pooling_codes() == [0, 0, 1]
    assert s.slot_options("max_len") == [0, 0, 5]
    assert s.dense_options("norm") == ["log1p", "log1p"]
    assert Schema.from_dict(s.to_dict()) == s
    assert "format" in s.diff(Schema.criteo())


def test_slot_dense_dim(tmp_path):
    s = load_schema(_write(tmp_path, """
format = "slot"
token_order = "feasign:slot"
[[dense]]
names = ["dense_feature"]
dim = 13
[[sparse]]
names = ["1", "2", "3"]
"""))
    assert (s.n_dense, s.n_sparse, s.label) == (13, 3, "click")


@pytest.mark.parametrize("text, words", [
    ('formt = "csv"', ["unknown key 'formt'", "did you mean 'format'"]),
    ('format = "parquet"\n[[sparse]]\nnames=["a"]', ["format 'parquet'"]),
    ('format = "csv"', ["declares no inputs"]),
    ('format = "csv"\n[[sparse]]\nnames=["a"]\npoolng="mean"', ["unknown key 'poolng'", "pooling"]),
    ('format = "csv"\n[[sparse]]\nnames=["a"]\npooling="max"', ["pooling 'max'"]),
    ('format = "csv"\nlabel="a"\n[[sparse]]\nnames=["a"]', ["declared more than once"]),
    ('format = "csv"\n[[dense]]\nnames=["x"]\ndim=3', ["dim 3 needs a slot or multislot"]),
    ('format = "multislot"\n[[sparse]]\nnames=["a"]', ["multislot needs fields"]),
    ('format = "multislot"\nfields=["click"]\n[[sparse]]\nnames=["a"]', ["do not list ['a']"]),
    ('format = "slot"\n[[sparse]]\nnames=["a"]\nseparator="|"', ["separator is for csv"]),
    ('format = "csv"\nraw_ids = true\n[[sparse]]\nnames=["a"]', ["raw_ids"]),
    ('format = "csv"\n[[sparse]]\nnames=[]', ["needs names"]),
    ('format = "csv" x', ["not valid TOML"]),
])
def test_bad_schemas_say_what_to_change(tmp_path, text, words):
    path = _write(tmp_path, text)
    with pytest.raises(SchemaError) as e:
        load_schema(path)
    msg = str(e.value)
    assert path in msg
    for w in words:
        assert w in msg


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(SchemaError, match="cannot read schema file"):
        load_schema(str(tmp_path / "nope.toml"))
