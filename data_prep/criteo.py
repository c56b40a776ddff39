"""Prepare raw Criteo TSV for training: split, statistics, hashed binary binary.

``python -m data_prep.criteo --input train.txt|DIR --out OUT [--parts 8]
[--val-fraction 0.1] [--seed 0] [--hash-bucket 0] [--test test.txt|DIR]``

One streaming pass over the input (chunks of a few MB, never a whole file in memory):

* **Split.**  Valid example number ``i`` (0-based, counted over the input files in
  order, bad and blank lines not counted) goes to validation iff
  ``u(seed, i) < val_fraction`` with ``u = (splitmix64(i * GOLDEN + splitmix64(seed))
  >> 11) / 2**53`` (``val_mask``) — reproducible, independent of chunking and of how
  many parts are written, disjoint, and the two splits together are the input.
* **Statistics** (train split only, empty fields excluded): per integer feature the
  minimum and numpy's default (linear) 95th percentile, exactly.  Values in
  [EXACT_LO, EXACT_HI) are counted exactly during the pass (a (13, ~135k) int64
  histogram); when an order statistic falls outside that range it is found by at most a
  few extra scans of that feature's column in the written train parts, each narrowing
  the range by REFINE_BINS.  ``cont_diff = p95 - min`` (1 if that is 0, and min 0 / diff 1
  for a feature without values).  Extreme values are kept, not clipped.
* **Parts.**  ``OUT/train``, ``OUT/val`` (and ``OUT/test`` from ``--test``) of ``parts``
  parts each (see ``mpips.data.binary``): raw int32 integer features (normalised when
  read), int64 ids from the TSV parser's hash, int8 labels.  A row goes to the part
  given by its position in the input bytes, so parts are contiguous, in input order, and
  of near-equal size.  Test input without a label column (39 fields, detected from the
  first line) gives label-less parts; the reader yields label 0 for them.

Bad lines are skipped, counted and reported per file (as ``DataReader`` does) and listed
in ``OUT/manifest.json``.  A progress line is drawn on stderr when it is a terminal.
"""
import argparse
import os
import shutil
import sys
import time

import numpy as np

from mpips.data import criteo as C
from mpips.data import binary
from mpips.data.files import resolve_paths
from mpips.data.reader import DataReader, detect_format
from mpips.kernels import tsv_parse as K

QUANTILE = 0.95  # normalisation maximum: this quantile of the train values
EXACT_LO, EXACT_HI = -(1 << 12), 1 << 17  # values counted exactly in the streaming pass
REFINE_BINS = 1 << 16  # histogram bins per refinement scan
SCAN_ROWS = 1 << 20  # rows per read when scanning written parts
PROGRESS_SECONDS = 0.5
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
RAW_NORM = np.array([[0.0] * C.N_DENSE, [1.0] * C.N_DENSE, [np.nan] * C.N_DENSE])
INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------- split rule
def _mix64(z: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser of a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def val_mask(seed: int, start: int, n: int, fraction: float) -> np.ndarray:
    """(n,) bool: is valid example ``start + i`` in the validation split?"""
    key = np.uint64(C.splitmix64_finalise(int(seed) & ((1 << 64) - 1)))
    idx = np.arange(start, start + n, dtype=np.uint64)
    u = (_mix64(idx * GOLDEN + key) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return u < fraction


# ---------------------------------------------------------------- parsing
def parse_raw(data, has_label: bool, hash_bucket: int) -> C.ParseResult:
    """Like ``parse_tsv_bytes`` but dense = raw values, float64 (n, 13), NaN when empty.

    Lines missing trailing categorical fields are read with them empty (as the reader
    does without --strict)."""
    buf = C.as_uint8(data)
    out = C.kernel_outputs(buf, dense_dtype=np.float64)
    opts = np.array([1 if has_label else 0, hash_bucket, 1], dtype=np.int64)
    n = K.parse_criteo_tsv(buf, opts, RAW_NORM, None, *out)
    return C.parse_result(n, *out)


def to_raw_int32(dense: np.ndarray, path: str) -> np.ndarray:
    """(n, 13) float64 raw (NaN empty) -> int32 with ``binary.DENSE_MISSING`` for empty."""
    empty = np.isnan(dense)
    bad = ~empty & ~((dense > binary.DENSE_MISSING) & (dense <= INT32_MAX))
    frac = ~empty & ~bad & (dense != np.floor(np.where(empty | bad, 0.0, dense)))
    if frac.any():  # (260.0 is fine: it is the integer 260)
        i, j = np.argwhere(frac)[0]
        raise ValueError(f"{path}: integer feature I{j + 1} has value {dense[i, j]:.17g}, "
                         f"not a whole number; binary data parts store integers: read this "
                         f"file as TSV instead of preparing binary parts")
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"{path}: integer feature I{j + 1} has value {dense[i, j]:.17g}, "
                         f"outside the int32 range binary data parts store; read this file as "
                         f"TSV instead of preparing binary parts")
    return np.where(empty, binary.DENSE_MISSING, dense).astype(np.int32)


# ---------------------------------------------------------------- statistics
def _lerp(a: float, b: float, t: float) -> float:
    """numpy's percentile interpolation, operation for operation."""
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t


class IntStats:
    """Exact per-feature minimum and quantile of int32 values, in bounded memory."""

    def __init__(self):
        self.hist = np.zeros((C.N_DENSE, EXACT_HI - EXACT_LO), np.int64)  # (13, w)
        self.tails = np.zeros((C.N_DENSE, 4), np.int64)  # below, above, min, max
        self.tails[:, 2], self.tails[:, 3] = 1 << 62, -(1 << 62)
        self.rows = 0

    def add(self, raw: np.ndarray) -> None:
        """Count (m, 13) int32 raw values (empty = DENSE_MISSING is skipped)."""
        K.count_int_values(raw, binary.DENSE_MISSING, EXACT_LO, self.hist, self.tails)
        self.rows += raw.shape[0]

    @property
    def counts(self) -> np.ndarray:
        return self.hist.sum(axis=1) + self.tails[:, 0] + self.tails[:, 1]  # (13,)

    def order_stat(self, j: int, k: int, scan) -> int:
        """k-th smallest (0-based) value of feature j; ``scan(j)`` re-reads its values."""
        below, _, vmin, vmax = (int(x) for x in self.tails[j])
        if k < below:
            return _refine(scan(j), vmin, EXACT_LO - 1, k, lambda: scan(j))
        c = np.cumsum(self.hist[j])
        k -= below
        if k < c[-1]:
            return EXACT_LO + int(np.searchsorted(c, k, side="right"))
        return _refine(scan(j), EXACT_HI, vmax, k - int(c[-1]), lambda: scan(j))

    def quantile(self, j: int, q: float, scan) -> float:
        n = int(self.counts[j])
        h = (n - 1) * q
        k = int(np.floor(h))
        a = self.order_stat(j, k, scan)
        b = a if k + 1 >= n else self.order_stat(j, k + 1, scan)
        return _lerp(float(a), float(b), h - k)

    def result(self, scan, q: float = QUANTILE) -> dict:
        """The stats.json contents (cont_min, cont_diff, and what they came from)."""
        n = self.counts
        lo, qv, diff = np.zeros(C.N_DENSE), np.zeros(C.N_DENSE), np.ones(C.N_DENSE)
        for j in np.flatnonzero(n):
            lo[j] = float(self.tails[j, 2])
            qv[j] = self.quantile(int(j), q, scan)
            diff[j] = qv[j] - lo[j] if qv[j] > lo[j] else 1.0
        has = n > 0
        return {"cont_min": lo.tolist(), "cont_diff": diff.tolist(),
                f"p{round(q * 100)}": qv.tolist(),
                "max": np.where(has, self.tails[:, 3], 0).tolist(),
                "count": n.tolist(), "missing": (self.rows - n).tolist(), "rows": self.rows,
                "quantile": q, "split": "train",
                "method": "exact; numpy percentile (linear) of the non-empty train values"}


def _refine(values_iter, lo: int, hi: int, rank: int, rescan) -> int:
    """The rank-th smallest (0-based) value among values in [lo, hi], by histogram scans."""
    while True:
        w = max(1, -(-(hi - lo + 1) // REFINE_BINS))
        nb = (hi - lo) // w + 1
        cnt = np.zeros(nb, np.int64)
        for v in values_iter:
            v = v[(v >= lo) & (v <= hi)]
            cnt += np.bincount((v - lo) // w, minlength=nb)
        c = np.cumsum(cnt)
        b = int(np.searchsorted(c, rank, side="right"))
        rank -= int(c[b - 1]) if b > 0 else 0
        lo = lo + b * w
        hi = min(hi, lo + w - 1)
        if w == 1:
            return lo
        values_iter = rescan()


# ---------------------------------------------------------------- writing
class SplitWriter:
    """Writes one split's parts in order; rows arrive with non-decreasing part numbers."""

    def __init__(self, split_dir: str, parts: int, has_label: bool):
        os.makedirs(split_dir)
        self.dir, self.parts, self.has_label = split_dir, parts, has_label
        self.writers: list = []
        self.rows: list = []

    def _advance(self, p: int) -> binary.PartWriter:
        while len(self.writers) <= p:
            if self.writers:
                self.rows.append(self.writers[-1].close())
            path = os.path.join(self.dir, binary.part_name(len(self.writers)))
            self.writers.append(binary.PartWriter(path, self.has_label))
        return self.writers[p]

    def add(self, part, dense, sparse, label) -> None:
        """part (m,) int64 non-decreasing; dense (m,13) int32; sparse (m,26); label (m,) int8."""
        cuts = np.searchsorted(part, np.arange(self.parts + 1))  # (parts+1,)
        for p in np.flatnonzero(np.diff(cuts)):
            a, b = cuts[p], cuts[p + 1]
            self._advance(int(p)).append(dense[a:b], sparse[a:b],
                                         None if label is None else label[a:b])

    def close(self) -> list:
        self._advance(self.parts - 1)
        self.rows.append(self.writers[-1].close())
        return self.rows


class Progress:
    """A one-line progress display on stderr (only when enabled)."""

    def __init__(self, total_bytes: int, enabled: bool, label: str):
        self.total, self.enabled, self.label = max(total_bytes, 1), enabled, label
        self.t0 = self.last = time.monotonic()

    def update(self, done: int, rows: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < PROGRESS_SECONDS and not force):
            return
        self.last = now
        rate = rows / max(now - self.t0, 1e-9)
        sys.stderr.write(f"\r{self.label}: {100 * done / self.total:5.1f}% "
                         f"{done / 1e9:.2f}/{self.total / 1e9:.2f} GB  {rows:,} rows  "
                         f"{rate:,.0f} rows/s ")
        sys.stderr.flush()

    def done(self, rows: int) -> None:
        if self.enabled:
            self.update(self.total, rows, force=True)
            sys.stderr.write("\n")


def _stream(files, has_label, hash_bucket, warn, on_rows, progress):
    """Parse ``files`` in order; on_rows(result, part_pos) per chunk; returns reader stats."""
    rd = DataReader(files, 1, fmt="tsv", has_label=has_label, hash_bucket=hash_bucket,
                    prefetch=False, warn=warn)
    total = sum(os.path.getsize(f) for f in rd.files)
    offset, rows = 0, 0

    def parse(_fmt, data):
        return parse_raw(data, has_label, hash_bucket)

    for path in rd.files:
        if detect_format(path) == "slot":
            raise ValueError(f"{path}: Paddle slot format holds already-normalised values; "
                             f"data_prep.criteo needs raw Criteo TSV (read slot files "
                             f"directly with the trainer instead)")
        for res, nbytes in rd.iter_parsed(path, parse):
            m = res.n_rows
            if m:
                pos = offset + (np.arange(m) + 0.5) * (nbytes / m)  # (m,) byte position
                on_rows(res, np.minimum(pos / total, 1.0), path)
            offset += nbytes
            rows += m
            progress.update(offset, rows)
    progress.done(rows)
    return rd.stats


def _file_report(stats) -> dict:
    return {p: {"rows": s.rows, "lines": s.lines, "bad": s.bad, "examples": s.examples}
            for p, s in stats.files.items()}


def _first_line_fields(files) -> int:
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip(b"\r\n"):
                    return line.count(b"\t") + 1
    return 0


# ---------------------------------------------------------------- driver
def _check_args(parts, val_fraction, hash_bucket, out):
    if parts < 1:
        raise ValueError(f"--parts must be >= 1; got {parts}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1); got {val_fraction}")
    if hash_bucket < 0:
        raise ValueError(f"--hash-bucket must be >= 0 (0 = full int64 ids); got {hash_bucket}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"--out {out!r} exists and is not an empty directory "
                              f"(remove it or choose another one)")


def _write_train_val(files, out, parts, val_fraction, seed, hash_bucket, warn, progress):
    """Stream the labelled input into OUT/train and OUT/val; returns (stats, rows, files)."""
    tw = SplitWriter(os.path.join(out, "train"), parts, True)
    vw = SplitWriter(os.path.join(out, "val"), parts, True)
    st = IntStats()
    seen = [0]

    def on_rows(res, frac, path):
        raw = to_raw_int32(res.dense, path)  # (m, 13) int32
        part = np.minimum((frac * parts).astype(np.int64), parts - 1)  # (m,)
        val = val_mask(seed, seen[0], res.n_rows, val_fraction)  # (m,)
        seen[0] += res.n_rows
        lab = res.label.astype(np.int8)
        for w, sel in ((tw, ~val), (vw, val)):
            if sel.any():
                w.add(part[sel], raw[sel], res.sparse[sel], lab[sel])
        st.add(raw[~val])

    rstats = _stream(files, True, hash_bucket, warn, on_rows, progress)
    return st, tw.close(), vw.close(), rstats


def _write_test(files, out, parts, hash_bucket, warn, progress):
    has_label = _first_line_fields(files) != C.N_DENSE + C.N_SPARSE
    tw = SplitWriter(os.path.join(out, "test"), parts, has_label)

    def on_rows(res, frac, path):
        part = np.minimum((frac * parts).astype(np.int64), parts - 1)
        tw.add(part, to_raw_int32(res.dense, path), res.sparse,
               res.label.astype(np.int8) if has_label else None)

    rstats = _stream(files, has_label, hash_bucket, warn, on_rows, progress)
    return has_label, tw.close(), rstats


def prepare(inputs, out: str, *, parts: int = 8, val_fraction: float = 0.1, seed: int = 0,
            hash_bucket: int = 0, test=None, progress=None, warn=None) -> dict:
    """Prepare Criteo TSV ``inputs`` (path spec) into ``out``; returns the root manifest.

    ``progress``: draw a progress line on stderr (default: when stderr is a terminal).
    ``warn``: callable for bad-line messages (default: stderr).
    """
    _check_args(parts, val_fraction, hash_bucket, out)
    files = resolve_paths(inputs)
    test_files = resolve_paths(test) if test else []
    os.makedirs(out, exist_ok=True)
    try:
        return _prepare(files, test_files, out, parts, val_fraction, seed, hash_bucket,
                        sys.stderr.isatty() if progress is None else progress, warn)
    except BaseException:  # nothing half-written is left behind to be taken for data
        shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare(files, test_files, out, parts, val_fraction, seed, hash_bucket, show, warn):
    t0 = time.monotonic()
    total = sum(os.path.getsize(f) for f in files)
    st, train_rows, val_rows, rstats = _write_train_val(
        files, out, parts, val_fraction, seed, hash_bucket, warn,
        Progress(total, show, "data_prep train/val"))
    stats = st.result(part_column_scanner(os.path.join(out, "train"), parts))
    binary.write_json_atomic(os.path.join(out, binary.STATS), stats)
    common = dict(hash_bucket=hash_bucket, cont_min=stats["cont_min"],
                  cont_diff=stats["cont_diff"])
    for name, rows in (("train", train_rows), ("val", val_rows)):
        binary.write_split_manifest(os.path.join(out, name), rows, has_label=True,
                                    extra={"split": name, "source": files}, **common)
    report = {"format": binary.FORMAT, "version": binary.VERSION, "kind": "root",
              "inputs": files, "seed": seed, "val_fraction": val_fraction, "parts": parts,
              "hash_bucket": hash_bucket, "split_rule": "valid example i -> val iff "
              "(splitmix64(i*0x9E3779B97F4A7C15 + splitmix64(seed)) >> 11) / 2**53 < "
              "val_fraction", "rows": {"train": sum(train_rows), "val": sum(val_rows)},
              "bad_lines": rstats.bad_lines, "files": _file_report(rstats),
              "splits": ["train", "val"], "stats": binary.STATS}
    if test_files:
        has_label, rows, tstats = _write_test(
            test_files, out, parts, hash_bucket, warn,
            Progress(sum(os.path.getsize(f) for f in test_files), show, "data_prep test"))
        binary.write_split_manifest(os.path.join(out, "test"), rows, has_label=has_label,
                                    extra={"split": "test", "source": test_files}, **common)
        report["rows"]["test"] = sum(rows)
        report["splits"].append("test")
        report["test_has_label"] = has_label
        report["bad_lines"] += tstats.bad_lines
        report["files"].update(_file_report(tstats))
    report["seconds"] = round(time.monotonic() - t0, 3)
    binary.write_json_atomic(os.path.join(out, binary.MANIFEST), report)
    return report


def part_column_scanner(split_dir: str, parts: int):
    """scan(j) -> iterator of int64 arrays: feature j's non-empty values in the parts
    of a split being written (its manifest does not exist yet)."""
    def scan(j: int):  # plain reads, not mmap: memory stays bounded and RSS honest
        for i in range(parts):
            with open(os.path.join(split_dir, binary.part_name(i), "dense.npy"), "rb") as fh:
                np.lib.format.read_magic(fh)
                shape = np.lib.format.read_array_header_1_0(fh)[0]  # (n, 13) int32
                for a in range(0, shape[0], SCAN_ROWS):
                    m = min(SCAN_ROWS, shape[0] - a)
                    block = np.fromfile(fh, np.int32, m * C.N_DENSE).reshape(m, C.N_DENSE)
                    col = block[:, j].astype(np.int64)
                    yield col[col != binary.DENSE_MISSING]
    return scan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.criteo",
                                 description="Criteo TSV -> train/val split, stats.json and "
                                             "memory-mappable binary data parts")
    ap.add_argument("--input", required=True, help="train.txt, a directory of parts, a glob, "
                    "or a comma-separated list (labelled, 40 fields a line)")
    ap.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    ap.add_argument("--parts", type=int, default=8, help="parts per split (default 8)")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="fraction of examples for validation (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    ap.add_argument("--hash-bucket", type=int, default=0,
                    help="0 = full int64 ids; N>0 = hash %% N (Paddle: 1000001)")
    ap.add_argument("--test", default=None, help="optional test input (39 fields without "
                    "label, or 40 with), written to OUT/test")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress line on stderr (default: when it is a terminal)")
    a = ap.parse_args(argv)
    try:
        rep = prepare(a.input, a.out, parts=a.parts, val_fraction=a.val_fraction, seed=a.seed,
                      hash_bucket=a.hash_bucket, test=a.test, progress=a.progress)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"data_prep.criteo: error: {exc}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{k} {v:,}" for k, v in rep["rows"].items())
    print(f"data_prep.criteo: {rows} rows in {rep['seconds']:.1f} s -> {a.out} "
          f"({a.parts} parts per split; stats in {os.path.join(a.out, binary.STATS)})")
    for path, f in rep["files"].items():
        if f["bad"]:
            print(f"  {path}: {f['bad']} bad line(s) of {f['lines']} skipped, e.g. "
                  f"{f['examples'][0] if f['examples'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
