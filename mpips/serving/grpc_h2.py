"""gRPC's transport for unary calls: HTTP/2 by python-hyper's ``h2``, in the event loop.

One ``GrpcConn`` (an ``asyncio.Protocol``) per connection, accepted by the HTTP server's
own ``HttpServer`` (``conn_class``): its listening, idle sweep and graceful stop.  No
thread of its own: a call is answered inline when its request is whole, as an HTTP
request is (``mpips.serving.http``), so the gRPC port costs what HTTP/2 framing costs
and no more (grpcio's runtime took ~0.5 ms of CPU a call: docs/serving.md).

A unary call: HEADERS (``:method POST``, ``:path /package.Service/Method``,
``content-type application/grpc...``), DATA = the message with its 5-byte prefix (a
compressed flag, then the length, big-endian).  The answer: HEADERS (``:status 200``),
DATA (the answer with its prefix, sent as the client's flow-control window opens), then
trailers (``grpc-status``, ``grpc-message`` percent-encoded, ``model-version``).  An error
is a trailers-only answer.  Refused here, before the servicer: an unknown method
(UNIMPLEMENTED), a compressed message (UNIMPLEMENTED: ``grpc-accept-encoding:
identity`` says so), a message whose prefix does not match its bytes or a second message
(INTERNAL), a message over ``max_body`` (RESOURCE_EXHAUSTED, as soon as its prefix says
so), a request that is not a gRPC POST (HTTP 415 / 405).  A connection that breaks HTTP/2
(a bad preface, garbage) is closed; PING and SETTINGS are answered by ``h2``.
``grpc-timeout`` is not enforced: a call is answered as soon as it is whole, in one pass.
"""
import asyncio
import socket
import time
from urllib.parse import quote

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (ConnectionTerminated, DataReceived, RemoteSettingsChanged,
                       RequestReceived, StreamEnded, StreamReset, WindowUpdated)
from h2.exceptions import H2Error
from h2.settings import SettingCodes, Settings
from hpack import Encoder

CONFIG = H2Configuration(client_side=False, header_encoding=None,
                         validate_outbound_headers=False, normalize_outbound_headers=False)
WINDOW = 1 << 20            # receive window of a stream and of the connection, bytes
STREAMS = 100               # concurrent calls on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)
FRAME_MAX = 9 + 16384       # bytes of a frame at most (our SETTINGS_MAX_FRAME_SIZE: the default)
ANSWER = ((b":status", b"200"), (b"content-type", b"application/grpc"),
          (b"grpc-accept-encoding", b"identity"))
CODES = {"OK": b"0", "INVALID_ARGUMENT": b"3", "NOT_FOUND": b"5", "RESOURCE_EXHAUSTED": b"8",
         "UNIMPLEMENTED": b"12", "INTERNAL": b"13", "UNAVAILABLE": b"14"}
SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")   # grpc-message as is


class _Plain(Encoder):
    """HPACK without Huffman coding: pure Python Huffman costs more CPU than the bytes it
    saves on loopback-sized headers (grpc's C core writes its headers raw too)."""

    def encode(self, headers, huffman=True):
        return super().encode(headers, huffman=False)


class _Call:
    """One stream: the request being read, then the answer being sent."""
    __slots__ = ("path", "buf", "out", "trailers", "done")

    def __init__(self, path):
        self.path, self.buf, self.out, self.trailers, self.done = path, bytearray(), b"", None, False


def trailers(code, text, version):
    t = [(b"grpc-status", CODES[code])]
    if text:
        t.append((b"grpc-message", quote(text[:2000], safe=SAFE).encode("ascii")))
    if version is not None:
        t.append((b"model-version", version.encode("utf-8", "replace")))
    return t


class GrpcConn(asyncio.Protocol):
    """One HTTP/2 connection of unary gRPC calls; ``server`` is the ``HttpServer`` that
    accepted it (``handler``: the servicer's ``call``, ``max_body``: the message limit)."""

    def __init__(self, server):
        self.server, self.transport = server, None
        self.h2 = H2Connection(CONFIG)
        self.h2.encoder = _Plain()
        self.calls = {}                     # stream id -> _Call not yet answered in full
        self.closing = False
        self.last = time.monotonic()

    @property
    def busy(self):
        return bool(self.calls)

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.server.conns.add(self)
        self.h2.local_settings = Settings(client=False, initial_values={
            SettingCodes.INITIAL_WINDOW_SIZE: WINDOW, SettingCodes.MAX_CONCURRENT_STREAMS: STREAMS})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(WINDOW - 65535)
        transport.write(self.h2.data_to_send())

    def connection_lost(self, exc):
        self.server.conns.discard(self)
        self.closing = True
        self.calls.clear()
        self.server.wake()

    # ------------------------------------------------------------ bytes in
    def data_received(self, data):
        if self.closing:
            return
        self.last = time.monotonic()
        try:
            events = self.h2.receive_data(data)
            for ev in events:
                kind = type(ev)
                if kind is DataReceived:
                    self._data(ev)
                elif kind is RequestReceived:
                    self._begin(ev)
                elif kind is StreamEnded:
                    self._end(ev.stream_id)
                elif kind is WindowUpdated or kind is RemoteSettingsChanged:
                    for sid in list(self.calls):
                        self._send(sid)
                elif kind is StreamReset:
                    self.calls.pop(ev.stream_id, None)
                elif kind is ConnectionTerminated:       # the client's GOAWAY
                    self.closing = True
        except H2Error:                    # not HTTP/2, or HTTP/2 broken: close (h2's GOAWAY)
            self.closing = True
        if len(self.h2.incoming_buffer._data) > FRAME_MAX:   # h2 checks a frame's length
            self.closing = True            # only once it has all its bytes: not up to 16 MB
        out = self.h2.data_to_send()
        if out:
            self.transport.write(out)
        if self.closing or (self.server.stopping and not self.calls):
            self._close()

    def _begin(self, ev):
        sid, head = ev.stream_id, dict(ev.headers)
        call = self.calls[sid] = _Call(head.get(b":path", b"").decode("latin-1"))
        if head.get(b":method") != b"POST":
            return self._refuse(sid, b"405")
        if not head.get(b"content-type", b"").startswith(b"application/grpc"):
            return self._refuse(sid, b"415")
        if call.path not in self.server.handler.methods:
            self._answer(sid, None, "UNIMPLEMENTED", f"unknown method {call.path[:200]}", None)

    def _data(self, ev):
        sid = ev.stream_id
        self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        call = self.calls.get(sid)
        if call is None or call.done:
            return                                        # answered: the rest is dropped
        call.buf += ev.data
        buf = call.buf
        if len(buf) >= 5:
            n, limit = int.from_bytes(buf[1:5], "big"), self.server.max_body
            if buf[0]:
                self._answer(sid, None, "UNIMPLEMENTED", "compressed messages are not "
                             "supported: send them uncompressed (grpc-encoding identity)", None)
            elif n > limit:
                self._answer(sid, None, "RESOURCE_EXHAUSTED", f"message of {n} bytes is over "
                             f"the limit of {limit} (--max-body-bytes)", None)
            elif len(buf) > n + 5:
                self._answer(sid, None, "INTERNAL", "more than one message in a unary call", None)

    def _end(self, sid):
        call = self.calls.get(sid)
        if call is None or call.done:
            return
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
            self.h2.send_headers(sid, ANSWER + tuple(tail), end_stream=True)
            self._finish(sid)
            return
        self.h2.send_headers(sid, ANSWER)
        call.out, call.trailers = len(message).to_bytes(5, "big") + message, tail
        self._send(sid)

    def _send(self, sid):
        """Send what the flow-control windows allow of the answer of ``sid``; its trailers
        when it has all gone."""
        call = self.calls.get(sid)
        if call is None or call.trailers is None:
            return
        h2 = self.h2
        while call.out:
            room = min(h2.local_flow_control_window(sid), h2.max_outbound_frame_size)
            if room <= 0:
                return                                    # WindowUpdated sends the rest
            h2.send_data(sid, call.out[:room])
            call.out = call.out[room:]
        h2.send_headers(sid, call.trailers, end_stream=True)
        self._finish(sid)

    def _finish(self, sid):
        del self.calls[sid]
        if self.h2.streams.get(sid) is not None and self.h2.streams[sid].open:
            self.h2.reset_stream(sid, ErrorCodes.NO_ERROR)   # answered before sent in full

    def _refuse(self, sid, status):
        self.calls[sid].done = True
        self.h2.send_headers(sid, ((b":status", status),), end_stream=True)
        self._finish(sid)

    # ------------------------------------------------------------ the server's calls
    def _fail(self, status, message):     # a call stalled past the idle timeout
        self._close()

    def _close(self):
        """GOAWAY (the last stream begun is the last served), then close."""
        if self.transport is None or self.transport.is_closing():
            self.closing = True
            return
        self.closing = True
        self.calls.clear()
        try:
            self.h2.close_connection()
            self.transport.write(self.h2.data_to_send())
        except H2Error:
            pass
        self.transport.close()
