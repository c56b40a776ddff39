"""KServe V2 over gRPC (``--grpc-port``): the Open Inference Protocol's other transport.

Served from the same event loop as the HTTP server (``mpips.serving.grpc_wire``: HTTP/2
framing for unary calls; this module is the transport-free servicer), over the same scoring
core (``mpips.serving.v2.score``), the same model reference (``Live.current``, read once
per call: hot reload swaps it between two calls) and the same metrics.  Methods of
``inference.GRPCInferenceService``: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig (Triton's model configuration extension: the configuration
``GET /v2/models/{name}/config`` answers, as a ModelConfig message), ModelInfer (inputs
as ``raw_input_contents`` or typed ``contents``; the output ``probability`` FP32 in
``raw_output_contents``, as Triton answers).  Every answer
carries the version that made it: ``model_version`` in the infer answer, and the trailing
metadata ``model-version`` on every call, errors included.  A bad request is an
INVALID_ARGUMENT (NOT_FOUND for another model or version, RESOURCE_EXHAUSTED over
``--max-instances``) whose details name the field, as the HTTP 4xx does.

The messages are generated from ``proto/kserve_v2.proto`` (the command is in that file);
``GrpcV2.call(path, message)`` answers one unary call: the serialized answer, the gRPC
status name and message, and the version.
"""
import time

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from mpips.serving import v2
from mpips.serving.grpc_wire import GrpcConn
from mpips.serving.http import HttpServer
from mpips.serving.instances import BadInput
from mpips.serving.predictor import LineError
from mpips.serving.proto import kserve_v2_pb2 as pb

SERVICE = "inference.GRPCInferenceService"
# an HTTP-style error's status -> the gRPC status's name (grpc_wire.CODES: its number)
STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED"}
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
            "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
            "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def bytes_blob(values):
    """BYTES elements in the raw layout (a 4-byte little-endian length before each)."""
    return b"".join(len(b).to_bytes(4, "little") + b for b in values)


def request_inputs(req, raw):
    """The V2 input dicts (``v2.score``) of a ModelInferRequest whose raw_input_contents
    are ``raw`` (a list); every one raw."""
    if raw:
        if len(raw) != len(req.inputs):
            raise BadInput(f"raw_input_contents: {len(raw)} entries for {len(req.inputs)} "
                           "inputs (one per input, in order)")
        out = [{"name": t.name, "datatype": t.datatype, "shape": t.shape[:], "raw": r}
               for t, r in zip(req.inputs, raw)]          # (a slice: a list, and fast)
        for k, t in enumerate(req.inputs):
            if t.HasField("contents"):
                raise BadInput(f"inputs[{k}] ({t.name}): contents and raw_input_contents "
                               "both given")
        return out
    out = []
    for k, t in enumerate(req.inputs):
        field = CONTENTS.get(t.datatype)
        if field is None:
            raise BadInput(f"inputs[{k}] ({t.name}).datatype: {t.datatype[:40]!r} has no "
                           "typed contents: send raw_input_contents")
        vals = getattr(t.contents, field)
        out.append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                    "raw": bytes_blob(vals) if field == "bytes_contents" else
                    np.array(vals, v2.RAW_DTYPES[t.datatype]).tobytes()})
    return out


LAYOUTS = 64            # request layouts remembered a model version (then: checked each time)


class Layout:
    """The checked layout of a ModelInfer request on the array path (``v2.fast_columns``):
    which raw entry is which input, of what dtype, for ``n`` rows, and the outputs."""
    __slots__ = ("dense", "sparse", "n", "names", "wanted")

    def __init__(self, cols, n, names, wanted):
        self.n, self.names, self.wanted = n, names, wanted
        self.dense = [(name, k, c, np.dtype(c).itemsize * n) for name, (k, _, c) in cols.items()
                      if isinstance(c, str)]
        self.sparse = [(name, k) for name, (k, _, c) in cols.items() if not isinstance(c, str)]

    def columns(self, raw):
        """``v2.fast_columns``' answer for these raw contents; None if a dense tensor's
        bytes are not its shape's (then the request is checked in full, and told why)."""
        cols = {}
        for name, k, dtype, size in self.dense:
            if len(raw[k]) != size:
                return None
            cols[name] = (k, {"name": name, "raw": raw[k]}, dtype)
        for name, k in self.sparse:
            cols[name] = (k, {"name": name}, raw[k])
        return cols, self.n


class GrpcV2:
    """The servicer: ``call(path, message)``; ``start``/``stop`` serve it on a port."""

    def __init__(self, api):
        self.api = api                      # the HTTP Api: live, name, metrics, limits
        self.server = None
        m = f"/{SERVICE}/"                  # path -> (metrics endpoint, method, request)
        self.methods = {
            m + "ServerLive": ("live", self.live, pb.ServerLiveRequest),
            m + "ServerReady": ("ready", self.ready, pb.ServerReadyRequest),
            m + "ModelReady": ("ready", self.model_ready, pb.ModelReadyRequest),
            m + "ServerMetadata": ("metadata", self.server_metadata, pb.ServerMetadataRequest),
            m + "ModelMetadata": ("metadata", self.model_metadata, pb.ModelMetadataRequest),
            m + "ModelConfig": ("metadata", self.model_config, pb.ModelConfigRequest),
            m + "ModelInfer": ("infer", self.infer, pb.ModelInferRequest)}

    def call(self, path, message):
        """(answer bytes or None, status name, status message, model version) of the unary
        call ``path`` (``/inference.GRPCInferenceService/ModelInfer``) of the serialized
        request ``message``; None for a method this server does not have."""
        method = self.methods.get(path)
        if method is None:
            return None
        endpoint, fn, req_cls = method
        t0 = time.perf_counter()
        serving = self.api.live.current
        code, text, out = "OK", "", None
        try:
            try:
                req = req_cls.FromString(message)
            except DecodeError:
                raise BadInput(f"the request is not a valid {endpoint} message of the "
                               "protocol") from None
            out = fn(req, serving).SerializeToString()
        except (BadInput, LineError) as e:
            code, text = STATUS.get(getattr(e, "status", 400), "INVALID_ARGUMENT"), str(e)
        except Exception as e:  # noqa: BLE001 - a bug answers INTERNAL, the server keeps serving
            code, text = "INTERNAL", f"internal error: {type(e).__name__}: {e}"
        self.api.metrics.count("grpc_" + endpoint, code, time.perf_counter() - t0, code != "OK")
        return out, code, text, serving.version

    def _check_model(self, name, version, serving):
        if name != self.api.name:
            raise BadInput(f"unknown model {name[:100]!r}; this server serves "
                           f"{self.api.name!r}", 404)
        if version and version != serving.version:
            raise BadInput(f"unknown model version {version[:100]!r}; this server serves "
                           f"{serving.version!r}", 404)

    # ------------------------------------------------------------ methods
    def live(self, req, serving):
        return pb.ServerLiveResponse(live=True)

    def ready(self, req, serving):
        return pb.ServerReadyResponse(ready=serving is not None)

    def model_ready(self, req, serving):            # another model or version: not ready
        return pb.ModelReadyResponse(ready=req.name == self.api.name and (
            not req.version or req.version == serving.version))

    def server_metadata(self, req, serving):
        return pb.ServerMetadataResponse(name="mpips", version="1", extensions=v2.EXTENSIONS)

    def model_metadata(self, req, serving):
        self._check_model(req.name, req.version, serving)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.api.name, versions=[serving.version], platform="mpips",
            inputs=[T(name=n, datatype=d, shape=s)
                    for n, d, s in serving.encoder.describe_inputs()],
            outputs=[T(name=o, datatype="FP32", shape=[-1]) for o in v2.output_names(serving)])

    def model_config(self, req, serving):               # the HTTP answer, as the message
        self._check_model(req.name, req.version, serving)
        return pb.ModelConfigResponse(config=json_format.ParseDict(
            v2.model_config(self.api.name, serving, self.api.max_instances), pb.ModelConfig()))

    def infer(self, req, serving):
        """A request whose everything but its raw contents and id (its layout: model,
        names, types, shapes, outputs, parameters) is byte for byte one already checked
        and scored on the array path, by this version, skips the checks of its layout
        (``Layout``); its contents are checked as ever."""
        raw, rid = list(req.raw_input_contents), req.id
        layouts = key = layout = None
        if raw:
            req.ClearField("raw_input_contents")
            req.ClearField("id")
            key = req.SerializeToString()
            layouts = serving.__dict__.setdefault("_grpc_layouts", {})     # (per version)
            layout = layouts.get(key)
        fast = layout.columns(raw) if layout is not None else None
        if fast is not None:
            names, wanted = layout.names, layout.wanted
            scores = v2.fast_score(serving, *fast)
        else:
            self._check_model(req.model_name, req.model_version, serving)
            names = v2.output_names(serving)
            for k, o in enumerate(req.outputs):
                v2.check_output(o.name, k, names)
            if not req.inputs:
                raise BadInput("inputs: expected a non-empty list of tensors")
            wanted = [o.name for o in req.outputs] or names
            inputs = request_inputs(req, raw)
            fast = v2.fast_columns(serving, inputs, self.api.max_instances)
            if fast is None:
                scores = v2.score(serving, inputs, self.api.max_instances)
            else:
                scores = v2.fast_score(serving, *fast)
                if key is not None and len(layouts) < LAYOUTS:
                    layouts[key] = Layout(*fast, names, wanted)
        self.api.metrics.instances.inc(len(scores))
        cols = v2.columns(scores, names, wanted)
        Out = pb.ModelInferResponse.InferOutputTensor
        return pb.ModelInferResponse(model_name=self.api.name, model_version=serving.version,
                                     id=rid, outputs=[Out(name=n, datatype="FP32",
                                                             shape=[len(c)]) for n, c in cols],
                                     raw_output_contents=[c.astype("<f4").tobytes()
                                                          for _, c in cols])

    # ------------------------------------------------------------ server
    async def start(self, host, port, max_message, shared_port=False, idle_timeout=30.0):
        """Serve on host:port (0: a free one) from the running event loop; the port bound.
        ``shared_port``: other processes listen on it too (SO_REUSEPORT; the master holds
        it).  ``max_message``: the largest request message (RESOURCE_EXHAUSTED over)."""
        self.server = HttpServer(self, host, port, max_body=max_message,
                                 idle_timeout=idle_timeout, conn_class=GrpcConn,
                                 reuse_port=shared_port)
        try:
            await self.server.start()
        except OSError as e:
            raise OSError(f"--grpc-port {port}: cannot listen on {host}:{port} ({e})") from None
        return self.server.port

    async def stop(self, grace=10.0):
        """Stop accepting; finish the calls begun (GOAWAY, then close)."""
        await self.server.stop(grace)
