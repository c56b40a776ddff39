"""The gRPC port's HTTP/2 transport (``mpips.serving.grpc_wire.GrpcConn``), in process: an
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

from mpips.serving.grpc_wire import GrpcConn  # noqa: E402
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
        self.max_head = 16 << 10

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
        while time.monotonic() - t0 < 5:           # (each read bounded too: never a hang)
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(s, 1 << 16),
                                               max(0.01, 5 - (time.monotonic() - t0)))
            except asyncio.TimeoutError:
                break
            if not chunk:
                break
            got += chunk
        s.close()
        await srv.stop()
        return time.monotonic() - t0, got
    took, got = asyncio.run(main())
    assert 0.3 < took < 3 and b"\x07\x00\x00\x00\x00\x00" in got      # a GOAWAY frame, then EOF


# ---------------------------------------------------------------- the framing, by hand
# (frames written here byte by byte, the header blocks by hpack's encoder: the cases a
# client library does not send on its own)
from hpack import Encoder  # noqa: E402

from mpips.serving import grpc_wire as gw  # noqa: E402

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
           (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]


def frames(raw):
    """[(type, flags, stream, payload)] of the bytes a GrpcConn wrote (after its first
    SETTINGS and WINDOW_UPDATE); raises if they are not whole frames."""
    out, pos = [], 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 3], "big")
        assert pos + 9 + n <= len(raw), "a frame cut short"
        out.append((raw[pos + 3], raw[pos + 4], int.from_bytes(raw[pos + 5:pos + 9], "big"),
                    bytes(raw[pos + 9:pos + 9 + n])))
        pos += 9 + n
    return out


class Raw:
    """A GrpcConn fed hand-written frames; ``hpack`` encodes the client's header blocks."""

    def __init__(self, max_body=1 << 20):
        self.t, self.server = Transport(), Server(max_body)
        self.conn = GrpcConn(self.server)
        self.conn.connection_made(self.t)
        self.enc = Encoder()
        self.send(gw.PREFACE + gw.frame(gw.SETTINGS, 0, 0))
        self.t.out.clear()

    def send(self, raw):
        self.conn.data_received(raw)
        got = frames(bytes(self.t.out))
        self.t.out.clear()
        return got

    def block(self, headers=REQUEST):
        return self.enc.encode(headers)

    def goaway(self, got):
        """The error code of the GOAWAY among ``got`` (None: none), checking the close."""
        codes = [int.from_bytes(p[4:8], "big") for k, _, _, p in got if k == gw.GOAWAY]
        if codes:
            assert self.t.closed and self.conn.closing
        return codes[0] if codes else None


def decoded(got, dec):
    """{stream: [headers of each HEADERS frame]} and {stream: DATA bytes} of ``got``."""
    heads, data = {}, {}
    for k, f, s, p in got:
        if k == gw.HEADERS:
            heads.setdefault(s, []).append(dict(dec.decode(p, raw=True)))
        elif k == gw.DATA:
            data[s] = data.get(s, b"") + p
    return heads, data


def test_header_block_in_continuation_frames_padding_and_priority():
    from hpack import Decoder
    c, dec = Raw(), Decoder()
    block = c.block()
    # HEADERS padded (3 bytes of padding) and with a priority, then two CONTINUATIONs
    head = bytes((3,)) + b"\x00\x00\x00\x00\x10" + block[:5] + b"\x00" * 3
    got = c.send(gw.frame(gw.HEADERS, gw.PADDED | gw.PRIORITY_FLAG, 1, head)
                 + gw.frame(gw.CONTINUATION, 0, 1, block[5:9])
                 + gw.frame(gw.CONTINUATION, gw.END_HEADERS, 1, block[9:]))
    assert got == [] and c.conn.busy
    body = prefixed(b"split")          # the DATA padded too (2 bytes)
    got = c.send(gw.frame(gw.DATA, gw.PADDED | gw.END_STREAM, 1, b"\x02" + body + b"\x00\x00"))
    heads, data = decoded(got, dec)
    assert data[1] == prefixed(b"split" * 3) and heads[1][-1][b"grpc-status"] == b"0"
    assert c.server.handler.calls == [b"split"]


@pytest.mark.parametrize("case, code", [
    ("data between headers and continuation", gw.PROTOCOL_ERROR),
    ("continuation alone", gw.PROTOCOL_ERROR),
    ("headers on stream 0", gw.PROTOCOL_ERROR),
    ("headers on an even stream", gw.PROTOCOL_ERROR),
    ("data on an idle stream", gw.PROTOCOL_ERROR),
    ("padding past the frame", gw.PROTOCOL_ERROR),
    ("push promise", gw.PROTOCOL_ERROR),
    ("settings on a stream", gw.PROTOCOL_ERROR),
    ("settings of 5 bytes", gw.FRAME_SIZE_ERROR),
    ("ping of 7 bytes", gw.FRAME_SIZE_ERROR),
    ("window update of 0", gw.PROTOCOL_ERROR),
    ("window past 2^31-1", gw.FLOW_CONTROL_ERROR),
    ("initial window past 2^31-1", gw.FLOW_CONTROL_ERROR),
    ("max frame size too small", gw.PROTOCOL_ERROR),
    ("bad hpack", gw.COMPRESSION_ERROR),
    ("header list over max_head", gw.COMPRESSION_ERROR),
    ("frame over 16 KiB", gw.FRAME_SIZE_ERROR),
])
def test_protocol_errors_close_with_goaway_naming_the_error(case, code):
    c = Raw()
    b = c.block()
    f = gw.frame
    raw = {
        "data between headers and continuation": f(gw.HEADERS, 0, 1, b[:4]) + f(gw.DATA, 0, 1, b"x"),
        "continuation alone": f(gw.CONTINUATION, gw.END_HEADERS, 1, b),
        "headers on stream 0": f(gw.HEADERS, gw.END_HEADERS, 0, b),
        "headers on an even stream": f(gw.HEADERS, gw.END_HEADERS, 2, b),
        "data on an idle stream": f(gw.DATA, 0, 7, b"x"),
        "padding past the frame": f(gw.HEADERS, gw.END_HEADERS | gw.PADDED, 1, b"\x09abc"),
        "push promise": f(gw.PUSH_PROMISE, gw.END_HEADERS, 1, b"\x00\x00\x00\x02" + b),
        "settings on a stream": f(gw.SETTINGS, 0, 1),
        "settings of 5 bytes": f(gw.SETTINGS, 0, 0, b"\x00\x04\x00\x00\x00"),
        "ping of 7 bytes": f(gw.PING, 0, 0, b"1234567"),
        "window update of 0": f(gw.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"),
        "window past 2^31-1": f(gw.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"),
        "initial window past 2^31-1": f(gw.SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"),
        "max frame size too small": f(gw.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x10\x00"),
        "bad hpack": f(gw.HEADERS, gw.END_HEADERS, 1, b"\xff\xff\xff\xff\xff\x7f"),
        "header list over max_head": f(gw.HEADERS, gw.END_HEADERS, 1, Encoder().encode(
            REQUEST + [(b"x-big", b"v" * 9000)] * 2)),
        "frame over 16 KiB": (16385).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01",
    }[case]
    got = c.send(raw)
    assert c.goaway(got) == code, (case, got[-1:])
    assert not c.server.handler.calls


def test_too_many_streams_are_refused_and_the_rest_served():
    from hpack import Decoder
    c, dec = Raw(), Decoder()
    got = c.send(b"".join(gw.frame(gw.HEADERS, gw.END_HEADERS, 2 * k + 1, c.block())
                          for k in range(gw.STREAMS + 2)))
    refused = [s for k, _, s, p in got if k == gw.RST_STREAM and p == b"\x00\x00\x00\x07"]
    assert refused == [2 * gw.STREAMS + 1, 2 * gw.STREAMS + 3] and c.goaway(got) is None
    got = c.send(gw.frame(gw.DATA, gw.END_STREAM, 1, prefixed(b"first")))
    heads, data = decoded(got, dec)
    assert data[1] == prefixed(b"first" * 3) and len(c.conn.calls) == gw.STREAMS - 1


def test_initial_window_change_moves_the_answers_waiting():
    """SETTINGS_INITIAL_WINDOW_SIZE lowered to 0 holds the answer's DATA (headers go);
    raised again, the held answer is sent (RFC 9113 6.9.2: the windows move by the change)."""
    from hpack import Decoder
    c, dec = Raw(), Decoder()
    c.send(gw.frame(gw.SETTINGS, 0, 0, b"\x00\x04\x00\x00\x00\x00"))
    got = c.send(gw.frame(gw.HEADERS, gw.END_HEADERS, 1, c.block())
                 + gw.frame(gw.DATA, gw.END_STREAM, 1, prefixed(b"held")))
    heads, data = decoded(got, dec)
    assert 1 not in data and heads[1][0][b":status"] == b"200" and c.conn.busy
    got = c.send(gw.frame(gw.SETTINGS, 0, 0, b"\x00\x04\x00\x01\x00\x00"))
    heads, data = decoded(got, dec)
    assert data[1] == prefixed(b"held" * 3) and heads[1][-1][b"grpc-status"] == b"0"
    assert (gw.SETTINGS, gw.ACK, 0, b"") in got and not c.conn.busy


def test_mutated_connections_never_break_the_server():
    """2,000 recorded connections (preface, SETTINGS, a PING, calls on three streams, a
    WINDOW_UPDATE, a RST_STREAM), each mutated (bytes flipped, cut, repeated or dropped)
    and fed in random pieces: data_received never raises, what the server writes is whole
    frames, a connection it gives up on ends in one GOAWAY (its last frame) naming one of
    the errors it knows, one it keeps has none, and after them all a call on a fresh
    connection is answered."""
    import random
    rng = random.Random(7)
    enc = Encoder()
    good = gw.PREFACE + gw.frame(gw.SETTINGS, 0, 0, b"\x00\x04\x00\x10\x00\x00")
    good += gw.frame(gw.PING, 0, 0, b"abcdefgh")
    for s in (1, 3, 5):
        good += gw.frame(gw.HEADERS, gw.END_HEADERS, s, enc.encode(REQUEST))
        good += gw.frame(gw.DATA, gw.END_STREAM, s, prefixed(b"m%d" % s * 20))
    good += gw.frame(gw.WINDOW_UPDATE, 0, 0, b"\x00\x01\x00\x00")
    good += gw.frame(gw.RST_STREAM, 0, 3, b"\x00\x00\x00\x08")
    closed = 0
    for _ in range(2000):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            k, pos = rng.randrange(4), rng.randrange(len(raw))
            if k == 0:
                raw[pos] = rng.randrange(256)
            elif k == 1:
                del raw[pos:pos + rng.randint(1, 12)]
            elif k == 2:
                raw[pos:pos] = raw[pos:pos + rng.randint(1, 30)]
            else:
                raw = raw[:pos]
        t, srv = Transport(), Server()
        conn = GrpcConn(srv)
        conn.connection_made(t)
        pos = 0
        while pos < len(raw) and not t.closed:
            step = rng.randint(1, 64)
            conn.data_received(bytes(raw[pos:pos + step]))
            pos += step
        got = frames(bytes(t.out))
        codes = [int.from_bytes(p[4:8], "big") for k, _, _, p in got if k == gw.GOAWAY]
        assert (len(codes) == 1 and got[-1][0] == gw.GOAWAY) == t.closed, got[-3:]
        assert set(codes) <= {gw.NO_ERROR, gw.PROTOCOL_ERROR, gw.FLOW_CONTROL_ERROR,
                              gw.FRAME_SIZE_ERROR, gw.COMPRESSION_ERROR}, codes
        closed += t.closed
    assert 100 < closed < 2000                          # mutations both broke and did not
    c = Client()
    sid = c.open()
    c.send(sid, prefixed(b"after"))
    assert c.answer(sid)[0] == prefixed(b"after" * 3)
