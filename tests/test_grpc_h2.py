"""The gRPC port's HTTP/2 transport (``mpips.serving.grpc_h2.GrpcConn``), in process: an
``h2`` client connection talks to a GrpcConn through an in-memory transport, so each case
of the wire (flow control, concurrent streams, framing errors, resets, PING, stop) is
checked against what the client reads back.  The servicer is a double that echoes its
message three times (the reference answer); the real servicer over a socket, with
grpcio's and tritonclient's clients, is in tests/test_serve_clients.py."""
import asyncio
import socket
import time
from urllib.parse import unquote

import pytest

h2 = pytest.importorskip("h2")
from h2.config import H2Configuration  # noqa: E402
from h2.connection import H2Connection  # noqa: E402
from h2.events import (ConnectionTerminated, DataReceived, PingAckReceived,  # noqa: E402
                       ResponseReceived, SettingsAcknowledged, StreamEnded, StreamReset,
                       TrailersReceived)
from h2.settings import SettingCodes  # noqa: E402

from mpips.serving.grpc_h2 import GrpcConn  # noqa: E402
from mpips.serving.http import HttpServer  # noqa: E402

pytestmark = pytest.mark.unit
PATH = "/inference.GRPCInferenceService/ModelInfer"


class Echo:
    """A servicer double: the message three times, version v7; ``bad`` answers an error."""
    methods = {PATH}

    def __init__(self):
        self.calls = []

    def call(self, path, message):
        self.calls.append(message)
        if message.startswith(b"bad"):
            return None, "INVALID_ARGUMENT", "50% wrong: caf\u00e9 \u2013 see\nthis", "v7"
        return message * 3, "OK", "", "v7"


class Transport:
    def __init__(self):
        self.out, self.closed = bytearray(), False

    def write(self, b):
        self.out += b

    def get_extra_info(self, key):
        return None

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


class Server:                 # what GrpcConn reads of the HttpServer that accepted it
    def __init__(self, max_body=1 << 20):
        self.handler, self.max_body, self.conns, self.stopping = Echo(), max_body, set(), False

    def wake(self):
        pass


class Client:
    """An h2 client wired to a GrpcConn; ``pump`` moves bytes both ways and collects the
    client's events; ``window``: the client's receive window (acknowledged as read)."""

    def __init__(self, window=None, max_body=1 << 20):
        self.server, self.t = Server(max_body), Transport()
        self.conn = GrpcConn(self.server)
        self.conn.connection_made(self.t)
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        if window is not None:
            self.h2.local_settings = h2.settings.Settings(
                client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.h2.initiate_connection()
        self.events = []
        self.pump()

    def pump(self, raw=b""):
        if raw:
            self.conn.data_received(raw)
        for _ in range(10000):
            d = self.h2.data_to_send()
            if d:
                self.conn.data_received(d)
            if not self.t.out:
                if not d:
                    return self.events
                continue
            got, self.t.out = bytes(self.t.out), bytearray()
            for ev in self.h2.receive_data(got):
                self.events.append(ev)
                if isinstance(ev, DataReceived):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        raise AssertionError("no quiescence")

    def open(self, path=PATH, ctype=b"application/grpc"):
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"),
                                   (b":path", path.encode()), (b":authority", b"x"),
                                   (b"content-type", ctype), (b"te", b"trailers")])
        return sid

    def send(self, sid, data, end=True):
        """Send ``data`` as the flow-control windows allow (pumping between frames)."""
        pos = 0
        while pos < len(data) or end:
            room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            piece = data[pos:pos + room]
            pos += len(piece)
            last = end and pos >= len(data)
            self.h2.send_data(sid, piece, end_stream=last)
            self.pump()
            if last:
                return

    def answer(self, sid):
        """(message bytes, trailers dict, ended) of stream ``sid`` read so far."""
        data, trailers, ended = b"", {}, False
        for ev in self.events:
            if getattr(ev, "stream_id", None) != sid:
                continue
            if isinstance(ev, DataReceived):
                data += ev.data
            elif isinstance(ev, (TrailersReceived, ResponseReceived)):
                trailers.update(dict(ev.headers))
            elif isinstance(ev, StreamEnded):
                ended = True
        return data, trailers, ended


def prefixed(msg, flag=0):
    return bytes((flag,)) + len(msg).to_bytes(4, "big") + msg


def test_a_unary_call_answers_message_status_and_version():
    c = Client()
    sid = c.open()
    c.send(sid, prefixed(b"hello"))
    data, tr, ended = c.answer(sid)
    assert ended and data == prefixed(b"hello" * 3)
    assert tr[b":status"] == b"200" and tr[b"grpc-status"] == b"0"
    assert tr[b"model-version"] == b"v7" and not c.conn.busy


def test_an_error_is_trailers_only_with_the_message_percent_encoded():
    c = Client()
    sid = c.open()
    c.send(sid, prefixed(b"bad request"))
    data, tr, ended = c.answer(sid)
    assert ended and data == b"" and tr[b"grpc-status"] == b"3"
    assert unquote(tr[b"grpc-message"].decode("ascii")) == "50% wrong: caf\u00e9 \u2013 see\nthis"
    assert all(0x20 <= b < 0x7F for b in tr[b"grpc-message"])


def test_answer_larger_than_the_client_window_is_sent_as_it_opens():
    c = Client(window=1000)                      # the answer: 3 x 20,000 bytes
    msg = bytes(range(256)) * 78 + b"x" * 32
    sid = c.open()
    c.send(sid, prefixed(msg))
    data, tr, ended = c.answer(sid)
    assert ended and data == prefixed(msg * 3) and tr[b"grpc-status"] == b"0"
    sizes = [len(e.data) for e in c.events if isinstance(e, DataReceived)]
    assert max(sizes) <= 1000 and len(sizes) >= 60          # waited on the window


def test_request_larger_than_the_default_window_is_read_whole():
    c = Client()
    msg = b"r" * 300_000                         # > 65,535: WINDOW_UPDATEs needed
    sid = c.open()
    c.send(sid, prefixed(msg))
    data, tr, _ = c.answer(sid)
    assert c.server.handler.calls == [msg] and data == prefixed(msg * 3)


def test_concurrent_streams_on_one_connection_get_their_own_answers():
    c = Client()
    sids = [c.open() for _ in range(3)]
    msgs = {s: f"call {s} ".encode() * (s * 50) for s in sids}
    for s in sids:                               # interleaved: half of each, then the rest
        c.send(s, prefixed(msgs[s])[:40], end=False)
    assert c.conn.busy
    for s in reversed(sids):
        c.send(s, prefixed(msgs[s])[40:])
    for s in sids:
        data, tr, ended = c.answer(s)
        assert ended and data == prefixed(msgs[s] * 3) and tr[b"grpc-status"] == b"0"
    assert not c.conn.busy


@pytest.mark.parametrize("body, status, words", [
    (prefixed(b"zipped", flag=1), b"12", "compressed"),
    (prefixed(b"0123456789")[:10], b"13", "prefix says 10"),
    (prefixed(b"one") + prefixed(b"two"), b"13", "more than one message"),
    (b"\0\0", b"13", "prefix says None"),
])
def test_framing_errors_answer_the_grpc_status(body, status, words):
    c = Client()
    sid = c.open()
    c.send(sid, body)
    data, tr, ended = c.answer(sid)
    assert ended and tr[b"grpc-status"] == status, tr
    assert words in unquote(tr[b"grpc-message"].decode()) and not c.server.handler.calls
    sid = c.open()                               # the connection still serves
    c.send(sid, prefixed(b"ok"))
    assert c.answer(sid)[0] == prefixed(b"ok" * 3)


def test_a_message_over_the_limit_is_refused_from_its_prefix():
    c = Client(max_body=1000)
    sid = c.open()
    c.send(sid, prefixed(b"y" * 5000)[:100], end=False)     # only the start is sent
    data, tr, ended = c.answer(sid)
    assert ended and tr[b"grpc-status"] == b"8" and "5000 bytes" in unquote(
        tr[b"grpc-message"].decode())
    assert any(isinstance(e, StreamReset) and e.stream_id == sid and e.error_code == 0
               for e in c.events) and not c.conn.busy


def test_unknown_method_and_not_grpc():
    c = Client()
    sid = c.open(path="/inference.GRPCInferenceService/RepositoryIndex")
    c.send(sid, prefixed(b""))
    assert c.answer(sid)[1][b"grpc-status"] == b"12"
    sid = c.open(ctype=b"application/json")
    c.send(sid, b"{}")
    assert c.answer(sid)[1][b":status"] == b"415" and not c.server.handler.calls


def test_client_reset_mid_call_drops_the_call_only():
    c = Client()
    sid = c.open()
    c.send(sid, prefixed(b"z" * 100)[:50], end=False)
    assert c.conn.busy
    c.h2.reset_stream(sid)
    c.pump()
    assert not c.conn.busy and not c.server.handler.calls
    sid = c.open()
    c.send(sid, prefixed(b"after"))
    assert c.answer(sid)[0] == prefixed(b"after" * 3)


def test_ping_and_settings_are_acknowledged():
    c = Client()
    c.h2.ping(b"12345678")
    c.h2.update_settings({SettingCodes.MAX_FRAME_SIZE: 20000})
    c.pump()
    assert any(isinstance(e, PingAckReceived) and e.ping_data == b"12345678" for e in c.events)
    assert sum(isinstance(e, SettingsAcknowledged) for e in c.events) == 2   # start + update


@pytest.mark.parametrize("raw", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64,
                                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 20000])
def test_garbage_closes_the_connection(raw):
    """Not HTTP/2, a bad preface, or a frame header claiming 16 MB (h2 alone would buffer
    it all before checking): closed at once."""
    t, srv = Transport(), Server()
    conn = GrpcConn(srv)
    conn.connection_made(t)
    conn.data_received(raw)
    assert t.closed and conn.closing
    conn.data_received(b"more")                  # ignored once closing


def test_stop_finishes_the_call_begun_then_goaway():
    c = Client()
    sid = c.open()
    c.send(sid, prefixed(b"half")[:4], end=False)
    c.server.stopping = True                     # HttpServer.stop leaves a busy one open
    assert c.conn.busy and not c.t.closed
    c.send(sid, prefixed(b"half")[4:])
    data, tr, ended = c.answer(sid)
    assert data == prefixed(b"half" * 3) and tr[b"grpc-status"] == b"0"
    assert c.t.closed and any(isinstance(e, ConnectionTerminated) and e.error_code == 0
                              for e in c.events)


def test_idle_connection_closed_by_the_servers_idle_timeout():
    """Over a socket: the HTTP server's sweep closes an idle gRPC connection (GOAWAY, then
    EOF) within the idle timeout, and a connection in use stays open."""
    async def main():
        srv = HttpServer(Echo(), "127.0.0.1", 0, idle_timeout=0.4, conn_class=GrpcConn)
        await srv.start()
        loop = asyncio.get_running_loop()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.setblocking(False)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        t0, got = time.monotonic(), b""
        while time.monotonic() - t0 < 5:
            chunk = await loop.sock_recv(s, 1 << 16)
            if not chunk:
                break
            got += chunk
        s.close()
        await srv.stop()
        return time.monotonic() - t0, got
    took, got = asyncio.run(main())
    assert 0.3 < took < 3 and b"\x07\x00\x00\x00\x00\x00" in got      # a GOAWAY frame, then EOF
