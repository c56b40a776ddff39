"""gRPC's transport for unary calls: HTTP/2 framing (RFC 9113) written for the purpose, in
the event loop; header blocks decoded by python-hyper's ``hpack`` (RFC 7541).

One ``GrpcConn`` (an ``asyncio.Protocol``) per connection, accepted by the HTTP server's
own ``HttpServer`` (``conn_class``): its listening, idle sweep and graceful stop.  No
thread of its own: a call is answered inline when its request is whole, as an HTTP
request is (``mpips.serving.http``).  Why not grpcio's server or ``h2``: each costs the
server ~0.3-0.5 ms of CPU a call, this ~0.05 ms (docs/serving.md, "gRPC at batch 1").

A unary call: HEADERS (``:method POST``, ``:path /package.Service/Method``,
``content-type application/grpc...``), DATA = the message with its 5-byte prefix (a
compressed flag, then the length, big-endian).  The answer: HEADERS (``:status 200``),
DATA (the answer with its prefix, sent as the client's flow-control windows open), then
trailers (``grpc-status``, ``grpc-message`` percent-encoded, ``model-version``).  An error
is a trailers-only answer.  Refused before the servicer: an unknown method
(UNIMPLEMENTED), a compressed message (UNIMPLEMENTED: ``grpc-accept-encoding: identity``
says so), a message whose prefix does not match its bytes or a second message (INTERNAL),
a message over ``max_body`` (RESOURCE_EXHAUSTED, as soon as its prefix says so), a request
that is not a gRPC POST (HTTP 415 / 405), a stream over ``STREAMS`` at once (RST_STREAM
REFUSED_STREAM).  Anything that breaks HTTP/2 (a bad preface, a frame over 16 KiB, a
header block HPACK cannot decode or over ``max_head``, a frame where the protocol forbids
it, a window past 2^31-1) closes the connection with a GOAWAY naming the error.
Our header blocks are written without the dynamic table or Huffman coding (constants, and
three literals); PRIORITY and unknown frame types are ignored, as RFC 9113 allows.
``grpc-timeout`` is not enforced: a call is answered as soon as it is whole, in one pass.
"""
import time
from urllib.parse import quote

from hpack import Decoder, HPACKError

from mpips.serving.http import ServerConn

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
(DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE,
 CONTINUATION) = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM = 0, 1, 3, 6, 7
COMPRESSION_ERROR = 9
FRAME_MAX = 16384           # our SETTINGS_MAX_FRAME_SIZE (the default): a longer frame closes
WINDOW = 1 << 20            # our receive window, of the connection and of each stream
STREAMS = 100               # concurrent calls on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)
MAX_WINDOW = (1 << 31) - 1
CODES = {"OK": b"0", "INVALID_ARGUMENT": b"3", "NOT_FOUND": b"5", "RESOURCE_EXHAUSTED": b"8",
         "UNIMPLEMENTED": b"12", "INTERNAL": b"13", "UNAVAILABLE": b"14"}
SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")   # grpc-message as is


def frame(kind, flags, sid, payload=b""):
    """One HTTP/2 frame: the 9-byte header (length, type, flags, stream), then the payload."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big")
            + payload)


def _int(n, prefix, first=0):
    """HPACK's integer (RFC 7541 5.1) with a ``prefix``-bit prefix, ``first``: the bits above."""
    top = (1 << prefix) - 1
    if n < top:
        return bytes((first | n,))
    out, n = bytearray((first | top,)), n - top
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name, value):
    """A header field without indexing (RFC 7541 6.2.2), raw strings; ``name`` an int: the
    static table's index of the name."""
    head = _int(name, 4) if isinstance(name, int) else b"\x00" + _int(len(name), 7) + name
    return head + _int(len(value), 7) + value


ANSWER = (b"\x88"                                             # :status 200 (static index 8)
          + _literal(31, b"application/grpc")                 # content-type (static 31)
          + _literal(b"grpc-accept-encoding", b"identity"))
STATUS = {code: _literal(b"grpc-status", v) for code, v in CODES.items()}


def trailers(code, text, version):
    """The header block of the trailers: status, message (percent-encoded), version."""
    block = STATUS[code]
    if text:
        block += _literal(b"grpc-message", quote(text[:2000], safe=SAFE).encode("ascii"))
    if version is not None:
        block += _literal(b"model-version", version.encode("utf-8", "replace"))
    return block


class _Call:
    """One stream: the request being read, then the answer being sent."""
    __slots__ = ("path", "buf", "out", "trailers", "done", "ended", "window", "unacked")

    def __init__(self, path, window):
        self.path, self.buf, self.out, self.trailers = path, bytearray(), b"", None
        self.done = self.ended = False         # answered; the client's END_STREAM seen
        self.window, self.unacked = window, 0  # what we may send; what it sent unacknowledged


class _Broken(Exception):
    """The connection breaks HTTP/2: GOAWAY with ``code``, then close."""

    def __init__(self, code, why):
        super().__init__(why)
        self.code = code


class GrpcConn(ServerConn):
    """One HTTP/2 connection of unary gRPC calls; ``server`` is the ``HttpServer`` that
    accepted it (``handler``: the servicer, with ``methods`` and ``call(path, message)``;
    ``max_body``: the largest message; ``max_head``: the largest header block)."""

    def __init__(self, server):
        super().__init__(server)                # (buf: the bytes not yet read)
        self.out = []                           # frames not yet written
        self.started = False                    # the client's preface read
        self.hpack = Decoder()
        self.hpack.max_header_list_size = server.max_head
        self.head = None                         # (stream, flags, block) awaiting CONTINUATION
        self.calls = {}                          # stream id -> _Call not yet answered in full
        self.last_sid = 0                        # the highest stream the client opened
        self.window, self.unacked = 65535, 0     # connection: what we may send; read unacked
        self.initial, self.frame_max = 65535, 16384   # the client's SETTINGS

    @property
    def busy(self):
        return bool(self.calls)

    def connection_made(self, transport):
        super().connection_made(transport)
        transport.write(frame(SETTINGS, 0, 0, (3).to_bytes(2, "big") + STREAMS.to_bytes(4, "big")
                              + (4).to_bytes(2, "big") + WINDOW.to_bytes(4, "big"))
                        + frame(WINDOW_UPDATE, 0, 0, (WINDOW - 65535).to_bytes(4, "big")))

    def connection_lost(self, exc):
        self.calls.clear()
        super().connection_lost(exc)

    # ------------------------------------------------------------ bytes in
    def data_received(self, data):
        if self.closing:
            return
        self.last = time.monotonic()
        buf = self.buf
        buf += data
        try:
            if not self.started:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _Broken(PROTOCOL_ERROR, "not the HTTP/2 preface")
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    raise _Broken(PROTOCOL_ERROR, "not the HTTP/2 preface")
                del buf[:len(PREFACE)]
                self.started = True
            pos, end = 0, len(buf)
            while end - pos >= 9 and not self.closing:
                n = int.from_bytes(buf[pos:pos + 3], "big")
                if n > FRAME_MAX:
                    raise _Broken(FRAME_SIZE_ERROR, f"a frame of {n} bytes")
                if end - pos - 9 < n:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & MAX_WINDOW
                payload = bytes(buf[pos + 9:pos + 9 + n])
                pos += 9 + n
                self._frame(kind, flags, sid, payload)
            del buf[:pos]
        except _Broken as e:
            self._close(e.code, str(e))
            return
        if self.out:
            self.transport.write(b"".join(self.out))
            self.out.clear()
        if self.closing or (self.server.stopping and not self.calls):
            self._close()

    def _frame(self, kind, flags, sid, payload):
        if self.head is not None and (kind != CONTINUATION or sid != self.head[0]):
            raise _Broken(PROTOCOL_ERROR, "a header block not continued")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            if sid == 0 or sid % 2 == 0:
                raise _Broken(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
            block = self._unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                if len(block) < 5:
                    raise _Broken(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
                block = block[5:]
            self.head = (sid, flags, bytearray(block))
            self._continued(flags)
        elif kind == CONTINUATION:
            if self.head is None:
                raise _Broken(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self.head[2].extend(payload)
            self._continued(flags)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                raise _Broken(FRAME_SIZE_ERROR, "WINDOW_UPDATE not of 4 bytes")
            inc = int.from_bytes(payload, "big") & MAX_WINDOW
            if sid == 0:
                if inc == 0 or self.window + inc > MAX_WINDOW:
                    raise _Broken(PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR,
                                  f"connection WINDOW_UPDATE of {inc}")
                self.window += inc
                for s in list(self.calls):
                    self._send(s)
            elif sid in self.calls:
                call = self.calls[sid]
                if inc == 0 or call.window + inc > MAX_WINDOW:
                    raise _Broken(PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR,
                                  f"stream {sid} WINDOW_UPDATE of {inc}")
                call.window += inc
                self._send(sid)
        elif kind == PING:
            if sid != 0 or len(payload) != 8:
                raise _Broken(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "a bad PING")
            if not flags & ACK:
                self.out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise _Broken(PROTOCOL_ERROR if sid == 0 else FRAME_SIZE_ERROR, "a bad RST_STREAM")
            self.calls.pop(sid, None)
        elif kind == GOAWAY:                          # the client is leaving
            self.closing = True
        elif kind == PUSH_PROMISE:
            raise _Broken(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        elif kind == PRIORITY and len(payload) != 5:
            raise _Broken(FRAME_SIZE_ERROR, "PRIORITY not of 5 bytes")
        # PRIORITY and unknown types: ignored

    @staticmethod
    def _unpad(flags, payload):
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _Broken(PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1:len(payload) - payload[0]]

    def _settings(self, flags, sid, payload):
        if sid != 0:
            raise _Broken(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _Broken(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _Broken(FRAME_SIZE_ERROR, "SETTINGS not in 6-byte entries")
        for k in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[k:k + 2], "big"), int.from_bytes(
                payload[k + 2:k + 6], "big")
            if key == 4:                                       # INITIAL_WINDOW_SIZE
                if value > MAX_WINDOW:
                    raise _Broken(FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value}")
                for call in self.calls.values():
                    call.window += value - self.initial
                self.initial = value
            elif key == 5:                                     # MAX_FRAME_SIZE
                if not 16384 <= value < 1 << 24:
                    raise _Broken(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.frame_max = value
        self.out.append(frame(SETTINGS, ACK, 0))
        for s in list(self.calls):
            self._send(s)

    def _continued(self, flags):
        """A header block whole (END_HEADERS) is decoded (always: HPACK's table is the
        connection's) and acted on; one still open must stay under ``max_head``."""
        sid, first, block = self.head
        if not flags & END_HEADERS:
            if len(block) > self.server.max_head:
                raise _Broken(PROTOCOL_ERROR, f"a header block over {self.server.max_head} bytes")
            return
        self.head = None
        try:
            headers = self.hpack.decode(bytes(block), raw=True)
        except HPACKError as e:
            raise _Broken(COMPRESSION_ERROR, f"header block: {type(e).__name__}") from None
        if sid <= self.last_sid:                 # trailers of a call, or of one gone
            if first & END_STREAM and sid in self.calls:
                self._end(sid)
            return
        self.last_sid = sid
        if len(self.calls) >= STREAMS:
            self.out.append(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        self._begin(sid, dict(headers))
        if first & END_STREAM and sid in self.calls:
            self._end(sid)

    def _begin(self, sid, head):
        call = self.calls[sid] = _Call(head.get(b":path", b"").decode("latin-1"), self.initial)
        if head.get(b":method") != b"POST":
            return self._refuse(sid, b"405")
        if not head.get(b"content-type", b"").startswith(b"application/grpc"):
            return self._refuse(sid, b"415")
        if call.path not in self.server.handler.methods:
            self._answer(sid, None, "UNIMPLEMENTED", f"unknown method {call.path[:200]}", None)

    def _data(self, flags, sid, payload):
        if sid == 0 or sid > self.last_sid:
            raise _Broken(PROTOCOL_ERROR, f"DATA on stream {sid}, not open")
        n = len(payload)         # flow control counts the padding; what is read is given
        self.unacked += n        # back once half a window (a frame is at most 16 KiB, so a
        if self.unacked >= WINDOW // 2:         # client within its window never overruns)
            self.out.append(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
            self.unacked = 0
        data = self._unpad(flags, payload)
        call = self.calls.get(sid)
        if call is None or call.ended:
            return                                       # answered or reset: dropped
        call.unacked += n
        if flags & END_STREAM:
            call.ended = True
        elif call.unacked >= WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, sid, call.unacked.to_bytes(4, "big")))
            call.unacked = 0
        if call.done:
            return                                       # answered: the rest is dropped
        call.buf += data
        buf = call.buf
        if len(buf) >= 5:
            n, limit = int.from_bytes(buf[1:5], "big"), self.server.max_body
            if buf[0]:
                return self._answer(sid, None, "UNIMPLEMENTED", "compressed messages are not "
                                    "supported: send them uncompressed (grpc-encoding "
                                    "identity)", None)
            if n > limit:
                return self._answer(sid, None, "RESOURCE_EXHAUSTED", f"message of {n} bytes "
                                    f"is over the limit of {limit} (--max-body-bytes)", None)
            if len(buf) > n + 5:
                return self._answer(sid, None, "INTERNAL", "more than one message in a unary "
                                    "call", None)
        if call.ended:
            self._end(sid)

    def _end(self, sid):
        call = self.calls[sid]
        call.ended = True
        if call.done:
            return self._send(sid)
        buf = call.buf
        if len(buf) < 5 or int.from_bytes(buf[1:5], "big") != len(buf) - 5:
            n = int.from_bytes(buf[1:5], "big") if len(buf) >= 5 else None
            return self._answer(sid, None, "INTERNAL", f"the message has {max(0, len(buf) - 5)} "
                                f"bytes, its prefix says {n} (a 5-byte prefix, then the message)",
                                None)
        self._answer(sid, *self.server.handler.call(call.path, bytes(memoryview(buf)[5:])))

    # ------------------------------------------------------------ answers out
    def _answer(self, sid, message, code, text, version):
        """Answer stream ``sid``: the message (if any), then the status as trailers; a
        request still being sent is told to stop (RST_STREAM NO_ERROR) once answered."""
        call = self.calls[sid]
        call.done, call.buf = True, bytearray()
        tail = trailers(code, text, version)
        if message is None:                               # trailers only
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, ANSWER + tail))
            return self._finish(sid)
        self.out.append(frame(HEADERS, END_HEADERS, sid, ANSWER))
        call.out, call.trailers = len(message).to_bytes(5, "big") + message, tail
        self._send(sid)

    def _send(self, sid):
        """Send what the flow-control windows allow of the answer of ``sid``; its trailers
        when it has all gone."""
        call = self.calls.get(sid)
        if call is None or call.trailers is None:
            return
        while call.out:
            room = min(self.window, call.window, self.frame_max)
            if room <= 0:
                return                                    # a WINDOW_UPDATE sends the rest
            piece, call.out = call.out[:room], call.out[room:]
            self.window -= len(piece)
            call.window -= len(piece)
            self.out.append(frame(DATA, 0, sid, piece))
        self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, call.trailers))
        self._finish(sid)

    def _finish(self, sid):
        if not self.calls.pop(sid).ended:                # answered before sent in full
            self.out.append(frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big")))

    def _refuse(self, sid, status):
        self.calls[sid].done = True
        self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, _literal(8, status)))
        self._finish(sid)

    # ------------------------------------------------------------ the server's calls
    def _fail(self, status, message):     # a call stalled past the idle timeout
        self._close()

    def _close(self, code=NO_ERROR, why=""):
        """GOAWAY (the last stream begun is the last served; ``code`` and ``why``: what broke
        HTTP/2), then close."""
        self.closing = True
        self.calls.clear()
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(b"".join(self.out) + frame(
            GOAWAY, 0, 0, self.last_sid.to_bytes(4, "big") + code.to_bytes(4, "big")
            + why.encode("ascii", "replace")[:200]))
        self.out.clear()
        self.transport.close()
