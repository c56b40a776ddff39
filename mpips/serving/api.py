"""The inference protocols over one scoring core, and the server's Prometheus metrics.

Routes (``{name}`` is the served model's name, ``--name``)::

    GET  /v2/health/live | /v2/health/ready            Open Inference Protocol (KServe V2)
    GET  /v2/models/{name}                             metadata: inputs, versions
    GET  /v2/models/{name}/ready
    POST /v2/models/{name}/infer                       tensors by input name (JSON, or the
                                                       binary tensor data extension: v2.py)
    GET  /v2/models/{name}/config                      Triton's model configuration (minimal)
    .../v2/models/{name}/versions/{version}/...        the same, when {version} is served
    GET  /v1/models/{name}                             TF-Serving status
    POST /v1/models/{name}:predict                     {"instances": [...]} or {"inputs": {...}}
    POST /v1/models/{name}:lines                       raw lines -> one score per line
    GET  /metrics                                      Prometheus text format

Every scoring answer names the version that scored it (``model_version`` in the JSON, and
the ``Model-Version`` header on every answer).  A request is scored by the Serving read
once at its start (``Live.current``): all of its scores come from one version.  Bad input
is a 4xx with ``{"error": "..."}`` naming the field; nothing a client sends stops the
server (an unexpected error is a 500 and is counted).
"""
import glob
import json
import math
import os
import time

import numpy as np
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from mpips.serving.http import Response, error_response
from mpips.serving import v2
from mpips.serving.instances import BadInput, columns_to_instances
from mpips.serving.predictor import LineError

LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0)
FORM = "application/x-www-form-urlencoded"     # what curl -d sends unless told
JSON_TYPES = ("application/json", "", FORM)
V2_TYPES = JSON_TYPES + ("application/octet-stream",)   # the binary extension
LINE_TYPES = ("text/plain", "text/csv", "text/tab-separated-values", "application/octet-stream",
              "", FORM)


def _reject_constant(name):
    raise BadInput(f"{name} is not a number JSON allows (NaN and infinities are refused)")


class ReloadMetrics:
    """Reload attempts: counted where the reload is done (the master, with processes)."""

    def __init__(self, registry=None):
        kw = {} if registry is None else {"registry": registry}
        self.reloads = Counter("mpips_reloads", "reload attempts by result (ok, refused)",
                               ["result"], **kw)
        self.time = Gauge("mpips_last_reload_timestamp_seconds", "when the last reload "
                          "attempt ended (Unix time)", multiprocess_mode="max", **kw)
        self.seconds = Gauge("mpips_last_reload_duration_seconds", "how long the last reload "
                             "attempt took", multiprocess_mode="mostrecent", **kw)

    def reloaded(self, ok, seconds, serving=None):
        self.reloads.labels("ok" if ok else "refused").inc()
        self.time.set(time.time())
        self.seconds.set(seconds)


class _Summed(MultiProcessCollector):
    """The sum over the processes' files, but a file a process is creating (still empty,
    not yet sized) is left out rather than failing the scrape."""

    def collect(self):
        files = []
        for f in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(f) > 0:
                    files.append(f)
            except OSError:              # removed meanwhile (a process that ended)
                pass
        return self.merge(files, accumulate=True)


class _Here:
    """The answering process's own gauges, read at the scrape."""

    def __init__(self, live, process):
        self.live, self.process = live, process

    def collect(self):
        cur = self.live.current
        yield GaugeMetricFamily("mpips_process_index", "index of the server process that "
                                "answered this scrape (--processes)", value=self.process)
        info = GaugeMetricFamily("mpips_model_info", "1 for the version the answering "
                                 "process serves", labels=["version"])
        info.add_metric([cur.version], 1)
        yield info
        yield GaugeMetricFamily("mpips_freshness_lag_seconds", "age of the newest export the "
                                "answering process's version is made of",
                                value=self.live.freshness_lag())


class Metrics:
    """The server's Prometheus metrics.

    One process: its own registry.  ``multiprocess`` (the directory of prometheus-client's
    multiprocess mode, ``--processes``/``--follow``): each process writes its counters and
    histograms to its own files there and a scrape, whichever process answers it, reads
    the sum over every process that has served (a process restarted keeps its counts);
    the per-process gauges carry ``process`` and ``pid`` labels (the live processes'
    only); the reloads are the master's (``ReloadMetrics``).  ``mpips_process_index``,
    ``mpips_model_info`` and ``mpips_freshness_lag_seconds`` are the answering process's.
    """

    def __init__(self, live, process=0, multiprocess=None):
        disable_created_metrics()
        r = CollectorRegistry()          # where the metrics live (scraped in one process)
        if multiprocess:
            self.registry = CollectorRegistry()
            _Summed(self.registry, path=multiprocess)
        else:
            self.registry = r
            self.reload = ReloadMetrics(r)
        self.requests = Counter("mpips_requests", "requests by endpoint and status code (gRPC: "
                                "grpc_* endpoints, status names)",
                                ["endpoint", "code"], registry=r)
        self.errors = Counter("mpips_request_errors", "requests answered 4xx or 5xx",
                              ["endpoint"], registry=r)
        self.latency = Histogram("mpips_request_seconds", "time to answer a request",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.instances = Counter("mpips_instances", "instances (rows) scored", registry=r)
        p = str(process)
        self.version = Gauge("mpips_model_version_seq", "checkpoint sequence number of the "
                             "version a process serves", ["process"], registry=r,
                             multiprocess_mode="liveall").labels(p)
        self.rows = Gauge("mpips_table_rows", "embedding rows of the version a process "
                          "serves", ["process"], registry=r,
                          multiprocess_mode="liveall").labels(p)
        self.here = _Here(live, process)
        self.registry.register(self.here)
        self._kids = {}
        self.show(live.current)

    def show(self, serving):
        self.version.set(serving.seq)
        self.rows.set(len(serving.model))

    def reloaded(self, ok, seconds, serving):
        self.reload.reloaded(ok, seconds, serving)

    def count(self, endpoint, code, seconds, error=None):
        """One request answered (the labelled children are looked up once); ``code``: the
        HTTP status (an error from 400), or a gRPC status name with ``error``."""
        key = (endpoint, code)
        kids = self._kids.get(key)
        if kids is None:
            error = code >= 400 if error is None else error
            kids = self._kids[key] = (self.requests.labels(endpoint, str(code)),
                                      self.errors.labels(endpoint) if error else None,
                                      self.latency.labels(endpoint))
        kids[0].inc()
        if kids[1] is not None:
            kids[1].inc()
        kids[2].observe(seconds)

    def refused(self, status):
        """A request refused by the HTTP layer (bad head, too large, too slow)."""
        self.requests.labels("http", str(status)).inc()
        self.errors.labels("http").inc()


class Api:
    """``api(request) -> Response``: routing, decoding, scoring, encoding, metrics."""

    def __init__(self, live, name, metrics, max_instances=10000):
        self.live, self.name, self.metrics = live, name, metrics
        self.max_instances = max_instances
        self.v1 = f"/v1/models/{name}"
        self.v2 = f"/v2/models/{name}"

    def __call__(self, req):
        t0 = time.perf_counter()
        serving = self.live.current
        endpoint, resp = "unknown", None
        try:
            endpoint, fn, methods = self._route(req.path, serving)
            if fn is None:
                raise BadInput(f"no such endpoint {req.path[:100]!r} (this server's model is "
                               f"{self.name!r}; see GET /v2/models/{self.name})", 404)
            if req.method not in methods:
                raise BadInput(f"{req.method} is not allowed here (use {' or '.join(methods)})",
                               405)
            resp = fn(req, serving)
        except BadInput as e:
            resp = error_response(e.status, str(e))
        except LineError as e:
            resp = error_response(400, str(e))
        resp.headers = tuple(resp.headers) + (("Model-Version", serving.version),)
        self.metrics.count(endpoint, resp.status, time.perf_counter() - t0)
        return resp

    def _route(self, path, serving):
        GET, POST = ("GET",), ("POST",)
        if path.startswith(self.v2 + "/versions/"):
            version, _, rest = path[len(self.v2) + 10:].partition("/")
            if version != serving.version:
                return "unknown_model", self._unknown_version, GET + POST
            path = self.v2 + ("/" + rest if rest else "")
        if path == self.v2 + "/infer":
            return "v2_infer", self.v2_infer, POST
        if path == self.v2 + "/config":
            return "metadata", self.v2_config, GET
        if path == self.v1 + ":predict":
            return "v1_predict", self.v1_predict, POST
        if path == self.v1 + ":lines":
            return "lines", self.lines, POST
        if path in ("/v2/health/live", "/v2/health/ready"):
            return "health", self.health, GET
        if path in (self.v2, self.v2 + "/ready", "/v2"):
            return "metadata", self.v2_meta, GET
        if path == self.v1:
            return "metadata", self.v1_status, GET
        if path == "/metrics":
            return "metrics", self.prometheus, GET
        if path.startswith(("/v1/models/", "/v2/models/")):
            return "unknown_model", self._unknown_model, GET + POST
        return "not_found", None, GET + POST

    # ------------------------------------------------------------ helpers
    def _json(self, req):
        ctype = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in JSON_TYPES:
            raise BadInput(f"Content-Type {ctype!r}: send application/json", 415)
        try:
            body = json.loads(req.body, parse_constant=_reject_constant)
        except BadInput:
            raise
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInput(f"body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadInput("body: expected a JSON object")
        return body

    def _check_count(self, n, what):
        if n > self.max_instances:
            raise BadInput(f"{what}: {n} instances; the limit is {self.max_instances} "
                           "(--max-instances)", 413)

    def _score(self, serving, instances):
        """Scores (n,) of instances (dicts) by ``serving``."""
        self._check_count(len(instances), "instances")
        if not instances:
            return np.empty(0, np.float32)
        lines = serving.encoder.lines(instances)
        try:
            out = serving.instances.predict_lines(lines)
        except LineError as e:
            i, why = e.bad[0]
            raise BadInput(f"instances[{i}]: {why}") from None
        self.metrics.instances.inc(len(out))
        return out

    @staticmethod
    def _ok(obj):
        return Response(200, json.dumps(obj, allow_nan=False).encode())

    # ------------------------------------------------------------ endpoints
    def _unknown_model(self, req, serving):
        raise BadInput(f"unknown model in {req.path[:100]!r}; this server serves "
                       f"{self.name!r}", 404)

    def _unknown_version(self, req, serving):
        raise BadInput(f"unknown model version in {req.path[:100]!r}; this server serves "
                       f"{serving.version!r}", 404)

    def health(self, req, serving):
        if req.path.endswith("live"):
            return self._ok({"live": True})
        return self._ok({"ready": serving is not None})

    def v2_meta(self, req, serving):
        if req.path == "/v2":
            return self._ok({"name": "mpips", "version": "1", "extensions": v2.EXTENSIONS})
        if req.path.endswith("/ready"):
            return self._ok({"name": self.name, "ready": True})
        inputs = [{"name": n, "datatype": d, "shape": s}
                  for n, d, s in serving.encoder.describe_inputs()]
        return self._ok({"name": self.name, "versions": [serving.version], "platform": "mpips",
                         "inputs": inputs,
                         "outputs": [{"name": o, "datatype": "FP32", "shape": [-1]}
                                     for o in v2.output_names(serving)]})

    def v1_status(self, req, serving):
        return self._ok({"model_version_status": [{
            "version": str(serving.seq), "state": "AVAILABLE",
            "status": {"error_code": "OK", "error_message": ""}}],
            "model_version": serving.version})

    def v2_config(self, req, serving):
        return self._ok(v2.model_config(self.name, serving, self.max_instances))

    def v2_infer(self, req, serving):
        ctype = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in V2_TYPES:
            raise BadInput(f"Content-Type {ctype!r}: send application/json (or "
                           "application/octet-stream with Inference-Header-Content-Length)", 415)
        if req.headers.get("content-encoding", "identity").lower() != "identity":
            raise BadInput("Content-Encoding: send the body uncompressed", 415)
        head, inputs = v2.split_body(req.body, req.headers.get("inference-header-content-length"))
        names = v2.output_names(serving)
        wanted, binary = v2.binary_output(head, names)
        if "id" in head and not isinstance(head["id"], str):
            raise BadInput("id: expected a string")
        scores = v2.score(serving, inputs, self.max_instances)
        self.metrics.instances.inc(len(scores))
        outs, blobs = [], []
        for name, col in v2.columns(scores, names, wanted):    # one tensor a task
            out = {"name": name, "datatype": "FP32", "shape": [len(col)]}
            if binary:
                blobs.append(col.astype("<f4").tobytes())
                out["parameters"] = {"binary_data_size": len(blobs[-1])}
            else:
                out["data"] = col.tolist()
            outs.append(out)
        data = b"".join(blobs)
        answer = {"model_name": self.name, "model_version": serving.version, "outputs": outs}
        if "id" in head:
            answer["id"] = head["id"]
        if not binary:
            return self._ok(answer)
        text = json.dumps(answer).encode()
        return Response(200, text + data, "application/octet-stream",
                        (("Inference-Header-Content-Length", str(len(text))),))

    def v1_predict(self, req, serving):
        body = self._json(req)
        if ("instances" in body) == ("inputs" in body):
            raise BadInput('body: give either "instances" (a list of objects) or "inputs" '
                           "(an object of lists)")
        if "instances" in body:
            instances = body["instances"]
            if not isinstance(instances, list):
                raise BadInput("instances: expected a list of objects")
            self._check_count(len(instances), "instances")
        else:
            cols = body["inputs"]
            if not isinstance(cols, dict):
                raise BadInput("inputs: expected an object of lists (columns by input name)")
            n = max((len(c) for c in cols.values() if isinstance(c, list)), default=0)
            self._check_count(n, "inputs")
            instances = columns_to_instances(cols, serving.encoder.known, "inputs")
        scores = self._score(serving, instances)
        names = serving.model.task_names
        preds = ([dict(zip(names, row)) for row in scores.tolist()] if names else
                 scores.tolist())                  # T > 1: a {task: p} per instance
        return self._ok({"predictions": preds, "model_version": serving.version})

    def lines(self, req, serving):
        ctype = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in LINE_TYPES:
            raise BadInput(f"Content-Type {ctype!r}: send the lines as text/plain", 415)
        if serving.needs_header:
            raise BadInput("this model's schema is CSV with a header line: start the server "
                           "with --header \"col1,col2,...\" to score raw lines", 400)
        errors = "nan" if "errors=nan" in req.query.split("&") else "raise"
        text = req.body
        if b"\0" in text:
            raise BadInput("body: a NUL byte is not text")
        lines = text.split(b"\n")
        if lines and lines[-1] in (b"", b"\r"):
            lines.pop()
        self._check_count(len(lines), "lines")
        scores = serving.lines.predict_lines(lines, errors=errors) if lines else \
            np.empty(0, np.float32)
        self.metrics.instances.inc(int(np.count_nonzero(~np.isnan(scores))))
        if scores.ndim == 2:                  # T tasks: T tab-separated scores a line
            body = "".join("\t".join("nan" if math.isnan(x) else repr(x) for x in row) + "\n"
                           for row in scores.tolist())
        else:
            body = "".join(("nan\n" if math.isnan(x) else f"{x!r}\n") for x in scores.tolist())
        return Response(200, body.encode(), "text/plain; charset=utf-8")

    def prometheus(self, req, serving):
        return Response(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
