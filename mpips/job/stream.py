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
   ``mpips.serving.exports``), so a following predictor is at most one pass behind;
5. log and write the audit record (ids admitted / waiting / evicted, table rows and bytes).
When no pass is ready it polls with back-off for ``--stream-timeout`` seconds, then ends;
while it waits it says so (a ``STREAM --> waiting ...`` line naming the pass it waits for
and until when, repeated every ``WAIT_REPORT_EVERY`` seconds).
A pass that becomes ready after a later one was taken is never trained: it is logged as a
warning and counted (``passes_late``), or stops the run with ``--late-pass fail``.
SIGTERM, SIGINT or SIGUSR1 (e.g. from Slurm before a requeue) ends the loop after the current
pass (``mpips.job.stop``), exiting 0.
"""
import os
import sys
import time
from dataclasses import dataclass

from mpips.comm.backoff import PASS, Backoff
from mpips.data.files import resolve_paths
from mpips.serving.exports import export_checkpoint
from mpips.job.report import epoch_record, pass_line
from mpips.job.stop import STOP
from mpips.job.tracking import open_tensorboard

WAIT_REPORT_EVERY = 300.0   # seconds between the lines of a stream waiting for its next pass


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


class LatePass(RuntimeError):
    """A pass became ready after a later pass was taken (with --late-pass fail)."""


class PassFeed:
    """Hands out ready passes in name order, each once, and spots late ones.

    A pass is *late* when its ``_SUCCESS`` appears after a later pass was taken: passes
    are consumed in order, so it is never trained.  It is logged loudly through ``warn``
    and listed in ``late`` (``passes_late`` in the metrics), or, with ``policy="fail"``,
    raises LatePass.  ``done``: the last pass of the run resumed (passes ready then count
    as handled by that run); ``late``: the late passes that run listed.
    """

    def __init__(self, root, done=None, policy="warn", warn=None, late=(), say=None):
        self.root, self.policy, self.warn, self.say = root, policy, warn or print, say or print
        self.late = list(late)
        self.known = {p.name for p in ready_passes(root)
                      if done is not None and p.name <= done}

    def next(self, done, timeout):
        """The first ready pass after `done` (name or None), waiting up to `timeout` s; or None."""
        backoff, t0 = Backoff(*PASS), time.monotonic()
        said = None                 # when the last waiting line was printed
        while True:
            ready = ready_passes(self.root)
            self._spot_late(ready, done)
            for p in ready:
                if done is None or p.name > done:
                    self.known.add(p.name)
                    return p
            now = time.monotonic()
            if STOP["flag"] or now - t0 >= timeout:
                if STOP["flag"] and said is not None:
                    self.say(f"STREAM --> stopped waiting ({STOP['signal']})")
                elif not STOP["flag"]:
                    self.say(self._done_line(done, timeout))
                return None
            if said is None or now - said >= WAIT_REPORT_EVERY:
                said = now
                self.say(self._waiting_line(done, timeout - (now - t0)))
            backoff.sleep(at_most=timeout - (time.monotonic() - t0))

    def _done_line(self, done, timeout):
        after = f" after {done}" if done else ""
        wait = ("(--stream-timeout 0: not waiting)" if timeout <= 0 else
                f"within --stream-timeout {timeout:g} s")
        return f"STREAM --> no new pass{after} in {self.root} {wait}; finishing"

    def _waiting_line(self, done, left):
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() + left))
        after = f"the pass after {done}" if done else "a first pass"
        return (f"STREAM --> waiting for {after} (a folder YYYYMMDD/ or YYYYMMDD/HH/ in "
                f"{self.root} with a _SUCCESS file) until {until} (--stream-timeout; "
                f"{left:.0f} s left), then finishing")

    def _spot_late(self, ready, done):
        for p in ready:
            if p.name in self.known or done is None or p.name > done:
                continue
            self.known.add(p.name)
            text = (f"pass {p.name} became ready after pass {done} was already taken; passes "
                    f"are taken in order, so it is NOT trained")
            if self.policy == "fail":
                raise LatePass(f"{text} (--late-pass fail)")
            self.late.append(p.name)
            self.warn(f"mpips: WARNING: {text} ({len(self.late)} late pass(es) so far, "
                      f"'passes_late' in the metrics; --late-pass fail stops the run instead)")


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


def run_stream(plan, backend, log):
    """The loop above for a RunPlan; `backend` does the work (local or distributed).
    Returns records."""
    with open_tensorboard(plan.cfg, backend) as tb:
        return _passes(plan, backend, log, tb)


def _passes(plan, backend, log, tb):
    cfg, done = plan.cfg, plan.last_pass
    prev_day = None if done is None else done[:8]
    feed = None
    if backend.is_logger:
        late = plan.manifest["meta"].get("passes_late", []) if plan.resume else []
        feed = PassFeed(cfg.stream, done, cfg.late_pass, _warn, late, say=log)
    records = []
    admitted_before = backend.stats().get("admitted_total", 0)
    while True:
        p = backend.decide(lambda after=done: None if STOP["flag"] else
                           feed.next(after, cfg.stream_timeout))
        if p is None:
            break
        new_day = p.day != prev_day
        evicted = 0
        if (cfg.shrink_every == "day" and new_day and prev_day is not None) or \
                (cfg.shrink_every == "pass" and done is not None):
            evicted = backend.shrink(cfg.shrink_threshold)
        files = p.files()
        test_m = backend.evaluate(files)
        backend.trainer.on_step = plan.hooks.killer(p.name) if backend.is_logger else None
        st = backend.train(files, len(records), label=f"pass {p.name}",
                           lag=lambda name=p.name: passes_behind(cfg.stream, name))
        if cfg.save_dir:
            path = backend.save("base" if new_day else "delta", {
                "pass": p.name, "epoch": -1, "passes_late": feed.late if feed else []})
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
        if feed is not None:
            rec["passes_late"] = len(feed.late)
        if backend.is_logger:
            log(pass_line(rec))
            backend.emit(rec)
            if tb is not None:
                tb.record(rec, st.steps)
        records.append(rec)
        done, prev_day = p.name, p.day
    return records


def _warn(text):
    print(text, file=sys.stderr, flush=True)
