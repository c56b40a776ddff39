"""In-process stand-in for PSClient: the same tables and optimizers, no MPI messages.

Both follow ``mpips.worker.interfaces.ParamStore``; here every call is complete on return.

`python -m mpips.train --local` trains through this object; it is the yardstick that
distributed runs are compared with.  Built with a
:class:`mpips.tables.staleness.StalenessTracker` (a simulator of asynchronous workers
does), it counts the staleness of every pushed row as the servers do, keyed by the
``worker`` and ``step`` given to pull and push, and damps each row's learning rate by
``rule`` (``--stale-lr``).
"""
from mpips.comm.protocol import Op
from mpips.config import stale_power
from mpips.tables.staleness import lr_factors


class _Done:
    def wait(self):
        return self


class LocalPS:
    """Holds the whole sparse table and the whole dense vector (one 'server').

    tracker: a StalenessTracker of ``sparse`` or None (no counting); rule: a --stale-lr rule
    (``mpips.config.stale_power``), applied to the counted staleness of each push.
    """
    n_servers = 1

    def __init__(self, sparse, dense, tracker=None, rule="none"):
        stale_power(rule)                   # raises for a rule it is not
        self.sparse, self.dense = sparse, dense
        self.tracker, self.rule = tracker, rule
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.messages = 0

    def pull(self, plan, out, dense_out=None, step=0, create=True, counts=None, worker=0):
        if len(plan.keys):
            rows = self.sparse.pull(plan.keys, out, create=create,
                                    counts=None if counts is None else counts[:, 0])
            if create and self.tracker is not None:
                self.tracker.pulled(worker, step, plan.keys, rows)
        if dense_out is not None:
            self.dense.pull(dense_out)
        return _Done()

    def push(self, plan, grads, dense_grad=None, step=0, op=Op.PUSH, worker=0, lr_scale=None):
        """lr_scale: float32 (u,) learning-rate factors of the rows (``--sync-sparse-lr``)."""
        if op == Op.ADD:
            if len(plan.keys):
                self.sparse.add(plan.keys, grads)
            if dense_grad is not None:
                self.dense.add(dense_grad)
        else:
            if len(plan.keys):
                if self.tracker is not None:
                    lr_scale = lr_factors(self.rule, self.tracker.pushed(worker, step,
                                                                         plan.keys))
                self.sparse.push(plan.keys, grads, lr_scale=lr_scale)
            if dense_grad is not None:
                self.dense.push(dense_grad)
        return _Done()

    def push_pull(self, push_plan, grads, pull_plan, out, step, counts=None):
        self.push(push_plan, grads, step=step)
        return self.pull(pull_plan, out, step=step + 1, counts=counts)
