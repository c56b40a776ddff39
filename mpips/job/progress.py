"""Where the first worker is in its epoch or pass: a PROGRESS line every --progress-every s.

    PROGRESS --> epoch 0 42% (420,000 / 1,000,000 rows) 61.2k ex/s  loss 0.4512  ETA 0:00:09

The total is the first worker's share of the data: the rows of its binary parts
(from their manifests) plus, for text files, whose row count is not known before reading
them, an estimate from their size in bytes and the rows per byte parsed so far; the line
then says so (`~42%`, `~1,000,000 rows est. from bytes`).  Percentages never go down
within an epoch and reach 100 only at its end, where a last line gives the exact count.
With W workers, ex/s is this worker's rate (the EPOCH line gives the job's).  On a stream
the line names the pass and how many ready passes wait behind it.  The rate and ETA count
from the end of the first step (the numba kernels are compiled before training starts,
``mpips.job.warmup``); a line due before a second step shows no rate yet.

Lines go through `write` (print); on a terminal in local mode (`redraw=True`) the line is
redrawn in place instead and cleared before any other line.  The cost per step is one
clock read and a comparison (`bench/bench_progress.py` measures it).
"""
import sys
import time


def fmt_rate(x):
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def fmt_seconds(s):
    s = int(round(max(s, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Progress of one epoch or pass; `tick` after every step, `finish` at the end.

    known_rows: rows whose count is exact (binary parts); text_bytes: bytes of text files;
    parsed(): (text rows, text bytes) parsed so far, for the estimate; limit: at most this
    many rows in this phase (--max-steps), 0 = all; offset: rows skipped on a resume
    (counted as done); lag(): text naming the passes waiting, or None.
    """

    def __init__(self, label, known_rows, text_bytes, parsed, every, *, write=print,
                 redraw=False, limit=0, offset=0, worker=None, lag=None,
                 clock=time.monotonic, every_steps=0):
        self.label, self.known, self.text_bytes = label, int(known_rows), int(text_bytes)
        self.parsed, self.every, self.write, self.redraw = parsed, float(every), write, redraw
        self.limit, self.offset, self.worker, self.lag = int(limit), int(offset), worker, lag
        self.clock, self.every_steps = clock, int(every_steps)
        self.t0 = clock()
        self.next_t = self.t0 + self.every
        self.steps = 0
        self.first = None         # (time, rows) at the first step
        self.shown = 0            # highest percentage printed (never goes down)
        self.drawn = False        # a redrawn line is on the terminal

    def tick(self, rows, loss_sum):
        """After a step: `rows` trained in this phase so far, `loss_sum` their summed loss."""
        self.steps += 1
        if self.first is None:               # rates count from the first step done, so
            self.first = (self.clock(), rows)   # start-up (first reads, pulls) does not skew
                                                # them; a line due before a second step has none
        if self.every_steps:
            if self.steps % self.every_steps:
                return
        elif self.clock() < self.next_t:
            return
        now = self.clock()
        self.next_t = now + self.every
        self._emit(rows, loss_sum, now, final=False)

    def finish(self, rows, loss_sum):
        """The phase ended after `rows`: a last line at 100% (or clear the redrawn one)."""
        if self.redraw:
            self.clear()
        else:
            self._emit(rows, loss_sum, self.clock(), final=True)

    def clear(self):
        """Remove a redrawn line before another line is printed."""
        if self.drawn:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self.drawn = False

    def total(self):
        """(total rows of this phase or None, whether it is an estimate)."""
        estimated = self.text_bytes > 0
        total = self.known
        if estimated:
            t_rows, t_bytes = self.parsed()
            if t_bytes <= 0:
                return None, True
            if t_bytes >= self.text_bytes:      # all text read: its rows are known
                estimated = False
            total += round(self.text_bytes * t_rows / t_bytes)
        if self.limit:
            total = min(total, self.offset + self.limit)
        return total, estimated

    def _emit(self, rows, loss_sum, now, final):
        done = self.offset + rows
        total, est = (done, False) if final else self.total()
        sec = max(now - self.t0, 1e-9)
        rate = rows / sec if final else None       # the whole phase, at its end
        if not final and self.first is not None and now > self.first[0] and rows > self.first[1]:
            rate = (rows - self.first[1]) / (now - self.first[0])
        loss = loss_sum / max(rows, 1)
        who = f", worker {self.worker[0]} of {self.worker[1]}" if self.worker else ""
        if total is None:
            pos = f"{done:,} rows{who}, total unknown yet"
            pct = ""
        else:
            total = max(total, done)
            p = 100 if final else min(100 * done // max(total, 1), 99)
            self.shown = max(self.shown, p)
            tilde = "~" if est else ""
            pct = f"{tilde}{self.shown}% "
            pos = (f"{done:,} / {tilde}{total:,} rows{' est. from bytes' if est else ''}{who}")
        per = " per worker" if self.worker else ""
        speed = f"{fmt_rate(rate)} ex/s{per}" if rate is not None else "rate after step 2"
        line = f"PROGRESS --> {self.label} {pct}({pos}) {speed}  loss {loss:.4f}"
        if final:
            line += f"  done in {fmt_seconds(sec)}"
        elif total is not None and rate:
            line += f"  ETA {fmt_seconds((total - done) / rate)}"
        if self.lag is not None:
            behind = self.lag()
            if behind:
                line += f"  | {behind}"
        if self.redraw:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
            self.drawn = True
        else:
            self.write(line)


def make_progress(cfg, readers, label, *, redraw=False, offset_batches=0, worker=None,
                  lag=None, write=print, every_steps=0):
    """A Progress over `readers` (DataReaders read side by side) for one phase, or None
    when --progress-every is 0 (and no line every ``every_steps`` steps, a test aid:
    ``mpips.job.hooks``)."""
    if cfg.progress_every <= 0 and not every_steps:
        return None
    known = text = 0
    for r in readers:
        k, t = r.size()
        known, text = known + k, text + t
    per_step = sum(r.batch_size for r in readers) if readers else cfg.batch_size

    def parsed():
        return (sum(r.stats.text_rows for r in readers), sum(r.stats.text_bytes for r in readers))

    return Progress(label, known, text, parsed, cfg.progress_every, write=write, redraw=redraw,
                    limit=cfg.max_steps * per_step, offset=offset_batches * per_step,
                    worker=worker, lag=lag, every_steps=every_steps)
