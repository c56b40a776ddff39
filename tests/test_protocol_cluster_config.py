"""Unit tests (no MPI) for the wire protocol, the role split and the config."""
import numpy as np
import pytest

from mpips.comm.cluster import assign_servers, check_servers, default_servers
from mpips.config import parse_args
from mpips.comm.protocol import (F_CREATE, F_MORE, HEADER_BYTES, MAX_PARTS, Op, ProtocolError,
                                 decode, decode_all, encode, message_nbytes)


def test_encode_decode_round_trip():
    keys = np.array([5, -1, 2**62], np.int64)
    vals = np.arange(12, dtype=np.float32).reshape(3, 4)
    dense = np.linspace(0, 1, 7, dtype=np.float32)
    buf = np.zeros(4096, np.uint8)
    n = encode(buf, Op.PUSH, 9, 0, keys, vals, step=3, flags=2, dense=dense)
    assert n == message_nbytes(3, 4, 7) == HEADER_BYTES + 24 + 4 * 19
    req = decode(buf, n, 1, source=7)
    assert req.op == Op.PUSH and req.req_id == 9 and req.step == 3 and req.flags == 2
    np.testing.assert_array_equal(req.keys, keys)
    np.testing.assert_array_equal(req.values, vals)
    np.testing.assert_array_equal(req.dense, dense)


def test_decode_rejects_malformed():
    buf = np.zeros(4096, np.uint8)
    n = encode(buf, Op.PULL, 1, 0, np.arange(4, dtype=np.int64), None)
    with pytest.raises(ProtocolError, match="rank 3"):
        decode(buf, n + 8, 1, source=3)          # size disagrees with header
    with pytest.raises(ProtocolError, match="bad sizes|header says"):
        hdr = buf[:HEADER_BYTES].view(np.int64)
        hdr[3] = -5
        decode(buf, n, 1, source=3)
    hdr[3] = 4
    hdr[0] = 99
    with pytest.raises(ProtocolError, match="unknown op code 99"):
        decode(buf, n, 1, source=3)
    hdr[0] = int(Op.PULL)
    hdr[2] = 7
    with pytest.raises(ProtocolError, match="unknown table 7"):
        decode(buf, n, 1, source=3)
    with pytest.raises(ProtocolError):
        decode(buf, 5, 1, source=3)


def test_a_message_of_two_requests_decodes_as_the_two_alone():
    """A push and the next pull in one message (F_MORE): each request decodes as it does
    alone, flags without F_MORE; a request flagged F_MORE with nothing after it, bytes
    after a request without it, and more than MAX_PARTS requests are refused."""
    keys, vals = np.array([3, 9], np.int64), np.full((2, 4), 0.5, np.float32)
    pull_keys, counts = np.array([1, 3, 7], np.int64), np.ones((3, 1), np.float32)
    buf = np.zeros(4096, np.uint8)
    a = encode(buf, Op.PUSH, 4, 0, keys, vals, step=2, flags=F_MORE)
    b = encode(buf[a:], Op.PULL, 5, 0, pull_keys, counts, step=3, flags=F_CREATE)
    alone = [np.zeros(4096, np.uint8) for _ in range(2)]
    encode(alone[0], Op.PUSH, 4, 0, keys, vals, step=2)
    encode(alone[1], Op.PULL, 5, 0, pull_keys, counts, step=3, flags=F_CREATE)
    got = decode_all(buf, a + b, 1, source=1)
    want = [decode(alone[0], a, 1, source=1), decode(alone[1], b, 1, source=1)]
    assert len(got) == 2
    for g, w in zip(got, want):
        assert (g.op, g.req_id, g.step, g.flags, g.count, g.dim) == (
            w.op, w.req_id, w.step, w.flags, w.count, w.dim)
        np.testing.assert_array_equal(g.keys, w.keys)
        np.testing.assert_array_equal(g.values, w.values)
    assert got[0].more and not got[1].more and got[1].flags == F_CREATE
    assert decode_all(alone[1], b, 1, source=1)[0].keys.tolist() == [1, 3, 7]
    with pytest.raises(ProtocolError, match="rank 1"):      # F_MORE, nothing after it
        decode_all(buf, a, 1, source=1)
    with pytest.raises(ProtocolError, match="header says"):  # bytes after, no F_MORE
        decode_all(alone[0], a + b, 1, source=1)
    chain = np.zeros(4096, np.uint8)
    off = 0
    for i in range(MAX_PARTS + 1):
        off += encode(chain[off:], Op.PULL, i + 1, 0, keys, None, flags=F_MORE if i < MAX_PARTS else 0)
    with pytest.raises(ProtocolError, match=f"more than {MAX_PARTS}"):
        decode_all(chain, off, 1, source=1)


def test_assign_servers_spreads_over_nodes():
    assert assign_servers(["a"] * 4, 2) == [0, 1]
    assert assign_servers(["a", "a", "b", "b"], 2) == [0, 2]        # one per node
    assert assign_servers(["a", "b", "a", "b"], 2) == [0, 1]
    assert assign_servers(["a"] * 3 + ["b"] * 3, 3) == [0, 1, 3]
    assert default_servers(4) == 2 and default_servers(3) == 1


def test_check_servers_messages():
    with pytest.raises(ValueError, match="needs at least 5 ranks; got 4"):
        check_servers(4, 4)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        check_servers(1, 1)


def test_config_file_and_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('lr = 0.5\nbatch-size = 64\nmode = "sync"\n')
    cfg = parse_args(["--config", str(f), "--lr", "0.25"])
    assert cfg.lr == 0.25 and cfg.batch_size == 64 and cfg.mode == "sync"
    # an explicit flag wins even when it equals the default (and a bool flag, negated too)
    f.write_text('lr = 0.01\nmode = "sync"\nbatch-size = 64\nlocal = true\n')
    cfg = parse_args(["--config", str(f), "--lr", "0.001", "--mode", "async", "--no-local"])
    assert (cfg.lr, cfg.mode, cfg.batch_size, cfg.local) == (0.001, "async", 64, False)
    assert parse_args(["--config", str(f), "--lr=1e-3"]).lr == 0.001
    f.write_text("learning_rate = 1\n")
    with pytest.raises(ValueError, match="unknown key 'learning_rate'"):
        parse_args(["--config", str(f)])
    f.write_text('batch_size = "big"\n')
    with pytest.raises(ValueError, match="must be int"):
        parse_args(["--config", str(f)])
    with pytest.raises(ValueError, match="--batch-size must be >= 1"):
        parse_args(["--batch-size", "0"])
