"""Online (streaming) training: consume passes as they land, exactly once.

Layout: ``DIR/YYYYMMDD/HH/`` (hourly passes) or ``DIR/YYYYMMDD/`` (daily passes); a pass is
ready when its ``_SUCCESS`` file exists; passes are taken in name order.  For each pass:

1. at a new day (``--shrink-every day``) or before every pass but the first (``pass``):
   shrink — every row ages by one, rows unseen for more than ``--shrink-threshold``
   shrinks are evicted (Paddle shrinks after hour 23; shrinking before the next day's
   first pass is the same point in the stream);
2. evaluate on the pass with the model as it was before seeing it (progressive validation);
3. train on it;
4. with ``--save-dir``: save a **base** after the first pass of a day and a **delta** after
   the others; the checkpoint records the pass, so a restart with the same command resumes
   after the last saved pass (no pass trained twice, none skipped); with ``--export-dir``
   also export it for serving (a full bundle after a base, a patch after a delta;
   ``mpips.exports``), so a following predictor is at most one pass behind;
5. log and write the audit record (ids admitted / waiting / evicted, table rows and bytes).
When no pass is ready it polls with back-off for ``--stream-timeout`` seconds, then ends.
SIGTERM (e.g. from Slurm before a requeue) ends the loop after the current pass.
"""
import os
import signal
import time
from dataclasses import dataclass

from mpips.backoff import PASS, Backoff
from mpips.data.files import resolve_paths
from mpips.exports import export_checkpoint
from mpips.report import epoch_record, pass_line
from mpips.resume import resume_point

STOP = {"flag": False}


def install_sigterm():
    """SIGTERM asks the stream loop to stop after the current pass."""
    def handler(signum, frame):
        STOP["flag"] = True
    signal.signal(signal.SIGTERM, handler)


@dataclass(frozen=True)
class Pass:
    name: str       # 'YYYYMMDD/HH' or 'YYYYMMDD'
    day: str
    path: str

    def files(self):
        return resolve_paths(self.path)


def _is_day(name):
    return len(name) == 8 and name.isdigit()


def ready_passes(root):
    """Ready passes under root, in order (a folder with _SUCCESS)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"--stream {root}: no such directory")
    out = []
    for day in sorted(d for d in os.listdir(root) if _is_day(d)):
        dpath = os.path.join(root, day)
        if os.path.exists(os.path.join(dpath, "_SUCCESS")):
            out.append(Pass(day, day, dpath))
            continue
        for hour in sorted(h for h in os.listdir(dpath) if len(h) == 2 and h.isdigit()):
            hpath = os.path.join(dpath, hour)
            if os.path.exists(os.path.join(hpath, "_SUCCESS")):
                out.append(Pass(f"{day}/{hour}", day, hpath))
    return out


def next_pass(root, done, timeout):
    """The first ready pass after `done` (name or None), waiting up to `timeout` s; or None."""
    backoff, t0 = Backoff(*PASS), time.monotonic()
    while True:
        for p in ready_passes(root):
            if done is None or p.name > done:
                return p
        if STOP["flag"] or time.monotonic() - t0 >= timeout:
            return None
        backoff.sleep(at_most=timeout - (time.monotonic() - t0))


def passes_behind(root, name):
    """For the PROGRESS line: how far pass `name` is behind the newest ready pass."""
    try:
        later = [p.name for p in ready_passes(root) if p.name > name]
    except OSError:
        return ""
    if not later:
        return "at the newest ready pass"
    n = len(later)
    return f"{n} pass{'es' if n > 1 else ''} behind the newest ready one ({later[-1]})"


def run_stream(cfg, backend, log):
    """The loop above; `backend` does the work (local or distributed). Returns records."""
    _, done = resume_point(cfg)
    prev_day = None if done is None else done[:8]
    records = []
    admitted_before = backend.stats().get("admitted_total", 0)
    while True:
        p = backend.decide(lambda after=done: None if STOP["flag"] else
                           next_pass(cfg.stream, after, cfg.stream_timeout))
        if p is None:
            break
        new_day = p.day != prev_day
        evicted = 0
        if (cfg.shrink_every == "day" and new_day and prev_day is not None) or \
                (cfg.shrink_every == "pass" and done is not None):
            evicted = backend.shrink(cfg.shrink_threshold)
        files = p.files()
        test_m = backend.evaluate(files)
        st = backend.train(files, len(records), label=f"pass {p.name}",
                           lag=lambda name=p.name: passes_behind(cfg.stream, name))
        if cfg.save_dir:
            path = backend.save("base" if new_day else "delta", {"pass": p.name, "epoch": -1})
            if cfg.export_dir and path:                 # the saving worker exports it
                entry = export_checkpoint(cfg.export_dir, path)
                log(f"EXPORT --> {cfg.export_dir}/{entry['file']} ({entry['kind']}, "
                    f"{entry['bytes']} bytes)")
        audit = backend.stats()
        st.extra.update(audit)
        if audit:
            st.extra.update(ids_admitted=audit["admitted_total"] - admitted_before,
                            ids_evicted=int(evicted))
            admitted_before = audit["admitted_total"]
        rec = epoch_record(cfg, len(records), st, test_m)
        rec["pass"] = p.name
        if backend.is_logger:
            log(pass_line(rec))
            backend.emit(rec)
        records.append(rec)
        done, prev_day = p.name, p.day
    return records

