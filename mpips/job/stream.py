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
SIGTERM, SIGINT or SIGUSR1 (e.g. from Slurm before a requeue) stops it as it stops a batch
run (``mpips.job.stop``): at the next step boundary of every worker, or before the pass's
training when it came in the shrink or the evaluation, or between passes.  Inside a pass,
a checkpoint records the pass, the batches of it trained and its evaluation's figures (none
yet if it stopped right after the shrink), never the pass as done; between passes the pass's
own checkpoint is the position.  The run exits 75, and the same command (or ``--resume
auto``) finishes that pass from there without shrinking or evaluating it again.  Passes are
numbered over the whole stream (a resumed run goes on counting), so a pass's shuffle seed
is the same in every run.
"""
import math
import os
import sys
import time
from dataclasses import dataclass

from mpips.comm.backoff import PASS, Backoff
from mpips.data.files import resolve_paths
from mpips.serving.exports import export_checkpoint
from mpips.job.loop import chain
from mpips.job.report import epoch_record, pass_line, test_fields, with_test
from mpips.job.stop import STOP, Stopped
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


class PassGone(RuntimeError):
    """The pass a stopped run was inside of is no longer ready."""


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

    def resumed(self, name):
        """Pass ``name``, which the checkpoint stopped inside of (it is finished first; a
        pass before it that is ready now was not when it was taken: it is late)."""
        for p in ready_passes(self.root):
            if p.name == name:
                self.known.add(name)
                return p
        raise PassGone(f"the checkpoint was saved inside pass {name}, which is no longer "
                       f"ready in {self.root} (no folder {name} with a _SUCCESS file): "
                       f"restore it, or give --resume the checkpoint before (after its "
                       f"previous pass)")

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
        return StreamRun(plan, backend, log, tb).run()


class StreamRun:
    """The passes of one run of a stream, from where its checkpoint left it
    (``plan.stream_at``): after its last pass, or inside the pass a signal stopped."""

    def __init__(self, plan, backend, log, tb):
        cfg, at = plan.cfg, plan.stream_at
        self.plan, self.cfg, self.backend, self.log, self.tb = plan, cfg, backend, log, tb
        self.done, self.index, self.inside = at.last, at.passes, at if at.in_pass else None
        self.prev_day = None if self.done is None else self.done[:8]
        self.saved = plan.resume        # the stream's newest checkpoint (the position)
        self.feed = None
        if backend.is_logger:
            late = plan.manifest["meta"].get("passes_late", []) if plan.resume else []
            self.feed = PassFeed(cfg.stream, self.done, cfg.late_pass, _warn, late, say=log)
        self.records = []
        self.admitted_before = backend.stats().get("admitted_total", 0)

    def run(self):
        """Train passes until none comes within --stream-timeout, or a signal stops it."""
        while True:
            p = self.backend.decide(self._next)
            if p is None or not self._one(p):
                break
        if STOP["stopped"] is None and self.backend.stop_now():     # between passes
            where = f"after pass {self.done}" if self.done else "before its first pass"
            self._stopped(f"{where} (waiting for the next)", 0, self.saved)
        return self.records

    def _next(self):
        """The next pass (first worker), or None: none came in time, or a stop signal."""
        if self.inside is not None:
            return self.feed.resumed(self.inside.in_pass)
        self.plan.hooks.signal_phase(self.index, "wait")
        if STOP["flag"]:
            return None
        return self.feed.next(self.done, self.cfg.stream_timeout)

    def _phase(self, name):
        if self.backend.is_logger:
            self.plan.hooks.signal_phase(self.index, name)

    def _one(self, p):
        """Shrink, evaluate, train and save pass p (or its rest); False when a stop signal
        ended it inside (its checkpoint then records how far it got)."""
        cfg, backend = self.cfg, self.backend
        inside, self.inside = self.inside, None
        new_day = p.day != self.prev_day
        evicted = inside.evicted if inside is not None else 0
        if inside is None and ((cfg.shrink_every == "day" and new_day and self.prev_day) or
                               (cfg.shrink_every == "pass" and self.done is not None)):
            self._phase("shrink")
            evicted = backend.shrink(cfg.shrink_threshold)
            if backend.stop_now():          # a signal in the shrink: stop before the eval
                self._stop_inside(p, 0, None, evicted=evicted)
                return False
        files = p.files()
        test = inside.test if inside is not None else None
        if test is None:                    # progressive: before the pass trains (resumed at
            self._phase("eval")             # its start: the model has not seen it yet)
            test = test_fields(backend.evaluate(files))
        skip = inside.steps if inside is not None else 0
        if backend.stop_now():              # a signal in the evaluation
            self._stop_inside(p, skip, test, evicted=evicted)
            return False
        backend.trainer.on_step = chain(
            self.plan.hooks.killer(p.name), self.plan.hooks.signaller(self.index)) \
            if backend.is_logger else None
        st = backend.train(files, self.index, skip, label=f"pass {p.name}",
                           lag=lambda name=p.name: passes_behind(cfg.stream, name))
        if st.stopped:
            self._stop_inside(p, skip + st.steps, test, st, evicted)
            return False
        if cfg.save_dir:
            self._phase("save")
            self.saved = backend.save("base" if new_day else "delta", self._meta(p.name))
            if cfg.export_dir and self.saved:              # the saving worker exports it
                entry = export_checkpoint(cfg.export_dir, self.saved)
                self.log(f"EXPORT --> {cfg.export_dir}/{entry['file']} ({entry['kind']}, "
                         f"{entry['bytes']} bytes)")
        self._record(p, st, evicted, test, resumed_at_batch=skip)
        self.done, self.prev_day, self.index = p.name, p.day, self.index + 1
        return True

    def _meta(self, last, **inside):
        """A checkpoint's position: after pass ``last``, ``self.index`` passes trained
        before the next; ``inside``: in_pass, steps, pass_test, pass_evicted of the pass
        stopped."""
        return {"pass": last, "epoch": -1, "passes": self.index + (0 if inside else 1),
                "passes_late": self.feed.late if self.feed else []} | inside

    def _stop_inside(self, p, steps, test, st=None, evicted=0):
        """Stopped inside pass p after ``steps`` of its batches: save that position (never
        as the pass done), record what was trained (``st``; None: nothing yet, and the
        shrink's ``evicted`` count goes to the pass's record after the resume), say so."""
        path = None
        if self.cfg.save_dir:
            path = self.backend.save("delta", self._meta(
                self.done, in_pass=p.name, steps=steps, pass_test=_finite(test),
                pass_evicted=int(evicted) if st is None else 0))
        if st is not None:
            self._record(p, st, evicted, {}, stopped_at_batch=steps)
        at = f"after batch {steps}" if steps else "before its first batch"
        self._stopped(f"in pass {p.name} {at}", steps, path)

    def _stopped(self, where, steps, path):
        STOP["stopped"] = Stopped(STOP["signal"] or "a signal to another rank", self.index,
                                  steps, path or self.cfg.save_dir or None, where)

    def _record(self, p, st, evicted, test, **where):
        """The pass's record (PASS line, metrics, TensorBoard) of what this run trained of
        it; ``where``: stopped_at_batch (a stopped pass's part) or resumed_at_batch."""
        backend = self.backend
        audit = backend.stats()
        st.extra.update(audit)
        if audit:
            st.extra.update(ids_admitted=audit["admitted_total"] - self.admitted_before,
                            ids_evicted=int(evicted))
            self.admitted_before = audit["admitted_total"]
        rec = with_test(epoch_record(self.cfg, self.index, st, None), test)
        rec["pass"] = p.name
        rec.update({k: v for k, v in where.items() if v or k == "stopped_at_batch"})
        if self.feed is not None:
            rec["passes_late"] = len(self.feed.late)
        if backend.is_logger:
            self.log(pass_line(rec))
            backend.emit(rec)
            if self.tb is not None and "stopped_at_batch" not in rec:
                self.tb.record(rec, st.steps)
        self.records.append(rec)


def _finite(test):
    """Record fields for a checkpoint's JSON: a non-finite number (an AUC of one class)
    as None."""
    if test is None:
        return None
    return {k: (_finite(v) if isinstance(v, dict) else
                v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in test.items()}


def _warn(text):
    print(text, file=sys.stderr, flush=True)
