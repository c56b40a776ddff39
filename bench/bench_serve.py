"""Load bench of `python -m mpips.serve` on loopback (issue 32): latency and rate by batch,
protocol and server processes, while patches land, against the in-process limit.

    python bench/bench_serve.py                                  # Criteo shape, 1M-row table
    python bench/bench_serve.py --shape wide --rows 200000       # multi-hot, 300 bag slots
    python bench/bench_serve.py --shape din --rows 100000        # DIN: attention, histories
    python bench/bench_serve.py --patch-seconds 120              # the issue's 2-minute run

1. Model: random weights (the bundle writer, ``tests/serve_models.py``) over the ids of
   generated rows (Criteo: ``data_prep.synth``; wide: ``data_prep.multihot_synth``, 300
   slots of bags; din: ``data_prep.din_synth``, histories of 3-40 items pooled by attention) plus random ids up to ``--rows`` table rows; Criteo's 400x3 CTR-DNN of
   dim 10, the wide shape's 512-256-128-128-128 of dim 9, the din shape's 200-80 of dim 8.  Scores do not depend on where
   the weights came from; the cost of a request does not depend on their values.
2. In-process limit: ``Predictor.predict_arrays`` (rows parsed beforehand) and
   ``predict_lines`` instances/s at each batch size, one core, by the clock and per
   CPU-second (the figure a loaded machine does not hide: set it against the server's CPU
   time per request).
3. Server: ``python -m mpips.serve --follow DIR --port 0 --processes P`` (P in
   ``--processes``), and one load process on loopback (127.0.0.1 only): closed loop at
   ``--concurrency`` connections (peak rate), and open loop at ``--rate`` requests/s
   (latency from each request's scheduled time, so a stalled server is not hidden), each
   for ``--seconds`` and at most ``--max-requests``; batch 1, 32, 256; TF ``:predict``
   instances (the wide shape's: slots as lists of integer feasigns), raw ``:lines``, and
   (``--protocols``) the V2 binary tensor data extension over HTTP (``binary``) and V2
   over gRPC, raw_input_contents, Criteo shape: ``grpc`` sends prebuilt HTTP/2 frames on
   raw sockets (``_GrpcConn``, as the HTTP loads send prebuilt requests: the latency is the
   server's), ``grpcio`` goes through grpcio's client (its threads share the 2 cores and
   its cost a call is in the latency: what a grpcio user sees).
   Reported: requests/s, instances/s, p50, p99, p99.9,
   failed requests (non-2xx or no answer), the server's CPU time per request (user +
   system of its processes: the cost a busy machine does not hide), and the server's
   memory (PSS summed over its processes).
4. Patches: on one server of ``--patch-processes`` processes, the open loop at batch 1 for
   ``--patch-seconds`` steady, then as long again while a new patch (1% of the rows
   changed, 0.1% evicted; written beforehand) is committed to the folder every second;
   failures, p99 and the server's CPU of the two.

A/B of two builds of the server: ``--roots A,B --rounds N`` serves from each source tree in
turn (``PYTHONPATH``), N rounds alternated, and prints the median of each figure by tree
(e.g. a tree of an older commit: ``git archive COMMIT mpips | tar -x -C /tmp/old``).

The machine is shared and has 2 cores: the load generator and the server compete for them;
report the load average with the figures (printed at the end).
"""
import os

for _v in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")                   # one core (before numpy starts BLAS)

import argparse  # noqa: E402
import collections  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mpips.data.criteo import make_norm  # noqa: E402
from mpips.schema import load_schema, Schema  # noqa: E402
from mpips.serving import Predictor  # noqa: E402
from mpips.data import parsers  # noqa: E402
from mpips.serving.grpc_wire import PREFACE, frame as _h2  # noqa: E402
from mpips.serving.predictor import line_parser, parse_lines  # noqa: E402
from tests import serve_models as sm  # noqa: E402

SHAPES = {"criteo": {"dim": 10, "fc": "400,400,400"},
          "wide": {"dim": 9, "fc": "512,256,128,128,128"},
          "din": {"dim": 8, "fc": "200,80"}}        # attention over histories of 3-40


# ---------------------------------------------------------------------- model and requests
def make_model(a, out):
    """(export folder, lines, schema, data, keys)."""
    if a.shape == "criteo":
        from data_prep.synth import generate
        generate(os.path.join(out, "data"), rows=10, parts=1, seed=1, test_rows=a.lines)
        d = os.path.join(out, "data", "test")
        lines = [x for f in sorted(os.listdir(d)) for x in
                 open(os.path.join(d, f)).read().splitlines()]
        schema = Schema.criteo()
        lo, diff = make_norm()
        data = {"data_format": "auto", "hash_bucket": 0, "cont_min": lo.tolist(),
                "cont_diff": diff.tolist()}
    elif a.shape == "din":
        from data_prep.din_synth import generate as din
        d = os.path.join(out, "din")
        din(d, 10, a.lines, seed=1)
        lines = open(os.path.join(d, "test.txt")).read().splitlines()
        schema = load_schema(os.path.join(d, "schema.toml"))
        data = {"data_format": "auto", "hash_bucket": 0, "cont_min": None, "cont_diff": None}
    else:
        from data_prep.multihot_synth import main as gen
        d = os.path.join(out, "wide")
        gen(["--out", d, "--rows", "10", "--test-rows", str(a.lines), "--parts", "1",
             "--slots", "300", "--seed", "1"])
        lines = [x for x in open(os.path.join(d, "test", "part-00000.txt")).read().splitlines()]
        schema = load_schema(os.path.join(d, "schema.toml"))
        data = {"data_format": "auto", "hash_bucket": 0, "cont_min": None, "cont_diff": None}
    keys = sm.ids_of(lines, schema, data)
    rng = np.random.default_rng(0)
    if len(keys) < a.rows:
        keys = np.unique(np.concatenate([keys, rng.integers(-2 ** 62, 2 ** 62,
                                                            a.rows - len(keys))]))
    folder = os.path.join(out, "exports")
    os.makedirs(folder)
    shape = SHAPES[a.shape]
    m = sm.write_full(os.path.join(folder, "full-000001.h5"), keys, schema, data,
                      dim=shape["dim"], fc=shape["fc"])
    sm.commit(folder, ["full-000001.h5"])
    return folder, lines, schema, m, keys


def instances(lines, schema):
    """TF instances of the lines: Criteo TSV by column; slot text (the wide shape) by slot,
    feasigns as integers and bags as lists, the dense slot as a list of its values."""
    out = []
    if schema.is_criteo:
        names = [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)]
        for x in lines:
            out.append({n: (int(v) if n[0] == "I" else v)
                        for n, v in zip(names, x.split("\t")[1:]) if v})
        return out
    if schema.format == "csv":                  # the din shape: the columns of `fields`
        out = []
        for x in lines:
            cols = dict(zip(schema.fields, x.split(schema.delimiter)))
            out.append({n: [int(v) for v in cols[n].split()] for n in schema.sparse_names})
        return out
    dense = {n for g in schema.dense for n in g.names}
    flip = schema.token_order == "feasign:slot"
    for x in lines:
        inst = {}
        for tok in x.split():
            a, _, b = tok.partition(":")
            name, value = (b, a) if flip else (a, b)
            if name == schema.label:
                continue
            inst.setdefault(name, []).append(float(value) if name in dense else int(value))
        out.append(inst)
    return out


def v2_tensors(lines):
    """[(name, datatype, raw bytes)] of Criteo TSV lines: the V2 binary layout (FP32 with
    NaN for an empty I field; BYTES with a 4-byte length before each value)."""
    fields = [x.split("\t")[1:] for x in lines]
    out = []
    for k in range(39):
        col = [f[k] for f in fields]
        if k < 13:
            raw = np.array([float(v) if v else np.nan for v in col], "<f4").tobytes()
            out.append((f"I{k + 1}", "FP32", raw))
        else:
            raw = b"".join(len(v).to_bytes(4, "little") + v.encode() for v in col)
            out.append((f"C{k - 12}", "BYTES", raw))
    return out


def binary_body(lines):
    """(body, header length) of a V2 infer request in the binary tensor data extension,
    the answer asked in binary too (what tritonclient.http sends by default)."""
    tensors = v2_tensors(lines)
    head = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": [len(lines)],
                                   "parameters": {"binary_data_size": len(r)}}
                                  for n, d, r in tensors],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(r for *_, r in tensors), len(head)


def grpc_bodies(lines, batch, name, k=16):
    """k distinct serialized ModelInferRequests of ``batch`` rows (raw_input_contents)."""
    from mpips.serving.proto import kserve_v2_pb2 as pb
    T = pb.ModelInferRequest.InferInputTensor
    out = []
    for j in range(k):
        lo = (j * batch) % max(1, len(lines) - batch)
        tensors = v2_tensors(lines[lo:lo + batch])
        out.append(pb.ModelInferRequest(
            model_name=name, inputs=[T(name=n, datatype=d, shape=[batch]) for n, d, _ in tensors],
            raw_input_contents=[r for *_, r in tensors]).SerializeToString())
    return out


def bodies(lines, insts, batch, proto, name, k=16):
    """k distinct raw HTTP requests of ``batch`` rows (gRPC: serialized messages)."""
    if proto in GRPC:
        return grpc_bodies(lines, batch, name, k)
    out = []
    for j in range(k):
        lo = (j * batch) % max(1, len(lines) - batch)
        extra = b""
        if proto == "binary":
            body, hl = binary_body(lines[lo:lo + batch])
            path, ctype = f"/v2/models/{name}/infer", "application/octet-stream"
            extra = b"Inference-Header-Content-Length: %d\r\n" % hl
        elif proto == "lines":
            body, path, ctype = ("\n".join(lines[lo:lo + batch]) + "\n").encode(), \
                f"/v1/models/{name}:lines", "text/plain"
        else:
            body, path, ctype = json.dumps({"instances": insts[lo:lo + batch]}).encode(), \
                f"/v1/models/{name}:predict", "application/json"
        out.append(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: %s\r\n%s"
                   b"Content-Length: %d\r\n\r\n" % (path.encode(), ctype.encode(), extra,
                                                    len(body)) + body)
    return out


def in_process(bundle, lines, schema, batch, seconds):
    """(predict_arrays, predict_lines) instances/s at this batch size."""
    p = Predictor(bundle)
    model = p.model
    if schema.is_criteo:
        dense, ids, _ = parse_lines(lines, model.data)
        arrays = lambda lo: (dense[lo:lo + batch], ids[lo:lo + batch], None)  # noqa: E731
    else:
        fmt = line_parser(model)
        rows = []
        for lo in range(0, len(lines) - batch + 1, batch):
            piece, _ = parsers.parse_lines(lines[lo:lo + batch], fmt)
            rows.append((piece[0], piece[1], piece[3]))
        arrays = lambda lo: rows[(lo // batch) % len(rows)]  # noqa: E731
    rates = []
    for fn in (lambda lo: p.predict_arrays(*arrays(lo)),
               lambda lo: p.predict_lines(lines[lo:lo + batch])):
        fn(0)
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            fn((n * batch) % max(1, len(lines) - batch))
            n += 1
        rates.append(n * batch / (time.perf_counter() - t0))
        rates.append(n * batch / max(1e-9, time.process_time() - c0))
    return rates


# ---------------------------------------------------------------------- load generator
ERRORS = collections.Counter()     # answers other than 200, by status and message
GRPC = {"grpc", "grpcio"}          # the protocols served on --grpc-port
LEAD = 0.0005                     # the hybrid client spins this long before each send


def client_kw(client):
    """``load``'s arguments for an open-loop generator: spin, select or hybrid."""
    return {"spin": client == "spin", "lead": LEAD if client == "hybrid" else 0.0}


class _Conn:
    """One HTTP/1.1 connection, one request at a time."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.buf, self.sent_at = b"", None

    def send(self, req):
        self.sock.sendall(req)                  # small: fits the socket buffer

    def answers(self, chunk):
        """[(ok, error text)] of the answers completed by ``chunk``."""
        self.buf += chunk
        out = []
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return out
            head = self.buf[:i].lower()
            n = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(self.buf) < i + 4 + n:
                return out
            ok = self.buf[9:12] == b"200"
            out.append((ok, None if ok else self.buf[9:12].decode("latin-1") + " " +
                        self.buf[i + 4:i + 4 + n][:120].decode("utf-8", "replace")))
            self.buf = self.buf[i + 4 + n:]


def _hs(b):                                     # an HPACK string: raw, under 127 bytes
    return bytes((len(b),)) + b


def _hint(b, i, bits):
    """(integer of an ``bits``-bit prefix at b[i] (RFC 7541 5.1), next index)."""
    mask = (1 << bits) - 1
    v, i = b[i] & mask, i + 1
    if v < mask:
        return v, i
    shift = 0
    while True:
        v += (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return v, i


class _Hpack:
    """An HPACK decoder of header blocks (RFC 7541) enough to read the trailers' grpc-status:
    the dynamic table kept, a static entry named by its index only (no gRPC name is in the
    static table), a Huffman-coded string as None (grpc's C core writes these raw)."""

    def __init__(self):
        self.table, self.size, self.max = [], 0, 4096

    def _str(self, b, i):
        n, j = _hint(b, i, 7)
        return (None if b[i] & 0x80 else b[j:j + n].decode("latin-1")), j + n

    def _entry(self, k):
        return (f"static {k}", None) if k <= 61 else self.table[k - 62]

    def _add(self, name, value):
        self.table.insert(0, (name, value))
        self.size += 32 + len(name or "") + len(value or "")
        while self.size > self.max:
            n, v = self.table.pop()
            self.size -= 32 + len(n or "") + len(v or "")

    def decode(self, b):
        out, i = {}, 0
        while i < len(b):
            c = b[i]
            if c & 0x80:                                # indexed
                k, i = _hint(b, i, 7)
                name, value = self._entry(k)
            elif c & 0xE0 == 0x20:                      # table size update
                self.max, i = _hint(b, i, 5)
                while self.size > self.max:
                    n, v = self.table.pop()
                    self.size -= 32 + len(n or "") + len(v or "")
                continue
            else:                                       # literal (indexed or not)
                k, i = _hint(b, i, 6 if c & 0x40 else 4)
                name = self._entry(k)[0] if k else None
                if not k:
                    name, i = self._str(b, i)
                value, i = self._str(b, i)
                if c & 0x40:
                    self._add(name, value)
            out[name] = value
        return out


# HPACK (RFC 7541) of a gRPC call, no dynamic table, no Huffman: :method POST (static 3),
# :scheme http (6), then literals without indexing: :path (name 4), :authority (1),
# content-type (31: 15 + 16), te: trailers (a new name)
GRPC_HEADERS = (b"\x83\x86\x04" + _hs(b"/inference.GRPCInferenceService/ModelInfer") +
                b"\x01" + _hs(b"127.0.0.1") + b"\x0f\x10" + _hs(b"application/grpc") +
                b"\x00" + _hs(b"te") + _hs(b"trailers"))


class _GrpcConn(_Conn):
    """One HTTP/2 connection speaking gRPC unary calls from prebuilt frames (RFC 7540: the
    preface, SETTINGS and PING answered, flow control kept on what it sends), one call at a
    time: the client's counterpart of the raw HTTP/1.1 connections, so the latency is the
    server's, not a client library's.  A call is OK when its answer carries a whole gRPC
    message and its trailers grpc-status 0 (``_Hpack``); the last message is read back as
    a ModelInferResponse (``check``)."""

    def __init__(self, port):
        super().__init__(port)
        self.sid, self.win, self.swin, self.init_win, self.max_frame = -1, 65535, 0, 65535, 16384
        self.got, self.last, self.hpack = None, b"", _Hpack()
        self._sendall(PREFACE +   # receive window: 2^31-1
                          _h2(4, 0, 0, (4).to_bytes(2, "big") + (2 ** 31 - 1).to_bytes(4, "big")) +
                          _h2(8, 0, 0, (2 ** 31 - 1 - 65535).to_bytes(4, "big")))

    def send(self, req):
        self.sid += 2
        self.swin, self.got, self.head, self.ending = self.init_win, b"", b"", False
        self.status, self.message, self.pending = None, "", False
        data = len(req).to_bytes(5, "big") + req        # gRPC: not compressed, length
        out, pos = [_h2(1, 4, self.sid, GRPC_HEADERS)], 0
        while pos < len(data):
            room = min(self.win, self.swin, self.max_frame)
            if room <= 0:                               # wait for the server's WINDOW_UPDATE
                self._sendall(b"".join(out))
                out = []
                self.sock.settimeout(10)
                chunk = self.sock.recv(1 << 16)
                self.sock.setblocking(False)
                if not chunk:
                    raise OSError("the server closed the connection")
                self.answers(chunk)
                continue
            piece = data[pos:pos + room]
            pos += len(piece)
            self.win -= len(piece)
            self.swin -= len(piece)
            out.append(_h2(0, 1 if pos == len(data) else 0, self.sid, piece))
        self._sendall(b"".join(out))

    def answers(self, chunk):
        self.buf += chunk
        out, reply = [], []
        while len(self.buf) >= 9:
            n = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + n:
                break
            kind, flags = self.buf[3], self.buf[4]
            sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            body, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
            if kind == 4 and not flags & 1:             # SETTINGS: ack; note windows, frames
                for i in range(0, n - 5, 6):
                    key, val = int.from_bytes(body[i:i + 2], "big"), int.from_bytes(
                        body[i + 2:i + 6], "big")
                    if key == 4:
                        self.swin += val - self.init_win
                        self.init_win = val
                    elif key == 5:
                        self.max_frame = val
                reply.append(_h2(4, 1, 0))
            elif kind == 6 and not flags & 1:           # PING: ack
                reply.append(_h2(6, 1, 0, body))
            elif kind == 8:                             # WINDOW_UPDATE
                inc = int.from_bytes(body[:4], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.win += inc
                elif sid == self.sid:
                    self.swin += inc
            elif kind == 7:                             # GOAWAY: the calls after fail
                raise OSError("GOAWAY: " + body[8:120].decode("utf-8", "replace"))
            elif sid != self.sid or self.got is None:
                continue
            elif kind == 0:                             # DATA (unpadded: the server's)
                self.got += body
            elif kind in (1, 9):                        # HEADERS, CONTINUATION
                if kind == 1 and flags & 8:             # PADDED
                    body = body[1:len(body) - body[0]]
                if kind == 1 and flags & 0x20:          # PRIORITY: 5 bytes first
                    body = body[5:]
                self.head += body
                self.pending = not flags & 4
                if flags & 4:                           # END_HEADERS: a whole block
                    fields, self.head = self.hpack.decode(self.head), b""
                    self.status = fields.get("grpc-status", self.status)
                    self.message = fields.get("grpc-message", self.message)
            if kind in (0, 1) and flags & 1:
                self.ending = True
            if sid == self.sid and self.got is not None and (
                    self.ending and not self.pending or kind == 3):   # the call ended
                whole = len(self.got) >= 5 and int.from_bytes(self.got[1:5], "big") == \
                    len(self.got) - 5
                ok = kind != 3 and whole and self.status == "0"
                out.append((ok, None if ok else "RST_STREAM" if kind == 3 else
                            f"grpc-status {self.status} {str(self.message)[:120]}"))
                if ok:
                    self.last = self.got[5:]
                self.got = None
        if reply:
            self._sendall(b"".join(reply))
        return out

    def _sendall(self, data):
        """Send whole, blocking for at most 10 s, then put back the socket's own timeout
        (non-blocking in the load loop; a caller reading with a timeout keeps it)."""
        was = self.sock.gettimeout()
        self.sock.settimeout(10)
        self.sock.sendall(data)
        self.sock.settimeout(was)

    def check(self):
        from mpips.serving.proto import kserve_v2_pb2 as pb
        r = pb.ModelInferResponse.FromString(self.last)
        if not (r.outputs and r.model_version and len(r.raw_output_contents[0]) ==
                4 * r.outputs[0].shape[0]):
            raise RuntimeError(f"the gRPC answers do not read back: {r}")


def load(port, reqs, mode, rate, concurrency, seconds, max_requests, spin=False,
         conn=_Conn, lead=0.0):
    """Send requests for ``seconds`` (open loop at ``rate``/s or closed loop), bounded by
    ``max_requests`` and a hard deadline (30 s more: what is scheduled by the end is still
    sent and waited for until then); return (latencies s, failures, requests, wall).
    ``spin``: poll the sockets without sleeping (the generator takes a core), so that the
    generator's own wake-up, which on a VM can cost more than the server's whole answer
    (``--floor``), is not counted as the server's latency.  ``lead`` (the ``hybrid``
    client): sleep, but spin the last ``lead`` seconds before each scheduled send (the
    send is on time; the answers are waited for asleep, the CPU left to the server).
    A failure: an answer other than 200, a connection closed, or no answer by the hard
    deadline (requests still scheduled or in flight then)."""
    conns = [conn(port) for _ in range(concurrency)]
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    idle, backlog = collections.deque(conns), collections.deque()   # round robin: no
    # connection sits unused long enough for the server's --idle-timeout to close it
    lat, fails, issued, k = [], 0, 0, 0
    t0 = time.perf_counter()
    end, hard = t0 + seconds, t0 + seconds + 30
    next_t = t0

    def send(c, at):
        nonlocal issued, k
        c.sent_at = at
        c.send(reqs[k % len(reqs)])
        k += 1
        issued += 1
    while True:
        now = time.perf_counter()
        if now > hard:
            fails += len(conns) - len(idle) + len(backlog)
            break
        if now < end and issued + len(backlog) < max_requests:
            if mode == "open":
                while next_t <= now and issued + len(backlog) < max_requests:
                    backlog.append(next_t)
                    next_t += 1.0 / rate
                while backlog and idle:
                    c = idle.popleft()
                    c.sock.setblocking(True)
                    send(c, backlog.popleft())
                    c.sock.setblocking(False)
            else:
                while idle and issued < max_requests:
                    c = idle.popleft()
                    c.sock.setblocking(True)
                    send(c, now)
                    c.sock.setblocking(False)
        elif backlog and idle:                  # past the end: send what was scheduled
            c = idle.popleft()
            c.sock.setblocking(True)
            send(c, backlog.popleft())
            c.sock.setblocking(False)
            continue
        elif len(idle) == len(conns) and not backlog:
            break
        wait = max(0.0, min(next_t - now, 0.05)) if mode == "open" and now < end else 0.05
        wait = 0.0 if spin else wait
        if lead and mode == "open" and now < end:
            wait = 0.0 if next_t - now <= lead else min(next_t - now - lead, 0.05)
        for key, _ in sel.select(wait):
            c = key.data
            try:
                chunk = c.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                ERRORS["connection closed by the server"] += 1
                fails += 1
                sel.unregister(c.sock)
                conns.remove(c)
                continue
            t = time.perf_counter()
            for ok, err in c.answers(chunk):
                if ok:
                    lat.append(t - c.sent_at)
                else:
                    ERRORS[err] += 1
                    fails += 1
                idle.append(c)
    wall = time.perf_counter() - t0
    if lat and conn is not _Conn:
        next(c for c in conns if c.last).check()
    for c in conns:
        c.sock.close()
    return np.array(lat), fails, issued, wall


def load_grpc(port, reqs, mode, rate, concurrency, seconds, max_requests, spin=False,
              lead=0.0):
    """``load`` over gRPC (grpcio's client: its own threads take the answers): the same
    open and closed loops, bounds and failures (a status other than OK, or no answer by
    the hard deadline).  ``spin``: the scheduling loop polls instead of sleeping (giving
    up the GIL each turn: the answers come in on grpcio's threads)."""
    import grpc
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    fn = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                        request_serializer=lambda b: b, response_deserializer=lambda b: b)
    grpc.channel_ready_future(ch).result(timeout=30)
    lat, done, lock = [], queue.Queue(), threading.Lock()
    state = {"fails": 0, "inflight": 0}

    def finished(fut, at):
        t = time.perf_counter()
        code = fut.code()
        with lock:
            state["inflight"] -= 1
            if code == grpc.StatusCode.OK:
                lat.append(t - at)
            else:
                state["fails"] += 1
                ERRORS[f"{code.name} {fut.details()[:120]}"] += 1
        done.put(1)

    issued, t0 = 0, time.perf_counter()
    end, hard = t0 + seconds, t0 + seconds + 30

    def send(at):
        nonlocal issued
        with lock:
            state["inflight"] += 1
        f = fn.future(reqs[issued % len(reqs)], timeout=max(1.0, hard - time.perf_counter()))
        f.add_done_callback(lambda fut, at=at: finished(fut, at))
        issued += 1
    if mode == "closed":
        for _ in range(min(concurrency, max_requests)):
            send(time.perf_counter())
        while time.perf_counter() < end and issued < max_requests:
            try:
                done.get(timeout=0.05)
            except queue.Empty:
                continue
            send(time.perf_counter())
    else:
        next_t = t0
        while next_t < end and issued < max_requests:
            now = time.perf_counter()
            if now >= next_t:
                send(next_t)
                next_t += 1.0 / rate
            else:                         # spin: poll, but let grpcio's threads run
                time.sleep(0.0 if spin or next_t - now <= lead else
                           min(next_t - now - lead, 0.05))
    while time.perf_counter() < hard:
        with lock:
            if state["inflight"] == 0:
                break
        time.sleep(0.001)                 # waiting out the answers, bounded by the deadline
    wall = time.perf_counter() - t0
    with lock:
        fails = state["fails"] + state["inflight"]
    ch.close()
    return np.array(lat), fails, issued, wall


def summary(lat, fails, issued, wall, batch):
    q = (lambda p: float(np.percentile(lat, p) * 1e3)) if len(lat) else (lambda p: float("nan"))
    errors = dict(ERRORS)
    ERRORS.clear()
    return {"errors": errors, "requests": issued, "failed": fails, "qps": round(len(lat) / wall, 1),
            "instances_per_s": round(len(lat) * batch / wall, 1), "p50_ms": round(q(50), 3),
            "p99_ms": round(q(99), 3), "p999_ms": round(q(99.9), 3)}


# ---------------------------------------------------------------------- server
def floor_server(parser="llhttp"):
    """``--floor-server``: mpips' HTTP layer (``HttpServer``) answering every request with
    a constant score: the generator, loopback and HTTP floor under the server's figures."""
    import asyncio
    from mpips.serving.http import HttpServer, Response
    body = json.dumps({"predictions": [0.5], "model_version": "floor"}).encode()

    async def serve():
        srv = HttpServer(lambda req: Response(200, body), "127.0.0.1", 0, parser=parser)
        await srv.start()
        print(f"floor ready http://127.0.0.1:{srv.port}", flush=True)
        await asyncio.Event().wait()              # until terminated
    asyncio.run(serve())


def wire_cost(calls=5000, message=1500, answer=20):
    """``--wire-cost``: CPU microseconds of the HTTP/2 transport alone on one unary gRPC
    call, in process: the bytes of recorded calls (this bench's prebuilt frames: HEADERS,
    then DATA of a ``message``-byte request, on one connection) fed to the server side, the
    answer sent back (HEADERS, DATA of ``answer`` bytes, trailers), no socket and no
    scoring.  Two transports on the same bytes: mpips' ``grpc_wire.GrpcConn`` (its servicer
    a double answering a constant) and python-hyper's ``h2`` state machine (if installed;
    the one tried before it, docs/serving.md).  {name: us} printed and returned."""
    from mpips.serving import grpc_wire as gw
    body = len(b"m" * message).to_bytes(5, "big") + b"m" * message
    frames = [_h2(1, 4, s, GRPC_HEADERS) + _h2(0, 1, s, body) for s in range(1, 2 * calls, 2)]
    start = PREFACE + _h2(4, 0, 0) + _h2(
        8, 0, 0, (2 ** 31 - 1 - 65535).to_bytes(4, "big"))
    out, costs = b"a" * answer, {}

    class Servicer:
        methods = {"/inference.GRPCInferenceService/ModelInfer"}

        def call(self, path, msg):
            return out, "OK", "", "1"

    class Transport:
        def write(self, b):
            pass

        def get_extra_info(self, key):
            return None

        def is_closing(self):
            return False

    server = types.SimpleNamespace(handler=Servicer(), max_body=1 << 24, max_head=16 << 10,
                                   conns=set(), stopping=False, wake=lambda: None)
    conn = gw.GrpcConn(server)
    conn.connection_made(Transport())
    conn.data_received(start)
    t0 = time.process_time()
    for f in frames:
        conn.data_received(f)
    costs["grpc_wire"] = (time.process_time() - t0) / calls * 1e6
    assert not conn.closing and not conn.calls
    try:
        from h2.config import H2Configuration
        from h2.connection import H2Connection
        from h2.events import RequestReceived, StreamEnded
    except ImportError:
        H2Connection = None
    if H2Connection is not None:
        conn = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        conn.receive_data(start)
        head = ((b":status", b"200"), (b"content-type", b"application/grpc"))
        tail = ((b"grpc-status", b"0"), (b"model-version", b"1"))
        out = len(out).to_bytes(5, "big") + out
        conn.data_to_send()
        t0 = time.process_time()
        for f in frames:
            for ev in conn.receive_data(f):
                if type(ev) is RequestReceived:
                    dict(ev.headers)
                elif type(ev) is StreamEnded:
                    conn.send_headers(ev.stream_id, head)
                    conn.send_data(ev.stream_id, out)
                    conn.send_headers(ev.stream_id, tail, end_stream=True)
                elif hasattr(ev, "flow_controlled_length"):
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            conn.data_to_send()
        costs[f"h2 {importlib.metadata.version('h2')}"] = (time.process_time() - t0) / calls * 1e6
    print("HTTP/2 transport alone, CPU a unary call (%d-byte request, %d-byte answer; %d calls "
          "on one connection): %s" % (message, answer, calls, ", ".join(
              f"{k} {v:.0f} us" for k, v in costs.items())), flush=True)
    return costs


def _ready(proc, what, timeout=300, line=False):
    """(proc, port) once ``proc`` prints its ready line (``... http://127.0.0.1:PORT ...``),
    within ``timeout`` s, however quiet it is; else kill it and raise.  A thread reads all
    of its output (so it never blocks on a full pipe) and hands the lines over."""
    lines, want_line = queue.Queue(), line

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put("")                                   # it ended
    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if not line:
            break
        if "ready" in line:
            port = int(line.split("127.0.0.1:")[1].split()[0])
            return (proc, port, line) if want_line else (proc, port)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{what} did not start within {timeout} s")


def start_floor():
    return _ready(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--floor-server",
                                    "--http-parser", HTTP_PARSER[0]],
                                   stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                   env=dict(os.environ, PYTHONPATH=ROOT)), "floor server", 60)


HTTP_PARSER = ["llhttp"]      # --http-parser


def start(folder, processes, name, grpc=False, root=ROOT):
    """(proc, HTTP port, gRPC port or None) of a server following ``folder``, its code
    from the source tree ``root``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONPATH=root)
    proc, port, line = _ready(subprocess.Popen(
        [sys.executable, "-m", "mpips.serve", "--follow", folder, "--port", "0", "--processes",
         str(processes), "--name", name, "--poll-seconds", "0.1", "--max-instances", "100000",
         "--http-parser", HTTP_PARSER[0]] + (["--grpc-port", "0"] if grpc else []),
        stdout=subprocess.PIPE, text=True, env=env, cwd=root), "server", line=True)
    # (cwd=root: ``python -m`` puts its working directory ahead of PYTHONPATH; with cwd=ROOT
    # every --roots tree served ROOT's code)
    return proc, port, (int(line.split(" grpc 127.0.0.1:")[1].split()[0]) if grpc else None)


def tree(root_pid):
    """The pids of a process and its descendants."""
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def pss_mb(root_pid):
    """PSS (MB) summed over a process and its descendants."""
    total = 0.0
    for pid in tree(root_pid):
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return round(total, 1)


def cpu_seconds(root_pid):
    """User + system CPU seconds of a process tree (the server's work, whatever share of
    the cores it got: a figure a loaded machine does not inflate much)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in tree(root_pid):
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def stage_patches(folder, staging, m, keys, n):
    """Write n patches (1% of the rows changed, 0.1% evicted, each after the one before)
    into ``staging``, with their index entries, before the run: committing one is then a
    rename and an index write, so the run measures the server's cost of a patch, not the
    cost of writing it on the same 2 cores."""
    os.makedirs(staging, exist_ok=True)
    entries = []
    for seq in range(2, n + 2):
        name = f"patch-{seq:06d}.h5"
        m = sm.write_patch(os.path.join(staging, name), m, keys, seed=seq, seq=seq, frac=0.01,
                           evict=0.001)
        entries.append(sm.entry(staging, name))
    return entries


def patcher(folder, staging, staged, stop, every, count):
    """Commit the next staged patch every ``every`` seconds until ``stop``; count them."""
    entries = [sm.entry(folder, "full-000001.h5")]
    for e in staged:
        if stop.wait(every):
            break
        os.replace(os.path.join(staging, e["file"]), os.path.join(folder, e["file"]))
        entries.append(e)
        sm.write_index(folder, entries)
        count.value = len(entries) - 1


def medians(runs):
    """Print the median over rounds of each run's figures, by source tree."""
    keys = ("p50_ms", "p99_ms", "qps", "instances_per_s", "server_cpu_us_per_request")
    groups = collections.defaultdict(list)
    for r in runs:
        if "root" in r:
            groups[(r["protocol"], r["batch"], r["mode"], r["client"], r["processes"],
                    r["root"])].append(r)
    for (proto, b, mode, client, procs, root), rs in sorted(groups.items()):
        med = {k: round(float(np.median([r[k] for r in rs])), 3) for k in keys}
        print(json.dumps(dict(median_of=len(rs), protocol=proto, batch=b, mode=mode,
                              client=client, processes=procs, root=root, **med)), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="criteo", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=1_000_000, help="embedding rows of the table")
    ap.add_argument("--lines", type=int, default=4096, help="generated request rows")
    ap.add_argument("--processes", default="1,2", help="server processes to run, comma list")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--protocols", default="predict,lines", help="comma list of predict (TF "
                    "instances), lines (raw), binary (V2 binary tensors over HTTP; Criteo "
                    "shape), grpc (V2 over gRPC, raw_input_contents, from prebuilt HTTP/2 "
                    "frames as the HTTP loads send prebuilt requests; Criteo shape), grpcio "
                    "(the same calls by grpcio's client: its own threads, its cost a call)")
    ap.add_argument("--rate", type=float, default=500, help="open loop requests/s (batch 1)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed loop connections")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--max-requests", type=int, default=200_000)
    ap.add_argument("--patch-seconds", type=float, default=30, help="0: no patch run")
    ap.add_argument("--patch-processes", type=int, default=1, help="server processes of the "
                    "patch run (default 1)")
    ap.add_argument("--clients", default="spin,select", help="open-loop generators, comma "
                    "list: spin (polls its sockets, takes a core: latency without its own "
                    "wake-up), select (sleeps between answers) and hybrid (sleeps, but spins "
                    "the last LEAD s before each send); the patch run uses the first")
    ap.add_argument("--floor", type=int, default=1, help="1: first the open loop against the "
                    "HTTP layer alone (a constant answer): the floor of the latency figures")
    ap.add_argument("--http-parser", default="llhttp", choices=("llhttp", "builtin"),
                    help="the server's HTTP parser (mpips.serve --http-parser)")
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wire-cost", action="store_true", help="only print the HTTP/2 "
                    "transport's CPU a unary gRPC call, in process (wire_cost: grpc_wire, and h2 "
                    "if installed), and exit")
    ap.add_argument("--out", default="", help="write the results as JSON")
    ap.add_argument("--roots", default=ROOT, help="source trees of the server, comma list: "
                    "each serves in turn (an A/B of two builds)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over --roots, alternated")
    a = ap.parse_args(argv)
    HTTP_PARSER[0] = a.http_parser
    if a.floor_server:
        return floor_server(a.http_parser)
    if a.wire_cost:
        return 0 if wire_cost() else 1
    clients = [c for c in a.clients.split(",") if c]
    if not clients or set(clients) - {"spin", "select", "hybrid"}:
        ap.error(f"--clients: spin, select and/or hybrid; got {a.clients!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the server on the way out
    tmp = tempfile.mkdtemp(prefix="bench_serve_")
    res = {"shape": a.shape, "rows": a.rows, "runs": [], "in_process": {}}
    try:
        folder, lines, schema, m, keys = make_model(a, tmp)
        insts = instances(lines, schema)
        protos = a.protocols.split(",")
        http_proto = next((x for x in protos if x not in GRPC), "lines")   # floor, patches
        batches = [int(b) for b in a.batches.split(",")]
        for b in batches:
            arr, arr_cpu, lin, lin_cpu = in_process(os.path.join(folder, "full-000001.h5"),
                                                    lines, schema, b, 3)
            res["in_process"][b] = {"predict_arrays": round(arr), "predict_lines": round(lin),
                                    "predict_arrays_per_cpu_s": round(arr_cpu),
                                    "predict_lines_per_cpu_s": round(lin_cpu)}
            print(f"in-process batch {b}: predict_arrays {arr:,.0f} inst/s ({arr_cpu:,.0f} per "
                  f"CPU-second), predict_lines {lin:,.0f} inst/s ({lin_cpu:,.0f} per CPU-second)",
                  flush=True)
        if a.floor:
            proc, port = start_floor()
            try:
                reqs = bodies(lines, insts, 1, http_proto, "ctr")
                for client in clients:
                    out = load(port, reqs, "open", a.rate, 32, a.seconds, a.max_requests,
                               **client_kw(client))
                    r = summary(*out, 1)
                    r.update(processes=0, protocol="floor", batch=1, mode="open", rate=a.rate,
                             client=client)
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
        roots = [os.path.abspath(r) for r in a.roots.split(",") if r]
        for rnd, root, procs in [(k, r, int(p)) for k in range(a.rounds) for r in roots
                                 for p in a.processes.split(",") if p]:
            proc, port, gport = start(folder, procs, "ctr", grpc=bool(GRPC & set(protos)),
                                      root=root)
            try:
                res.setdefault("pss_mb", {})[procs] = pss_mb(proc.pid)
                print(f"server processes {procs} round {rnd} {root}: PSS "
                      f"{res['pss_mb'][procs]} MB", flush=True)
                for proto in protos:
                    for b in batches:
                        reqs = bodies(lines, insts, b, proto, "ctr")
                        runs = [("closed", None, "select")] + \
                            ([("open", a.rate, c) for c in clients] if b == 1 else [])
                        for mode, rate, client in runs:
                            c0 = cpu_seconds(proc.pid)
                            fn = load_grpc if proto == "grpcio" else load
                            out = fn(gport if proto in GRPC else port, reqs, mode, rate or 0,
                                     a.concurrency if mode == "closed" else 32, a.seconds,
                                     a.max_requests, **client_kw(client),
                                     **({"conn": _GrpcConn} if proto == "grpc" else {}))
                            cpu = cpu_seconds(proc.pid) - c0
                            r = summary(*out, b)
                            r.update(processes=procs, protocol=proto, batch=b, mode=mode,
                                     root=root, round=rnd, rate=rate, client=client,
                                     server_cpu_us_per_request=round(
                                         cpu / max(1, len(out[0])) * 1e6))
                            res["runs"].append(r)
                            print(json.dumps(r), flush=True)
                res.setdefault("pss_mb_after", {})[procs] = pss_mb(proc.pid)
                print(f"server processes {procs}: PSS {res['pss_mb_after'][procs]} MB after "
                      "the runs", flush=True)
            finally:
                proc.terminate()
                res.setdefault("exit_codes", {})[procs] = proc.wait(60)
        if a.patch_seconds > 0:                 # last: it moves the folder on
            proc, port, _ = start(folder, a.patch_processes, "ctr")
            try:
                reqs = bodies(lines, insts, 1, http_proto, "ctr")
                ctx = multiprocessing.get_context("fork")
                staging = os.path.join(tmp, "staging")
                staged = stage_patches(folder, staging, m, keys, int(a.patch_seconds) + 5)
                for mode in ("open steady", "open+patches"):    # the same server, in turn
                    stop, count = ctx.Event(), ctx.Value("i", 0)
                    t = ctx.Process(target=patcher, args=(folder, staging, staged, stop, 1.0,
                                                          count))
                    if mode == "open+patches":
                        t.start()
                    c0 = cpu_seconds(proc.pid)
                    out = load(port, reqs, "open", a.rate, 32, a.patch_seconds, a.max_requests,
                               **client_kw(clients[0]))
                    cpu = cpu_seconds(proc.pid) - c0
                    r = summary(*out, 1)
                    stop.set()
                    if mode == "open+patches":
                        t.join()
                    r.update(processes=a.patch_processes, protocol=http_proto, batch=1,
                             mode=mode, rate=a.rate, client=clients[0], patches=count.value,
                             server_cpu_us_per_request=round(cpu / max(1, len(out[0])) * 1e6))
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
            finally:
                proc.terminate()
                res.setdefault("exit_codes", {})["patches"] = proc.wait(60)
        if a.rounds > 1 or len(roots) > 1:
            medians(res["runs"])
    finally:
        res["loadavg"] = os.getloadavg()
        print(f"load average {res['loadavg']}", flush=True)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
