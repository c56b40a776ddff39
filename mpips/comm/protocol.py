"""Wire protocol between workers and servers: op codes and one-buffer message layout.

A request is ONE contiguous uint8 buffer::

    header  int64[HEADER_LEN]   (op, req_id, table, count, step, dim, flags, dense_len)
    keys    int64[count]
    values  float32[count * dim + dense_len]   (sparse rows, then the dense slice if any)

A message may carry several data requests (PULL, PUSH, ADD) back to back: every request
but the last has the ``F_MORE`` flag, and the server serves them in order, exactly as if each had come alone
(an async worker sends the push of step t and the pull of step t+1 as one message a
server, :meth:`mpips.worker.client.PSClient.push_pull`).  At most ``MAX_PARTS`` a message.

Replies to a pull are bare float32 buffers: the sparse rows (tag ``TAG_REPLY_SPARSE``) and,
when asked for, the server's dense slice (tag ``TAG_REPLY_DENSE``).  Replies from one
server arrive in request order (MPI's non-overtaking rule), so a worker matches them by
(source, tag) alone.  Nothing is pickled; a server checks every header before use
(:func:`decode`) and rejects a malformed one with an error naming the sender; a worker's
request that is refused is answered on ``TAG_ERROR`` with that line, so the worker fails
with the server's reason instead of waiting for a reply.

Request ids: a worker numbers its requests 1, 2, 3, ... (one counter for all servers), so
the ids one server sees from one worker increase (MPI keeps one sender's messages in
order).  A request whose id is not above the last one from its sender is a duplicate: the
server counts it and drops it without a reply (it answered the original).

Sizes are checked before anything is received: a message is taken off the wire with
``Mprobe``/``Improbe`` first, and its byte count must fit its tag (``MAX_REQUEST_BYTES``,
``DUMP_BYTES``, ``MAX_LINE_BYTES``); one that does not is discarded unread
(:func:`mpips.comm.liveness.discard`) with a line naming the sender.
"""
from enum import IntEnum

import numpy as np

HEADER_LEN = 8
HEADER_BYTES = HEADER_LEN * 8

TAG_REQUEST = 11        # worker -> server requests
TAG_REPLY_SPARSE = 12   # server -> worker: sparse rows of a pull
TAG_REPLY_DENSE = 13    # server -> worker: dense slice of a pull
TAG_CONTROL = 14        # server -> worker: small int64 replies (stats, acks)
TAG_DUMP = 15           # any rank -> any rank: "say what you are waiting for" (int64[1])
TAG_DUMP_REPLY = 16     # the answer: one UTF-8 status line
TAG_ERROR = 17          # server -> worker: one UTF-8 line saying why a request was refused
BARRIER_KEEPALIVE = -1  # barrier reply meaning "not released yet, the missing workers progress"

# Largest messages each tag accepts (checked with a probe before receiving).
MAX_REQUEST_BYTES = 1 << 30     # a request (worker.client refuses to build a larger one)
DUMP_BYTES = 8                  # a status request is one int64
MAX_LINE_BYTES = 4096           # a status line or a refusal line
MAX_CONFIRM_BYTES = 1 << 20     # a SAVE confirmation (the shard's manifest entry, JSON)

# flags
F_CREATE = 1    # pull: create missing rows (training); without it unknown ids read zeros
F_DENSE = 2     # pull: also return the dense slice; push/add: a dense slice follows the rows
F_MORE = 1 << 30    # PULL, PUSH, ADD: another request follows in the same message
MAX_PARTS = 4       # requests one message may carry


# The STATS reply: int64s, field by field in this order (read it by name: `STATS_DTYPE`).
STATS_DTYPE = np.dtype([
    ("rows", np.int64),               # rows in the sparse table
    ("bytes", np.int64),              # bytes of the sparse and dense tables
    ("requests", np.int64),           # requests served
    ("busy_us", np.int64),            # microseconds spent serving them
    ("ssp_max_lead", np.int64),       # ssp: largest lead of a pull over the slowest worker
    ("admitted", np.int64),           # ids admitted into the table (admission filter)
    ("waiting", np.int64),            # ids seen but not yet admitted
    ("evicted", np.int64),            # rows removed by SHRINK
    ("rejected", np.int64),           # malformed requests rejected
    ("replies_in_flight", np.int64),  # replies sent, not yet taken by the workers
    ("duplicates", np.int64),         # duplicate requests (a request id seen before) dropped
    # async / ssp (mpips.tables.staleness; 0 in other modes), since the start:
    ("staleness_hist", np.int64, (65,)),  # pushed rows by staleness 0..63, [64] = 64 or more
    ("staleness_sum", np.int64),      # sum of the pushed rows' staleness (exact)
    ("staleness_max", np.int64),      # largest staleness of a pushed row
    ("staleness_unmatched", np.int64),  # pushed keys without a recorded pull of their row
    # --table-memory's disk tier (mpips.tables.tiered; 0 without one):
    ("resident_rows", np.int64),      # rows in memory
    ("disk_rows", np.int64),          # rows on disk
    ("disk_bytes", np.int64),         # bytes the disk rows take
    ("tier_hits", np.int64),          # keys found in memory, since the start
    ("tier_misses", np.int64),        # keys not in memory (read from disk, or new)
    ("tier_read_us", np.int64),       # microseconds reading rows from disk
    ("tier_write_us", np.int64),      # microseconds writing rows to disk
])
STATS_LEN = STATS_DTYPE.itemsize // 8   # int64s in a STATS reply


class Op(IntEnum):
    PULL = 1      # read rows for keys (and the dense slice with F_DENSE)
    PUSH = 2      # gradients for keys (and dense); the server's optimizer applies them
    ADD = 3       # GEO-SGD deltas: values += delta for keys (and dense)
    FINISH = 4    # this worker sends no more requests for the current phase
    STATS = 5     # reply int64[STATS_LEN] on TAG_CONTROL: one STATS_DTYPE record
    BARRIER = 6   # reply int64[1] = phase version once every active worker has sent BARRIER
                  # (phase boundary); meanwhile BARRIER_KEEPALIVE while the others progress
    SAVE = 7      # write this server's checkpoint shard: keys = [seq], flags = mode index,
                  # step = in sync mode, save once that many steps of the phase are applied;
                  # reply: the shard's manifest entry as UTF-8 JSON on TAG_CONTROL
    SHRINK = 8    # age rows, evict those unseen for > step shrinks; reply int64[1] removed
    DENSE_PUT = 9   # a worker's dense replica for this server's slice, to be checkpointed:
                    # dense = values then optimizer state (tables.dense.pack_state)
    DENSE_GET = 10  # reply this server's dense slice and its optimizer state (same packing)
                    # on TAG_REPLY_DENSE: what workers start their replicas from


CHAINED = (Op.PULL, Op.PUSH, Op.ADD)     # ops another request may follow in one message


class ProtocolError(ValueError):
    """A request that does not follow the layout above."""


def message_nbytes(count, dim, dense_len):
    """Total bytes of a request with `count` keys of width `dim` plus `dense_len` floats."""
    return HEADER_BYTES + 8 * count + 4 * (count * dim + dense_len)


def encode(buf, op, req_id, table, keys, values, step=0, flags=0, dense=None):
    """Write a request into `buf` (uint8, large enough; a slice of a message's buffer for
    a request after the first); return the used byte length.

    keys: int64 (n,); values: float32 (n, dim) or None; dense: float32 (d,) or None.
    """
    n = len(keys)
    dim = 0 if values is None else values.shape[1]
    d = 0 if dense is None else len(dense)
    nbytes = message_nbytes(n, dim, d)
    hdr = buf[:HEADER_BYTES].view(np.int64)
    hdr[:] = (int(op), req_id, table, n, step, dim, flags, d)
    off = HEADER_BYTES
    buf[off:off + 8 * n].view(np.int64)[:] = keys
    off += 8 * n
    if dim:
        buf[off:off + 4 * n * dim].view(np.float32).reshape(n, dim)[:] = values
        off += 4 * n * dim
    if d:
        buf[off:off + 4 * d].view(np.float32)[:] = dense
    return nbytes


class Request:
    """Decoded views into a received buffer (no copies)."""
    __slots__ = ("op", "req_id", "table", "count", "step", "dim", "flags",
                 "keys", "values", "dense", "nbytes", "more")

    def __init__(self, hdr, keys, values, dense, nbytes=0):
        self.op, self.req_id, self.table, self.count, self.step, self.dim, flags, _ = (
            int(x) for x in hdr)
        self.op = Op(self.op)
        self.more = self.op in CHAINED and bool(flags & F_MORE)   # another request follows
        self.flags = flags & ~F_MORE if self.more else flags      # what the op means by them
        self.keys, self.values, self.dense = keys, values, dense
        self.nbytes = nbytes                    # this request's bytes of its message


def decode(buf, nbytes, n_tables, source, offset=0):
    """Validate and decode a request of `nbytes` bytes from rank `source`, starting at
    byte `offset` of `buf` (a request with ``F_MORE`` takes only its own bytes of them).

    Raises ProtocolError naming the sender for anything inconsistent: unknown op, request
    id below 1, negative or absurd counts, sizes that disagree with the buffer length,
    unknown table.
    """
    if nbytes < HEADER_BYTES or nbytes % 4 or nbytes > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request from rank {source}: {nbytes} bytes is not a valid message")
    hdr = buf[offset:offset + HEADER_BYTES].view(np.int64)
    op, req_id, table, n, _, dim, flags, d = (int(x) for x in hdr)
    if op not in Op._value2member_map_:
        raise ProtocolError(f"request from rank {source}: unknown op code {op}")
    if req_id < 1:
        raise ProtocolError(f"request from rank {source}: request id {req_id}; ids count from 1")
    if not 0 <= table < n_tables:
        raise ProtocolError(f"request from rank {source}: unknown table {table}")
    if n < 0 or dim < 0 or d < 0 or n > nbytes or dim > 1 << 16 or d > nbytes:
        raise ProtocolError(f"request from rank {source}: bad sizes count={n} dim={dim} dense={d}")
    size = message_nbytes(n, dim, d)
    more = op in CHAINED and flags & F_MORE
    if size != nbytes and not (more and size < nbytes):
        raise ProtocolError(
            f"request from rank {source}: header says {size} bytes, message has {nbytes}")
    off = offset + HEADER_BYTES
    keys = buf[off:off + 8 * n].view(np.int64)
    off += 8 * n
    values = buf[off:off + 4 * n * dim].view(np.float32).reshape(n, dim) if dim else None
    off += 4 * n * dim
    dense = buf[off:off + 4 * d].view(np.float32) if d else None
    return Request(hdr, keys, values, dense, size)


def decode_all(buf, nbytes, n_tables, source):
    """The requests of one message of `nbytes` bytes, in order (one, or up to MAX_PARTS
    chained by ``F_MORE``); ProtocolError as :func:`decode` for any of them."""
    reqs, offset = [], 0
    while True:
        req = decode(buf, nbytes - offset, n_tables, source, offset)
        reqs.append(req)
        offset += req.nbytes
        if not req.more:
            return reqs
        if len(reqs) == MAX_PARTS:
            raise ProtocolError(f"request from rank {source}: more than {MAX_PARTS} requests "
                                "in one message")
