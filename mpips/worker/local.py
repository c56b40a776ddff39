"""In-process stand-in for PSClient: the same tables and optimizers, no MPI messages.

Both follow ``mpips.interfaces.ParamStore``; here every call is complete on return.

`python -m mpips.train --local` trains through this object; it is the yardstick that
distributed runs are compared with.
"""
from mpips.protocol import Op


class _Done:
    def wait(self):
        return self


class LocalPS:
    """Holds the whole sparse table and the whole dense vector (one 'server')."""
    n_servers = 1

    def __init__(self, sparse, dense):
        self.sparse, self.dense = sparse, dense
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.messages = 0

    def pull(self, plan, out, dense_out=None, step=0, create=True, counts=None):
        if len(plan.keys):
            if counts is not None:
                self.sparse.pull(plan.keys, out, create=create, counts=counts[:, 0])
            else:
                self.sparse.pull(plan.keys, out, create=create)
        if dense_out is not None:
            self.dense.pull(dense_out)
        return _Done()

    def push(self, plan, grads, dense_grad=None, step=0, op=Op.PUSH):
        if op == Op.ADD:
            if len(plan.keys):
                self.sparse.add(plan.keys, grads)
            if dense_grad is not None:
                self.dense.add(dense_grad)
        else:
            if len(plan.keys):
                self.sparse.push(plan.keys, grads)
            if dense_grad is not None:
                self.dense.push(dense_grad)
        return _Done()

