"""The two seams of mpips, stated once: what the trainer asks of a parameter store, and what
the training loops ask of a backend.

* ``ParamStore``: the trainer (``mpips.worker.trainer``) pulls rows and pushes gradients
  through it, and does not know whether it is ``mpips.worker.client.PSClient`` (servers over
  MPI) or ``mpips.worker.local.LocalPS`` (the tables in this process).  Both return a
  ``Waitable`` from every call, so the loop is the same: ``h = ps.pull(...); ...; h.wait()``
  (ps-lite's ``Push``/``Pull`` + ``Wait(ts)``; for LocalPS the work is done on return).
* ``Backend``: ``mpips.job.loop.run_epochs`` (batch training) and ``mpips.job.stream.run_stream``
  (online training) drive a job step by step through it, either ``mpips.job.loop.LocalBackend``
  (one process) or ``mpips.job.distributed.DistBackend`` (one of W workers; results are reduced
  over the workers, and the first worker logs, saves and shrinks for all).

Nothing here runs; the classes are ``typing.Protocol`` s (structural: the implementations
do not inherit from them).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import numpy as np

from mpips.metrics import BinaryMetrics
from mpips.tables.ownership import KeyPlan
from mpips.comm.protocol import Op


class Waitable(Protocol):
    """An outstanding pull or push."""

    def wait(self) -> "Waitable":
        """Block until the request is complete (a pull's rows are in its ``out``); return self.

        A distributed wait fails the job with PeerTimeout when a server does not answer
        within --peer-timeout."""


class ParamStore(Protocol):
    """Sparse rows and the dense vector, as the trainer sees them."""

    n_servers: int       # the key plan groups keys by this many owners
    wait_s: float        # seconds spent in wait() (0 for LocalPS)
    bytes_sent: int      # request bytes sent (0 for LocalPS)
    messages: int        # data messages sent (PULL, PUSH, ADD; a push with the next pull
                         # is one message) (0 for LocalPS)

    def pull(self, plan: KeyPlan, out: np.ndarray, dense_out: Optional[np.ndarray] = None,
             step: int = 0, create: bool = True,
             counts: Optional[np.ndarray] = None, worker: int = 0) -> Waitable:
        """Fill ``out`` (u, dim) float32 with the rows of ``plan.keys`` and ``dense_out`` (P,)
        with the dense vector, if given.

        create: make missing rows (training); without it unknown ids read as zeros.
        counts: (u, 1) float32 occurrences of each key in the batch, for admission.
        step: this worker's step in the phase (sync/ssp servers order pulls by it).
        worker: which worker pulls, for the staleness count of an in-process store that
        stands for several (a server knows the sender: PSClient ignores it).
        """

    def push(self, plan: KeyPlan, grads: np.ndarray, dense_grad: Optional[np.ndarray] = None,
             step: int = 0, op: Op = Op.PUSH, worker: int = 0,
             lr_scale: Optional[np.ndarray] = None) -> Waitable:
        """Send ``grads`` (u, dim) for ``plan.keys`` (and ``dense_grad`` (P,)) to the optimizer;
        ``op=Op.ADD`` adds GEO-SGD deltas to the values instead.  worker: as in pull.
        lr_scale: float32 (u,) factors of the rows' learning rate (one process's summed
        pushes, ``--sync-sparse-lr count``; servers compute their own)."""

    def push_pull(self, push_plan: KeyPlan, grads: np.ndarray, pull_plan: KeyPlan,
                  out: np.ndarray, step: int, counts: Optional[np.ndarray] = None) -> Waitable:
        """``push(push_plan, grads, step=step)`` then ``pull(pull_plan, out, step=step + 1,
        counts=counts)``, the pull answered after the push is applied; over MPI one
        message a server (async and ssp: a step's push and the next step's pull)."""


class Backend(Protocol):
    """One step of a job at a time, in one process or as one of W workers."""

    trainer: object      # the Trainer/GeoTrainer (run_epochs sets its on_step hook)
    is_logger: bool      # this process logs, writes metrics and saves (the first worker)

    def train(self, files: list, epoch: int, skip: int = 0, label: Optional[str] = None,
              lag: Optional[Callable[[], str]] = None) -> object:
        """Train on ``files`` (skipping ``skip`` batches trained before a resume); return the
        EpochStats of all workers, with the run's facts for the record in ``extra``.
        The first worker's PROGRESS line names the phase ``label`` (default "epoch N")
        and, for a stream, appends ``lag()`` (how far it is behind the newest pass)."""

    def evaluate(self, files: list) -> Optional[BinaryMetrics]:
        """Metrics of the current model on ``files`` over all workers (None if no files)."""

    def save(self, mode: str, meta: dict, step: int = 0) -> Optional[str]:
        """Save a checkpoint (full/base/delta) with ``meta``; return its directory on the
        logger (None elsewhere).  ``step``: mid-epoch, the steps done in this phase."""

    def shrink(self, threshold: int) -> int:
        """Age every row; evict rows unseen for more than ``threshold`` shrinks; return the
        rows removed (on the logger; 0 elsewhere).  Returns on every worker only after the
        eviction, so no pull that follows is served before it."""

    def stats(self) -> dict:
        """Table facts for the record: table_rows, table_bytes, admitted_total, ids_waiting
        (and more when distributed); {} on workers that do not log."""

    def decide(self, fn: Callable[[], object]) -> object:
        """``fn()`` evaluated once (on the logger) and the same answer on every worker
        (the next stream pass, or None)."""

    def emit(self, rec: dict) -> None:
        """Write the record to --metrics-out (on the logger)."""
