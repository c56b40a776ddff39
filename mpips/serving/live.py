"""The model a server answers with, and its hot reload from a stream's export folder.

``Live`` holds ONE reference to a :class:`Serving` (the model, the predictors that parse its
lines and the encoder of its instances, all built before it is published).  A request
reads ``live.current`` once and uses that object to the end, so it is scored and labelled
by one version.  Following a folder, ``check()`` (called by the serving master,
``mpips.serving.shared.Pool``, in a thread of its own) polls the index
(``EXPORTS.json``: its size and mtime, so an unchanged folder costs one ``stat``), builds
the next model aside with ``exports.catch_up`` (patches into a new overlay, every file
CRC-checked against the index), scores one row with it so its kernels and workspace are
warm, and returns it to be published: the reference is swapped between two requests.  A file that is missing, truncated,
corrupt or of another schema is refused with one log line; the version being served
stays, the server stays ready, and the next change of the index is tried again (a
broken chain of patches is left behind at the next full bundle).

With several processes (``mpips.serving.shared``) the model built here is moved into
shared memory before it is published; ``share(model, source_time)`` is that step
(identity by default).
"""
import os
import time

import numpy as np

import mpips.serving.bundle as bd
import mpips.serving.exports as exports
from mpips.serving.instances import Encoder
from mpips.serving.predictor import Predictor


def warm(model):
    """Score one row (the first call in a thread builds its network workspace)."""
    dense = np.zeros((1, model.n_dense), np.float32)
    if model.schema.one_hot:
        model.predict(dense, np.zeros((1, model.n_sparse), np.int64))
    else:
        model.predict(dense, np.zeros(1, np.int64),
                      offsets=np.minimum(np.arange(model.n_sparse + 1), 1))


class Serving:
    """One published version: model + its line parsers + its instance encoder."""

    def __init__(self, model, header=None, source_time=None):
        self.model = model
        self.version = str(model.version.get("name", "unversioned"))
        self.seq = int(model.version.get("seq", 0) or 0)
        self.encoder = Encoder(model)
        self.lines = Predictor(model=model, header=header)            # raw lines
        self.instances = Predictor(model=model, header=self.encoder.header)
        self.source_time = source_time          # mtime of the newest file it is made of
        self.needs_header = not model.schema.is_criteo and model.schema.format == "csv" \
            and model.schema.header and header is None

    def warm(self):
        warm(self.model)
        self.instances.predict_lines([], errors="nan")
        if not self.needs_header:
            self.lines.predict_lines([], errors="nan")
        return self


def newest_time(folder, model):
    """mtime of the index entry ``model`` was made from (None when unknown)."""
    try:
        for e in exports.read_index(folder):
            if e["checkpoint"] == model.version.get("name"):
                return os.path.getmtime(os.path.join(folder, e["file"]))
    except (bd.BundleError, OSError):
        pass
    return None


class Live:
    """The current Serving; ``follow`` keeps it at the newest state of an export folder."""

    def __init__(self, bundle=None, folder=None, header=None, log=print, share=None,
                 on_reload=None, model=None, source_time=None):
        self.folder, self.header, self.log = folder, header, log
        self.share = share or (lambda model, when: model)
        self.on_reload = on_reload or (lambda ok, seconds, serving: None)
        self.refused = 0
        self.current = None
        self._seen = None
        if model is None and bundle is not None:
            model = Predictor(bundle).model
            source_time = os.path.getmtime(bundle)
            model = self.share(model, source_time)
        elif model is None:
            self._seen = self._stamp()
            model = exports.load_latest(folder)
            source_time = newest_time(folder, model)
            model = self.share(model, source_time)
        self.current = Serving(model, header, source_time).warm()

    def _stamp(self):
        try:
            st = os.stat(os.path.join(self.folder, exports.INDEX))
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def freshness_lag(self):
        """Seconds since the newest export the served version is made of was written."""
        t = self.current.source_time
        return float("nan") if t is None else max(0.0, time.time() - t)

    def check(self):
        """One poll: the next Serving (not yet published) when the folder moved, else None."""
        stamp = self._stamp()
        if stamp == self._seen:
            return None
        self._seen = stamp
        t0 = time.perf_counter()
        cur = self.current
        try:
            model = exports.catch_up(self.folder, cur.model)
        except (bd.BundleError, OSError, ValueError, KeyError) as e:
            self.refused += 1
            msg = f"{type(e).__name__}: {e}"
            self.log(f"mpips.serve: refused an export ({msg}); still serving {cur.version}")
            self.on_reload(False, time.perf_counter() - t0, cur)
            return None
        if model is cur.model:
            return None
        when = newest_time(self.folder, model)
        new = Serving(self.share(model, when), self.header, when).warm()
        self.on_reload(True, time.perf_counter() - t0, new)
        return new
