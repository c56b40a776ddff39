"""`python -m mpips.serve` spoken to by real clients (issue 49): Triton's own client over
HTTP (its defaults: the binary tensor data extension) and gRPC, raw binary requests and
their edge cases, and the gRPC port's own fuzz; servers are subprocesses (``Server``).

The reference is ``Predictor.predict_lines`` on the same rows in the same batches (a
row's last bit can move with the batch's shape): the binary tensors score through the
array path, JSON and integer tensors through lines, and all of them equal it bit for bit.
"""
import http.client
import json
import os
import random
import re
import signal
import struct
import urllib.request

import numpy as np
import pytest
from google.protobuf import json_format

from mpips.serving import Predictor
from tests import serve_models as sm
from tests.test_serve import NAMES, Server

th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")

BATCH = 100          # rows per request (small enough that BLAS runs one thread everywhere)
VERSION = "ckpt-000001-base"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Criteo bundle and its rows (MPIPS_SERVE_ROWS: as many; the issue's 10,000 by
    hand), the reference scores batch by batch."""
    out = tmp_path_factory.mktemp("clients")
    lines = sm.criteo_lines(int(os.environ.get("MPIPS_SERVE_ROWS", "400")), seed=2)
    data = sm.criteo_data()
    bundle = str(out / "model.h5")
    sm.write_full(bundle, sm.ids_of(lines, sm.criteo_schema(), data), sm.criteo_schema(), data)
    p = Predictor(bundle)
    ref = np.concatenate([p.predict_lines(lines[lo:lo + BATCH])
                          for lo in range(0, len(lines), BATCH)])
    return {"bundle": bundle, "lines": lines, "ref": ref, "predictor": p}


@pytest.fixture(scope="module")
def server(model):
    s = Server("--bundle", model["bundle"], "--grpc-port", "0", "--max-instances", "500",
               "--processes", os.environ.get("MPIPS_SERVE_PROCESSES", "1"))
    s.grpc = int(s.ready.split(" grpc 127.0.0.1:")[1].split()[0])
    yield s
    assert s.stop() == 0


def columns(lines):
    """(name, numpy column) of each input: FP32 with NaN for an empty I field, BYTES."""
    fields = [x.split("\t")[1:] for x in lines]
    out = []
    for k, name in enumerate(NAMES):
        col = [f[k] for f in fields]
        if name[0] == "I":
            out.append((name, np.array([float(v) if v else np.nan for v in col], np.float32)))
        else:
            out.append((name, np.array([v.encode() for v in col], dtype=np.object_)))
    return out


def triton_inputs(mod, lines, binary=True):
    ins = []
    for name, col in columns(lines):
        t = mod.InferInput(name, [len(col)], "FP32" if col.dtype == np.float32 else "BYTES")
        if mod is th:
            t.set_data_from_numpy(col, binary_data=binary)
        else:
            t.set_data_from_numpy(col)
        ins.append(t)
    return ins


def batches(model):
    lines = model["lines"]
    return [lines[lo:lo + BATCH] for lo in range(0, len(lines), BATCH)]


def test_tritonclient_http_defaults_and_json_equal_predictor(server, model):
    c = th.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("ctr")
        assert "binary_tensor_data" in c.get_server_metadata()["extensions"]
        meta = c.get_model_metadata("ctr")
        assert meta["versions"] == [VERSION] and [x["name"] for x in meta["inputs"]] == NAMES
        config = c.get_model_config("ctr")
        assert config["max_batch_size"] == 500 and [x["name"] for x in config["input"]] == NAMES
        got = {True: [], False: []}
        for part in batches(model):
            for binary in (True, False):
                out = None if binary else [th.InferRequestedOutput("probability", False)]
                r = c.infer("ctr", triton_inputs(th, part, binary), outputs=out)
                assert r.get_response()["model_version"] == VERSION
                assert ("parameters" in r.get_output("probability")) == binary
                got[binary].append(r.as_numpy("probability"))
        for binary in (True, False):
            assert np.array_equal(np.concatenate(got[binary]), model["ref"]), binary
    finally:
        c.close()


def test_tritonclient_grpc_equals_predictor_with_version(server, model):
    c = tg.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    try:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("ctr")
        assert not c.is_model_ready("ctr", "ckpt-000009-delta")
        meta = c.get_model_metadata("ctr", as_json=True)
        assert meta["versions"] == [VERSION] and [x["name"] for x in meta["inputs"]] == NAMES
        # ModelConfig: the HTTP /config answer read into Triton's own ModelConfig message
        config = c.get_model_config("ctr").config
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v2/models/ctr/config",
                                    timeout=30) as r:
            want = json_format.ParseDict(json.loads(r.read()), type(config)())
        assert config == want and config.max_batch_size == 500, config
        assert [x.name for x in config.input] == NAMES and config.output[0].data_type == 11
        assert config.input[0].data_type == 11 and config.input[-1].data_type == 13
        assert c.get_model_config("ctr", VERSION).config == want
        with pytest.raises(Exception, match="unknown model version"):
            c.get_model_config("ctr", "ckpt-000009-delta")
        got = []
        for part in batches(model):
            r = c.infer("ctr", triton_inputs(tg, part), request_id="q7")
            assert r.get_response().model_version == VERSION and r.get_response().id == "q7"
            got.append(r.as_numpy("probability"))
        assert np.array_equal(np.concatenate(got), model["ref"])
        with pytest.raises(Exception, match="unknown model 'other'"):
            c.infer("other", triton_inputs(tg, model["lines"][:2]))
    finally:
        c.close()


def grpc_call(server, method, request, resp_cls):
    """(response or None, status code, details, model-version) of one raw gRPC call."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        fn = ch.unary_unary(f"/inference.GRPCInferenceService/{method}",
                            request_serializer=lambda b: b,
                            response_deserializer=resp_cls.FromString)
        try:
            resp, call = fn.with_call(request, timeout=30)
            code, details, trailing = grpc.StatusCode.OK, "", call.trailing_metadata()
        except grpc.RpcError as e:
            resp, code, details, trailing = None, e.code(), e.details(), e.trailing_metadata()
    return resp, code, details, dict(trailing or ()).get("model-version")


def raw_request(inputs, model_name="ctr"):
    """A serialized ModelInferRequest of (name, datatype, shape, raw bytes)."""
    from mpips.serving.proto import kserve_v2_pb2 as pb
    T = pb.ModelInferRequest.InferInputTensor
    return pb.ModelInferRequest(
        model_name=model_name, inputs=[T(name=n, datatype=d, shape=s) for n, d, s, _ in inputs],
        raw_input_contents=[r for *_, r in inputs]).SerializeToString()


def blob(values):
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def test_grpc_version_on_every_answer_and_typed_contents(server, model):
    from mpips.serving.proto import kserve_v2_pb2 as pb
    resp, code, _, version = grpc_call(server, "ServerReady", b"", pb.ServerReadyResponse)
    assert resp.ready and code == grpc.StatusCode.OK and version == VERSION
    part = model["lines"][:BATCH]
    cols = columns(part)
    T = pb.ModelInferRequest.InferInputTensor
    typed = []
    for name, col in cols:          # typed contents; the dense values as INT64 (lines path)
        if name[0] == "I":
            keep = ~np.isnan(col)
            typed.append(T(name=name, datatype="FP32", shape=[len(col)],
                           contents=pb.InferTensorContents(fp32_contents=col.tolist()))
                         if not keep.all() else
                         T(name=name, datatype="INT64", shape=[len(col)],
                           contents=pb.InferTensorContents(int64_contents=col.astype(int).tolist())))
        else:
            typed.append(T(name=name, datatype="BYTES", shape=[len(col)],
                           contents=pb.InferTensorContents(bytes_contents=list(col))))
    req = pb.ModelInferRequest(model_name="ctr", inputs=typed).SerializeToString()
    resp, code, details, version = grpc_call(server, "ModelInfer", req, pb.ModelInferResponse)
    assert code == grpc.StatusCode.OK, details
    got = np.frombuffer(resp.raw_output_contents[0], "<f4")
    assert np.array_equal(got, model["ref"][:BATCH]) and version == VERSION
    bad = raw_request([("C1", "BYTES", [2], blob([b"ab"]) + b"\x09\x00\x00\x00xy")])
    resp, code, details, version = grpc_call(server, "ModelInfer", bad, pb.ModelInferResponse)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and version == VERSION
    assert "inputs[0] (C1)" in details and "past the end" in details


def post_binary(server, head, tail, header_length=None):
    body = json.dumps(head).encode()
    hl = str(len(body)) if header_length is None else header_length
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.request("POST", "/v2/models/ctr/infer", body + tail,
              {"Inference-Header-Content-Length": hl,
               "Content-Type": "application/octet-stream"})
    r = c.getresponse()
    out = r.read(), r.status, r.getheader("Model-Version"), \
        r.getheader("Inference-Header-Content-Length")
    c.close()
    return out


def test_binary_floats_and_missing_values_equal_the_lines_path(server, model):
    """Non-integer FP32 values and NaN (missing) by the array path equal the same values
    sent as JSON (null for NaN), which are scored through lines."""
    rng = np.random.default_rng(5)
    n = 50
    dense = rng.uniform(-3, 60, (n, 13)).astype(np.float32)
    dense[rng.random((n, 13)) < 0.2] = np.nan
    cats = [[f"{int(rng.integers(0, 40)) * 7919 + k:08x}".encode() if rng.random() > 0.1
             else b"" for _ in range(n)] for k in range(26)]
    inputs, tail, js = [], b"", []
    for j, name in enumerate(NAMES):
        raw = dense[:, j].tobytes() if j < 13 else blob(cats[j - 13])
        dt = "FP32" if j < 13 else "BYTES"
        inputs.append({"name": name, "datatype": dt, "shape": [n],
                       "parameters": {"binary_data_size": len(raw)}})
        tail += raw
        data = [None if v != v else float(v) for v in dense[:, j]] if j < 13 else \
            [c.decode() for c in cats[j - 13]]
        js.append({"name": name, "datatype": dt, "shape": [n], "data": data})
    body, status, version, hl = post_binary(
        server, {"inputs": inputs, "parameters": {"binary_data_output": True}}, tail)
    assert status == 200 and version == VERSION and hl is not None
    got = np.frombuffer(body[int(hl):], "<f4")
    body, status, _, hl2 = post_binary(server, {"inputs": js}, b"", header_length="")
    assert status == 400                                   # "" is not a length
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.request("POST", "/v2/models/ctr/infer", json.dumps({"inputs": js}),
              {"Content-Type": "application/json"})
    want = json.loads(c.getresponse().read())["outputs"][0]["data"]
    c.close()
    assert len(got) == n and np.array_equal(got, np.array(want, np.float32))
    tail64 = b"".join(dense[:, j].astype("<f8").tobytes() for j in range(13)) + tail[13 * 4 * n:]
    inputs64 = [dict(t, datatype="FP64", parameters={"binary_data_size": 8 * n})
                for t in inputs[:13]] + inputs[13:]
    body, status, _, hl = post_binary(
        server, {"inputs": inputs64, "parameters": {"binary_data_output": True}}, tail64)
    assert status == 200 and np.array_equal(np.frombuffer(body[int(hl):], "<f4"), got)


@pytest.mark.parametrize("case,words", [
    ("sizes_short", "inputs[1] (C2).parameters.binary_data_size: 13 bytes, but only 12"),
    ("sizes_long", "1 bytes after the binary tensors"),
    ("negative_header", "Inference-Header-Content-Length: '-5'"),
    ("large_header", "is not a length within the body"),
    ("bytes_past_end", "inputs[1] (C2): the 4-byte length of element 1"),
    ("bytes_trailing", "inputs[1] (C2): bytes left after the 2 elements"),
    ("fp32_size", "inputs[0] (I1): 12 bytes of binary data for shape [2] of FP32"),
    ("bytes_tab", "inputs[1] (C2): element 0 holds a tab"),
    ("bad_size", "inputs[0] (I1).parameters.binary_data_size: expected a byte count"),
])
def test_binary_edge_cases_are_400_naming_the_input(server, case, words):
    dense = np.array([1.0, 2.0], np.float32).tobytes()
    cats = blob([b"ab", b"cd"])
    sizes = {"sizes_short": (8, len(cats) + 1), "sizes_long": (8, len(cats)),
             "fp32_size": (12, len(cats)), "bad_size": ("8", len(cats))}.get(case, (8, len(cats)))
    tail = dense + cats
    if case == "sizes_long":
        tail += b"x"
    elif case == "fp32_size":
        tail = dense + b"\0" * 4 + cats
    elif case == "bytes_past_end":
        cats = blob([b"ab"]) + b"\x09\0\0\0xy"
        tail, sizes = dense + cats, (8, len(cats))
    elif case == "bytes_trailing":
        cats = blob([b"ab", b"cd"]) + b"z"
        tail, sizes = dense + cats, (8, len(cats))
    elif case == "bytes_tab":
        cats = blob([b"a\tb", b"cd"])
        tail, sizes = dense + cats, (8, len(cats))
    head = {"inputs": [{"name": "I1", "datatype": "FP32", "shape": [2],
                        "parameters": {"binary_data_size": sizes[0]}},
                       {"name": "C2", "datatype": "BYTES", "shape": [2],
                        "parameters": {"binary_data_size": sizes[1]}}]}
    hl = {"negative_header": "-5", "large_header": "999999"}.get(case)
    body, status, version, _ = post_binary(server, head, tail, hl)
    assert status == 400, body
    assert words in json.loads(body)["error"], body
    assert version == VERSION


def test_grpc_fuzz_answers_statuses_and_stays_ready(server, model):
    """Mutated ModelInfer requests (MPIPS_SERVE_FUZZ of them, default 300): every answer a
    gRPC status (OK or an error the server chose), the server ready after."""
    from mpips.serving.proto import kserve_v2_pb2 as pb
    part = model["lines"][:3]
    good = raw_request([(n, "FP32" if n[0] == "I" else "BYTES", [3],
                         col.tobytes() if n[0] == "I" else blob(list(col)))
                        for n, col in columns(part)])
    rng = random.Random(11)
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
    codes = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        fn = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                            request_serializer=lambda b: b,
                            response_deserializer=pb.ModelInferResponse.FromString)
        for _ in range(int(os.environ.get("MPIPS_SERVE_FUZZ", "300"))):
            b = bytearray(good)
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(len(b))
                if rng.random() < 0.6:
                    b[i] = rng.randrange(256)
                else:
                    del b[i:i + rng.randint(1, 8)]
            try:
                fn(bytes(b), timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            codes[code] = codes.get(code, 0) + 1
            assert code in allowed, (code, bytes(b)[:200])
    assert codes.get(grpc.StatusCode.OK, 0) > 5 and len(codes) > 1, codes
    resp, code, _, _ = grpc_call(server, "ServerReady", b"", pb.ServerReadyResponse)
    assert code == grpc.StatusCode.OK and resp.ready


def test_bench_raw_grpc_client_counts_like_grpcio(server, model):
    """bench/bench_serve.py's raw HTTP/2 gRPC client (prebuilt frames, its own HPACK
    reading of grpc-status) on a mix of good and bad calls, 200 rows a call (flow control:
    more than one DATA frame): as many OK and failed as grpcio's client counts on the same
    calls, and the last answer's scores equal the Predictor's."""
    import importlib.util
    from mpips.serving.proto import kserve_v2_pb2 as pb
    spec = importlib.util.spec_from_file_location(
        "bench_serve", os.path.join(os.path.dirname(__file__), "..", "bench", "bench_serve.py"))
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    part = model["lines"][:200]
    good = raw_request([(n, "FP32" if n[0] == "I" else "BYTES", [200],
                         col.tobytes() if n[0] == "I" else blob(list(col)))
                        for n, col in columns(part)])
    bad = raw_request([("I1", "FP32", [1], b"\0\0\0\0")], model_name="other")
    calls = [good, bad, good, good, bad, good] * 3
    want = {True: 0, False: 0}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        fn = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                            request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for c in calls:
            try:
                fn(c, timeout=30)
                want[True] += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND
                want[False] += 1
    lat, fails, issued, _ = bs.load(server.grpc, calls, "closed", 0, 1, 60, len(calls),
                                    conn=bs._GrpcConn)
    assert (issued, len(lat), fails) == (len(calls), want[True], want[False]) == (18, 12, 6)
    assert list(bs.ERRORS) == ["grpc-status 5 unknown model 'other'; this server serves "
                               "'ctr'"] and sum(bs.ERRORS.values()) == 6
    bs.ERRORS.clear()
    c = bs._GrpcConn(server.grpc)                  # one good call: its answer read back
    c.send(good)
    c.sock.settimeout(30)                          # an ack sent while reading keeps it
    got = []
    while not got:
        got = c.answers(c.sock.recv(1 << 16))
    c.sock.close()
    r = pb.ModelInferResponse.FromString(c.last)
    assert got == [(True, None)] and r.model_version == VERSION
    assert np.array_equal(np.frombuffer(r.raw_output_contents[0], "<f4"),
                          model["predictor"].predict_lines(part))


def scrape(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return text


def sample(text, name):
    """The value of the sample line starting with ``name`` (0 when there is none)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_are_summed_over_two_processes(model):
    """--processes 2: every scrape, whichever process answers it, counts every request
    sent to either (HTTP, each on a new connection, and gRPC), and shows both processes'
    gauges."""
    srv = Server("--bundle", model["bundle"], "--grpc-port", "0", "--processes", "2")
    try:
        grpc_port = int(srv.ready.split(" grpc 127.0.0.1:")[1].split()[0])
        body = {"instances": [{"I1": 3, "C1": "68fd1e64"}, {"C2": "80e26c9b"}]}
        n_http, n_grpc, n_bad = 40, 15, 5
        for _ in range(n_http):
            assert srv.call("POST", "/v1/models/ctr:predict", body)[0] == 200
        for _ in range(n_bad):
            assert srv.call("POST", "/v1/models/ctr:predict", {"rows": 1})[0] == 400
        c = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for _ in range(n_grpc):
            c.infer("ctr", triton_inputs(tg, model["lines"][:3]))
        c.close()
        def scraped():                   # one scrape: every count is the sum; who answered
            text = scrape(srv.port)
            assert sample(text, 'mpips_requests_total{code="200",endpoint="v1_predict"}') == \
                n_http, text
            assert sample(text, 'mpips_requests_total{code="400",endpoint="v1_predict"}') == n_bad
            assert sample(text, 'mpips_requests_total{code="OK",endpoint="grpc_infer"}') == n_grpc
            assert sample(text, "mpips_instances_total") == 2 * n_http + 3 * n_grpc
            assert sample(text, 'mpips_request_seconds_count{endpoint="v1_predict"}') == \
                n_http + n_bad
            seqs = [x for x in text.splitlines() if x.startswith("mpips_model_version_seq{")]
            assert len(seqs) == 2 and {'process="0"' in x for x in seqs} == {True, False}, seqs
            pids = {int(re.search(r'process="(\d+)"', x)[1]): int(re.search(r'pid="(\d+)"', x)[1])
                    for x in seqs}
            return int(sample(text, "mpips_process_index")), pids

        first, pids = scraped()
        os.kill(pids[first], signal.SIGSTOP)     # the kernel can only hand the next to the other
        try:
            other, _ = scraped()
        finally:
            os.kill(pids[first], signal.SIGCONT)
        assert {first, other} == {0, 1}          # both processes answered, each the sum
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("raw,code", [
    (b"POST /v2/health/live HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    (b"POST /v2/health/live HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", 400),
    (b"GET /v2/health/live HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    (b"GET /v2/health/live HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET http://other/v2/health/live HTTP/1.1\r\n\r\n", 400),
    (b"GET /v2/health/live HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"GET /v2/health/live HTTP/1.1\r\nX: " + b"a" * 40000, 431),
])
def test_hostile_heads_on_llhttp(server, raw, code):
    """Requests read two ways by two parsers (the smuggling kind) are refused, the
    connection closed, and the server stays ready."""
    import socket
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw)
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 %d" % code), head[:200]
        assert b"Connection: close" in head
    assert server.call("GET", "/v2/health/ready")[0] == 200


def test_builtin_parser_still_serves(model):
    srv = Server("--bundle", model["bundle"], "--http-parser", "builtin")
    try:
        part = model["lines"][:BATCH]
        s, v, body = srv.call("POST", "/v1/models/ctr:lines", "\n".join(part), "text/plain")
        assert s == 200 and v == VERSION
        assert np.array_equal(np.array(body.decode().split(), np.float32), model["ref"][:BATCH])
    finally:
        assert srv.stop() == 0


def test_grpc_layout_seen_before_scores_and_checks_as_the_first(model):
    """In process (``GrpcV2.call``): ModelInfer requests of one layout (the same names,
    types, shapes and outputs: after the first, a layout already checked, ``Layout``) score
    equal ``Predictor`` batch by batch and echo their ids; one of that layout whose dense
    tensor has a byte too few, or whose BYTES run past the end, is refused with the same
    status and message as when it comes first (before its layout is known); at most
    ``LAYOUTS`` layouts are kept."""
    from mpips.serving.api import Api, Metrics
    from mpips.serving.grpc_v2 import LAYOUTS, GrpcV2
    from mpips.serving.live import Live
    from mpips.serving.proto import kserve_v2_pb2 as pb
    path = "/inference.GRPCInferenceService/ModelInfer"

    def servicer():
        live = Live(model["bundle"], None, None, lambda s: None)
        return GrpcV2(Api(live, "ctr", Metrics(live), 500))

    def request(part, rid, cut=None, bad_bytes=False):
        inputs = []
        for name, col in columns(part):
            if col.dtype == np.float32:
                raw = col.astype("<f4").tobytes()
                inputs.append((name, "FP32", [len(col)], raw[:cut] if name == "I3" else raw))
            else:
                raw = blob(list(col))
                inputs.append((name, "BYTES", [len(col)], raw + b"\x09\x00\x00\x00xy"
                               if bad_bytes and name == "C2" else raw))
        msg = pb.ModelInferRequest.FromString(raw_request(inputs))
        msg.id = rid
        return msg.SerializeToString()

    rpc = servicer()
    parts = batches(model)
    got = []
    for j, part in enumerate(parts + parts):          # every batch twice: hits after the first
        out, code, text, version = rpc.call(path, request(part, f"r{j}"))
        resp = pb.ModelInferResponse.FromString(out)
        assert code == "OK" and resp.id == f"r{j}" and version == VERSION
        got.append(np.frombuffer(resp.raw_output_contents[0], "<f4"))
    assert np.array_equal(np.concatenate(got), np.concatenate([model["ref"]] * 2))
    layouts = rpc.api.live.current._grpc_layouts
    assert len(layouts) == 1                           # the batches share one layout
    for kw in ({"cut": -1}, {"bad_bytes": True}):       # as a first request, then as a hit
        first = servicer().call(path, request(parts[0], "x", **kw))
        later = rpc.call(path, request(parts[0], "x", **kw))
        assert first[0] is None and first[1] == "INVALID_ARGUMENT" and first[1:] == later[1:]
        assert ("(I3)" if "cut" in kw else "(C2)") in first[2], first
    for rows in range(1, LAYOUTS + 10):                # a new layout each (rows): bounded
        assert rpc.call(path, request(model["lines"][:rows], "n"))[1] == "OK"
    assert len(layouts) == LAYOUTS
