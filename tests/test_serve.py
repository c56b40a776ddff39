"""`python -m mpips.serve` over HTTP on 127.0.0.1 (issue 32).

The reference is ``Predictor`` on the same rows: each protocol (KServe V2, TF-Serving
``:predict`` by instances and by columns, raw lines) scores generated rows as it does, bit
for bit (the same batch through the same parsers and forward pass).  Following an export
folder, every answer's version is checked against that version's own scores while patches
land; a corrupt patch is refused while the old version keeps answering; SIGTERM finishes
a request in flight and exits 0; each 4xx path is named; a small fuzz gets 2xx/4xx only.
"""
import http.client
import json
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mpips.schema import load_schema
from mpips.serving import Predictor
from tests import serve_models as sm
from tests.conftest import MPI_ENV, ROOT

pytest.importorskip("prometheus_client")

NAMES = [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)]
CSV_SCHEMA = """format = "csv"
header = true
label = "click"
[[dense]]
names = ["price", "age"]
norm = "minmax"
[[sparse]]
names = ["site", "app"]
[[sparse]]
names = ["tags"]
separator = "|"
pooling = "mean"
"""
CSV_HEADER = "click,price,age,site,app,tags"


class Server:
    """``python -m mpips.serve ARGS --port 0`` and its URL, read from the ready line."""

    def __init__(self, *args, deadline=120.0):
        env = dict(os.environ, **MPI_ENV)
        self.proc = subprocess.Popen([sys.executable, "-m", "mpips.serve", "--port", "0",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=str(ROOT), env=env,
                                     stdin=subprocess.DEVNULL)
        self.log = []
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + deadline
        line = ""
        while "ready" not in line:
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None or not sel.select(left):
                self.proc.kill()
                pytest.fail(f"server not ready: {self.proc.stderr.read()[-2000:]}")
            line = self.proc.stdout.readline()
            self.log.append(line)
        self.ready = line
        self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def conn(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def call(self, method, path, body=None, ctype="application/json", conn=None):
        c = conn or self.conn()
        data = body if body is None or isinstance(body, bytes) else \
            (body.encode() if isinstance(body, str) else json.dumps(body).encode())
        headers = {"Content-Type": ctype} if ctype else {}
        c.request(method, path, data, headers)
        r = c.getresponse()
        out = r.read()
        if conn is None:
            c.close()
        return r.status, r.getheader("Model-Version"), out

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def instance(line):
    """The TF-Serving instance of a Criteo TSV line (label dropped, empty fields left out)."""
    out = {}
    for n, v in zip(NAMES, line.split("\t")[1:]):
        if v:
            out[n] = int(v) if n[0] == "I" else v
    return out


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """A Criteo bundle, an export folder (full + 3 patches committed one by one later),
    and 600 labelled rows (MPIPS_SERVE_ROWS: as many; the issue's 10,000 run by hand)."""
    out = tmp_path_factory.mktemp("serve")
    lines = sm.criteo_lines(int(os.environ.get("MPIPS_SERVE_ROWS", "600")), seed=1)
    data = sm.criteo_data()
    keys = sm.ids_of(lines, sm.criteo_schema(), data)
    bundle = str(out / "model.h5")
    m = sm.write_full(bundle, keys, sm.criteo_schema(), data)
    folder = out / "exports"
    folder.mkdir()
    shutil.copy(bundle, folder / "full-000001.h5")
    patches = []
    for k in range(2, 5):
        m = sm.write_patch(str(out / f"patch-{k:06d}.h5"), m, keys, seed=k, seq=k)
        patches.append(str(out / f"patch-{k:06d}.h5"))
    sm.commit(str(folder), ["full-000001.h5"])
    return {"bundle": bundle, "lines": lines, "folder": str(folder), "patches": patches,
            "keys": keys}


@pytest.fixture(scope="module")
def server(criteo):
    """One server process (MPIPS_SERVE_PROCESSES=2 runs the module's tests of it, the
    fuzz among them, against two forked processes: a check by hand)."""
    s = Server("--bundle", criteo["bundle"], "--max-instances", "300",
               "--max-body-bytes", "200000",
               "--processes", os.environ.get("MPIPS_SERVE_PROCESSES", "1"))
    yield s
    assert s.stop() == 0


def test_ready_line_and_health(server, criteo):
    assert "model ctr version ckpt-000001-base rows" in server.ready
    assert f"rows {len(criteo['keys'])} " in server.ready and "format criteo" in server.ready
    assert server.call("GET", "/v2/health/live")[2] == b'{"live": true}'
    status, version, body = server.call("GET", "/v2/health/ready")
    assert status == 200 and json.loads(body) == {"ready": True}
    assert version == "ckpt-000001-base"
    meta = json.loads(server.call("GET", "/v2/models/ctr")[2])
    assert meta["versions"] == ["ckpt-000001-base"]
    assert [x["name"] for x in meta["inputs"]] == NAMES
    assert json.loads(server.call("GET", "/v2/models/ctr/ready")[2])["ready"] is True
    tf = json.loads(server.call("GET", "/v1/models/ctr")[2])
    assert tf["model_version_status"][0]["state"] == "AVAILABLE"


def test_each_protocol_equals_predictor(server, criteo):
    p = Predictor(criteo["bundle"])
    lines = criteo["lines"]
    # the same batches: a row's last bit can move with the batch's shape (docs/serving.md)
    ref = np.concatenate([p.predict_lines(lines[lo:lo + 200]) for lo in range(0, len(lines), 200)])
    conn = server.conn()
    got_tf, got_cols, got_v2, got_lines = [], [], [], []
    for lo in range(0, len(lines), 200):
        part = lines[lo:lo + 200]
        insts = [instance(x) for x in part]
        s, v, body = server.call("POST", "/v1/models/ctr:predict", {"instances": insts},
                                 conn=conn)
        assert s == 200 and json.loads(body)["model_version"] == v == "ckpt-000001-base"
        got_tf += json.loads(body)["predictions"]
        cols = {n: [x.get(n) for x in insts] for n in NAMES}
        s, _, body = server.call("POST", "/v1/models/ctr:predict", {"inputs": cols}, conn=conn)
        got_cols += json.loads(body)["predictions"]
        tensors = [{"name": n, "shape": [len(part)],
                    "datatype": "FP32" if n[0] == "I" else "BYTES",
                    "data": [x.get(n) for x in insts]}           # null: empty
                   for n in NAMES]
        s, _, body = server.call("POST", "/v2/models/ctr/infer", {"id": "r1", "inputs": tensors},
                                 conn=conn)
        out = json.loads(body)
        assert s == 200 and out["id"] == "r1" and out["model_version"] == "ckpt-000001-base"
        got_v2 += out["outputs"][0]["data"]
        s, _, body = server.call("POST", "/v1/models/ctr:lines", "\n".join(part) + "\n",
                                 ctype="text/plain", conn=conn)
        assert s == 200
        got_lines += [float(x) for x in body.decode().split()]
    for got in (got_tf, got_cols, got_v2, got_lines):
        assert np.array_equal(np.array(got, np.float32), ref)
    conn.close()


def test_raw_lines_without_label_and_bad_lines(server, criteo):
    p = Predictor(criteo["bundle"])
    lines = criteo["lines"][:5]
    no_label = [x.split("\t", 1)[1] for x in lines]
    s, _, body = server.call("POST", "/v1/models/ctr:lines", "\n".join(no_label), "text/plain")
    assert s == 200
    assert np.array_equal(np.array(body.decode().split(), np.float32), p.predict_lines(lines))
    bad = [lines[0], "1\tnot a line", lines[1]]
    s, _, body = server.call("POST", "/v1/models/ctr:lines", "\n".join(bad), "text/plain")
    assert s == 400 and "line 1 of 3" in json.loads(body)["error"]
    s, _, body = server.call("POST", "/v1/models/ctr:lines?errors=nan", "\n".join(bad),
                             "text/plain")
    vals = body.decode().split()
    ref = p.predict_lines(bad, errors="nan")                     # the same batch
    assert s == 200 and vals[1] == "nan"
    assert np.array_equal(np.array(vals, np.float32), ref, equal_nan=True)


@pytest.mark.parametrize("path,body,ctype,status,words", [
    ("/v1/models/ctr:predict", "{not json", "application/json", 400, "not valid JSON"),
    ("/v1/models/ctr:predict", {"instances": [{"I2": "x"}]}, "application/json", 400,
     "instances[0].I2: expected a number"),
    ("/v1/models/ctr:predict", {"instances": [{"C1": 1.5}]}, "application/json", 400,
     "instances[0].C1: a sparse value is a string or an integer"),
    ("/v1/models/ctr:predict", {"instances": [{"C99": "a"}]}, "application/json", 400,
     "unknown input 'C99'"),
    ("/v1/models/ctr:predict", '{"instances": [{"I2": NaN}]}', "application/json", 400,
     "NaN is not a number JSON allows"),
    ("/v1/models/ctr:predict", '{"instances": [{"I2": 1e999}]}', "application/json", 400,
     "instances[0].I2: not a finite number"),
    ("/v1/models/ctr:predict", {"instances": [{"C1": "a\tb"}]}, "application/json", 400,
     "instances[0].C1: value"),
    ("/v1/models/ctr:predict", {"instances": [{"C1": ["a", "b"]}]}, "application/json", 400,
     "holds one value"),
    ("/v1/models/ctr:predict", {"instances": [{"I2": 1}] * 301}, "application/json", 413,
     "limit is 300"),
    ("/v1/models/ctr:predict", {"rows": []}, "application/json", 400, '"instances"'),
    ("/v1/models/ctr:predict", {"instances": [{"I2": 1}]}, "text/html", 415, "Content-Type"),
    ("/v1/models/other:predict", {"instances": []}, "application/json", 404, "unknown model"),
    ("/v2/models/ctr/infer", {"inputs": [{"name": "I2", "shape": [2], "datatype": "FP32",
                                          "data": [1.0]}]}, "application/json", 400,
     "inputs[0] (I2).data: 1 values for shape [2]"),
    ("/v2/models/ctr/infer", {"inputs": [{"name": "I2", "shape": [1], "datatype": "BYTES",
                                          "data": ["1"]}]}, "application/json", 400,
     "inputs[0] (I2).datatype"),
    ("/v2/models/ctr/infer", {"inputs": []}, "application/json", 400, "inputs:"),
    ("/v1/models/ctr:lines", "a\0b", "text/plain", 400, "NUL"),
    ("/nothing", "", None, 404, "no such endpoint"),
])
def test_bad_requests_get_4xx(server, path, body, ctype, status, words):
    s, version, out = server.call("POST", path, body, ctype)
    assert s == status, out
    assert words in json.loads(out)["error"]
    assert version == "ckpt-000001-base"
    assert server.call("GET", "/v2/health/ready")[0] == 200          # still serving


def test_http_layer_limits(server):
    s, _, out = server.call("GET", "/v1/models/ctr:predict")
    assert s == 405
    big = b'{"instances": [' + b" " * 200001 + b"]}"
    s, _, out = server.call("POST", "/v1/models/ctr:predict", big)
    assert s == 413 and "--max-body-bytes" in json.loads(out)["error"]
    for raw, code in ((b"GARBAGE\r\n\r\n", 400),
                      (b"POST /v1/models/ctr:predict HTTP/1.1\r\nTransfer-Encoding: chunked"
                       b"\r\n\r\n", 411),
                      (b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(raw)
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 %d" % code), head[:80]
    text = server.call("GET", "/metrics")[2].decode()
    if os.environ.get("MPIPS_SERVE_PROCESSES", "1") == "1":   # else: one process's counters
        assert 'mpips_requests_total{code="411",endpoint="http"} 1.0' in text
    assert "mpips_table_rows" in text and "mpips_request_seconds_bucket" in text


def test_fuzz_answers_2xx_or_4xx(server, criteo):
    """Mutated requests of each protocol (MPIPS_SERVE_FUZZ of them, default 400; the issue's
    5,000 run by hand): every answer a 2xx or a 4xx, the server ready after."""
    rng = random.Random(7)
    good = json.dumps({"instances": [instance(x) for x in criteo["lines"][:3]]})
    v2 = json.dumps({"inputs": [{"name": "C3", "shape": [1], "datatype": "BYTES",
                                 "data": ["abc"]}]})
    paths = ["/v1/models/ctr:predict", "/v2/models/ctr/infer", "/v1/models/ctr:lines"]
    conn = server.conn()
    codes = {}
    for k in range(int(os.environ.get("MPIPS_SERVE_FUZZ", "400"))):
        base = rng.choice([good, v2, criteo["lines"][k % 50]])
        b = bytearray(base.encode())
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            i = rng.randrange(len(b) + 1)
            if op < 0.4 and b:
                b[min(i, len(b) - 1)] = rng.randrange(256)
            elif op < 0.7:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
            else:
                del b[i:i + rng.randint(1, 8)]
        try:
            s, _, _ = server.call("POST", rng.choice(paths), bytes(b),
                                  rng.choice(["application/json", "text/plain"]), conn=conn)
        except (http.client.HTTPException, OSError):
            conn.close()
            conn = server.conn()
            s = "closed"
        codes[s] = codes.get(s, 0) + 1
        assert s == "closed" or 200 <= s < 300 or 400 <= s < 500, (s, bytes(b)[:200])
    conn.close()
    assert codes.get(200, 0) > 10 and sum(v for c, v in codes.items() if c != 200) > 100
    assert server.call("GET", "/v2/health/ready")[0] == 200


def test_bags_and_missing_names_equal_predictor(tmp_path):
    """A CSV model with a bag column: instances (bags as lists, names left out) and raw
    lines score as Predictor scores the same CSV lines."""
    (tmp_path / "s.toml").write_text(CSV_SCHEMA)
    schema = load_schema(str(tmp_path / "s.toml"))
    data = {"data_format": "auto", "hash_bucket": 0, "cont_min": [10.0, 18.0],
            "cont_diff": [990.0, 62.0]}
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(300):
        r = {"price": round(float(rng.uniform(10, 1000)), 2), "age": int(rng.integers(18, 80)),
             "site": f"s{rng.integers(0, 20)}", "app": f"a{rng.integers(0, 50)}",
             "tags": [f"t{t}" for t in rng.choice(8, rng.integers(0, 4), replace=False)]}
        for name in ("age", "app"):
            if rng.random() < 0.2:
                del r[name]
        rows.append(r)
    lines = [",".join(["1", str(r["price"]), str(r.get("age", "")), r["site"], r.get("app", ""),
                       "|".join(r["tags"])]) for r in rows]
    bundle = str(tmp_path / "csv.h5")
    sm.write_full(bundle, sm.ids_of(lines, schema, data, CSV_HEADER), schema, data, dim=4,
                  fc="8")
    ref = Predictor(bundle, header=CSV_HEADER).predict_lines(lines)
    srv = Server("--bundle", bundle, "--header", CSV_HEADER, "--name", "ads")
    try:
        s, _, body = srv.call("POST", "/v1/models/ads:predict", {"instances": rows})
        assert s == 200, body
        assert np.array_equal(np.array(json.loads(body)["predictions"], np.float32), ref)
        s, _, body = srv.call("POST", "/v1/models/ads:lines", "\n".join(lines), "text/csv")
        assert np.array_equal(np.array(body.decode().split(), np.float32), ref)
        meta = json.loads(srv.call("GET", "/v2/models/ads")[2])
        assert [x["name"] for x in meta["inputs"]] == ["price", "age", "site", "app", "tags"]
        s, _, body = srv.call("POST", "/v2/models/ads/infer", {"inputs": [
            {"name": "price", "shape": [2, 1], "datatype": "FP64",
             "data": [[rows[0]["price"]], [rows[1]["price"]]]},
            {"name": "site", "shape": [2], "datatype": "BYTES",
             "data": [rows[0]["site"], rows[1]["site"]]},
            {"name": "tags", "shape": [2], "datatype": "BYTES",
             "data": [rows[0]["tags"], rows[1]["tags"]]}]})
        assert s == 200, body
        part = [{k: r[k] for k in ("price", "site", "tags")} for r in rows[:2]]
        s, _, body2 = srv.call("POST", "/v1/models/ads:predict", {"instances": part})
        assert json.loads(body)["outputs"][0]["data"] == json.loads(body2)["predictions"]
        s, _, body = srv.call("POST", "/v1/models/ads:predict",
                              {"instances": [{"tags": ["a|b"]}]})
        assert s == 400 and "instances[0].tags[0]" in json.loads(body)["error"]
    finally:
        assert srv.stop() == 0


def expected_by_version(criteo, insts):
    """{version: scores of insts} for the bundle and each patch applied in turn."""
    p = Predictor(criteo["bundle"])
    lines = ["\t".join(["0"] + [str(x.get(n, "")) for n in NAMES]) for x in insts]
    out = {p.version["name"]: p.predict_lines(lines)}
    for path in criteo["patches"]:
        p.apply(path)
        out[p.version["name"]] = p.predict_lines(lines)
    return out


def test_follow_swaps_atomically_and_refuses_a_corrupt_patch(criteo, tmp_path):
    folder = tmp_path / "exports"
    shutil.copytree(criteo["folder"], folder)
    insts = [instance(x) for x in criteo["lines"][:40]]
    want = expected_by_version(criteo, insts)
    srv = Server("--follow", str(folder), "--poll-seconds", "0.02")
    seen, errors, stop = [], [], threading.Event()

    def load():
        conn = srv.conn()
        n = 0
        while not stop.is_set() and n < 20000:
            n += 1
            s, v, body = srv.call("POST", "/v1/models/ctr:predict", {"instances": insts},
                                  conn=conn)
            out = json.loads(body)
            if s != 200 or out["model_version"] != v:
                errors.append((s, body[:200]))
                continue
            ok = np.array_equal(np.array(out["predictions"], np.float32), want[v])
            seen.append((v, ok))
        conn.close()
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        files = ["full-000001.h5"]

        def wait_for(version, deadline=60.0):
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                if srv.call("GET", "/v2/health/ready")[1] == version:
                    return
                time.sleep(0.01)          # polling a condition, bounded by the deadline
            pytest.fail(f"server never reached {version}: {''.join(srv.log)[-2000:]}")

        def answered(version, n=3, deadline=60.0):
            end = time.monotonic() + deadline
            while sum(v == version for v, _ in seen) < n and time.monotonic() < end:
                time.sleep(0.01)          # polling a condition, bounded by the deadline

        answered("ckpt-000001-base")
        for k, path in enumerate(criteo["patches"][:2], 2):
            shutil.copy(path, folder / os.path.basename(path))
            files.append(os.path.basename(path))
            sm.commit(str(folder), files)
            wait_for(f"ckpt-{k:06d}-delta")
            answered(f"ckpt-{k:06d}-delta")
        # a corrupt patch: a byte flipped on disk, committed with the true file's CRC
        last, name = criteo["patches"][2], os.path.basename(criteo["patches"][2])
        shutil.copy(last, folder / name)
        with open(folder / name, "r+b") as fh:
            fh.seek(os.path.getsize(last) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
        sm.commit(str(folder), files + [name], source={name: last})
        end = time.monotonic() + 60
        while not any("refused" in x for x in srv.log) and time.monotonic() < end:
            time.sleep(0.01)              # polling the log, bounded by the deadline
        assert any("refused" in x and "checksum" in x for x in srv.log), srv.log
        s, v, _ = srv.call("GET", "/v2/health/ready")
        assert s == 200 and v == "ckpt-000003-delta"
        text = srv.call("GET", "/metrics")[2].decode()
        assert 'mpips_reloads_total{result="refused"} 1.0' in text
        assert 'mpips_reloads_total{result="ok"} 2.0' in text
        assert "mpips_freshness_lag_seconds" in text
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        code = srv.stop()
    assert code == 0 and not errors
    versions = {v for v, _ in seen}
    assert versions == {"ckpt-000001-base", "ckpt-000002-delta", "ckpt-000003-delta"}, versions
    assert all(ok for _, ok in seen), [v for v, ok in seen if not ok][:5]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_sigterm_finishes_the_request_in_flight(criteo, processes):
    srv = Server("--bundle", criteo["bundle"], "--processes", processes)
    body = json.dumps({"instances": [instance(x) for x in criteo["lines"][:3]]}).encode()
    head = (b"POST /v1/models/ctr:predict HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head + body[:10])           # a request begun ...
        ok = srv.call("GET", "/v2/health/live")[0]
        srv.proc.send_signal(signal.SIGTERM)     # ... when the signal comes
        end = time.monotonic() + 30
        while time.monotonic() < end:            # the server stops listening: it has begun
            try:                                 # to stop, with our request half sent
                socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.01)                     # polling a condition, bounded
        else:
            pytest.fail("the server kept listening after SIGTERM")
        sock.sendall(body[10:])
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert ok == 200 and data.startswith(b"HTTP/1.1 200") and b"Connection: close" in data
    assert b'"predictions"' in data
    assert srv.proc.wait(30) == 0


def test_processes_share_the_table_each_swaps_and_a_crash_is_restarted(criteo, tmp_path):
    """--processes 2 (two processes forked by a master): one port, both processes answer,
    each takes the new version; the scores are Predictor's; a process killed is restarted
    at the version being served; SIGTERM ends all (exit 0)."""
    folder = tmp_path / "exports"
    shutil.copytree(criteo["folder"], folder)
    srv = Server("--follow", str(folder), "--processes", "2", "--poll-seconds", "0.02")
    insts = [instance(x) for x in criteo["lines"][:20]]
    want = expected_by_version(criteo, insts)

    def versions_by_process(n=200):
        seen = {}
        for _ in range(n):                 # new connections: either process may take one
            text = srv.call("GET", "/metrics")[2].decode()
            assert "\nmpips_process_index " in text, text[-3000:]
            idx = int(float(text.split("\nmpips_process_index ")[1].split()[0]))
            seen[idx] = text.split('mpips_model_info{version="')[1].split('"')[0]
            if len(seen) == 2 and len(set(seen.values())) == 1:
                break
        return seen

    def children():
        with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    try:
        assert "processes 2" in srv.ready and len(children()) == 2
        assert versions_by_process() == {0: "ckpt-000001-base", 1: "ckpt-000001-base"}
        name = os.path.basename(criteo["patches"][0])
        shutil.copy(criteo["patches"][0], folder / name)
        sm.commit(str(folder), ["full-000001.h5", name])
        end = time.monotonic() + 60
        while versions_by_process() != {0: "ckpt-000002-delta", 1: "ckpt-000002-delta"}:
            assert time.monotonic() < end, "the processes did not both swap"
        for _ in range(6):
            s, v, body = srv.call("POST", "/v1/models/ctr:predict", {"instances": insts})
            assert s == 200 and v == "ckpt-000002-delta"
            assert np.array_equal(np.array(json.loads(body)["predictions"], np.float32),
                                  want[v])
        victim = children()[0]
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 60
        while not any("restarting it" in x for x in srv.log):
            assert time.monotonic() < end, srv.log
            time.sleep(0.01)              # polling the log, bounded by the deadline
        assert any(f"(pid {victim}) ended (signal 9); restarting it" in x for x in srv.log)
        end = time.monotonic() + 60
        while versions_by_process() != {0: "ckpt-000002-delta", 1: "ckpt-000002-delta"}:
            assert time.monotonic() < end, "the restarted process does not answer"
        assert victim not in children() and len(children()) == 2
    finally:
        code = srv.stop(60)
    assert code == 0
