"""A lean HTTP/1.1 server on asyncio: keep-alive, pipelining, limits, graceful stop.

Chosen over uvicorn (+httptools) and aiohttp by measurement (bench/bench_serve.py and
docs/serving.md): scoring one instance takes tens of microseconds, so the framework's own
cost per request is what sets the latency and the peak rate, and a protocol object that
calls the handler inline does about 3x fewer CPU cycles per request than either.  The
request is parsed by llhttp (``httptools``, Node's parser, maintained against request
smuggling: ``_LlConn``, the default) or, with ``parser="builtin"``, by the hand-written
parser this server began with (``_Conn``); docs/serving.md has the cost of each.  It
speaks what the inference protocols need and no more:

* requests with a ``Content-Length`` body (or none); ``Transfer-Encoding`` is refused
  (411), ``Expect: 100-continue`` is answered;
* keep-alive (HTTP/1.1 default, HTTP/1.0 with ``Connection: keep-alive``), pipelined
  requests answered in order;
* limits: a head over ``max_head`` bytes is 431, a body over ``max_body`` 413, a malformed
  head 400 (each closes the connection); a connection idle or stalled for ``idle_timeout``
  seconds is closed, so a slow client cannot hold the server.

``handler(Request) -> Response`` runs in the event loop's thread, synchronously: a request
is whole when it is handled, and a reference it reads once (the model) stays the one
that answers it.  ``stop()`` closes the listening socket, lets every connection finish
the request it has begun, answers it with ``Connection: close`` and then closes.
"""
import asyncio
import collections
import json
import socket
import time

try:
    import httptools
except ImportError:            # the builtin parser only (--http-parser builtin)
    httptools = None

REASONS = {200: "OK", 100: "Continue", 400: "Bad Request", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required",
           413: "Payload Too Large", 415: "Unsupported Media Type",
           422: "Unprocessable Entity", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


class Request:
    __slots__ = ("method", "path", "query", "headers", "body")

    def __init__(self, method, path, query, headers, body):
        self.method, self.path, self.query, self.headers, self.body = \
            method, path, query, headers, body


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status, body=b"", content_type="application/json", headers=()):
        self.status, self.body, self.content_type, self.headers = \
            status, body, content_type, headers


def error_response(status, message, headers=()):
    return Response(status, json.dumps({"error": message}).encode(), headers=headers)


def encode(resp, close):
    head = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Status')}",
            f"Content-Type: {resp.content_type}", f"Content-Length: {len(resp.body)}"]
    head += [f"{k}: {v}" for k, v in resp.headers]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body


class ServerConn(asyncio.Protocol):
    """What ``HttpServer`` needs of a connection, whatever its protocol: registered in
    ``server.conns`` while open (the idle sweep and the graceful stop read ``busy``,
    ``last`` and call ``_fail``/``_close``), TCP_NODELAY, the stop woken when it ends."""

    def __init__(self, server):
        self.server, self.buf, self.transport = server, bytearray(), None
        self.closing = False
        self.last = time.monotonic()

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.server.conns.add(self)

    def connection_lost(self, exc):
        self.server.conns.discard(self)
        self.closing = True
        self.server.wake()


class _Conn(ServerConn):
    def __init__(self, server):
        super().__init__(server)
        self.head = None          # (method, target, headers, length, keep) of a request begun

    @property
    def busy(self):
        return bool(self.buf) or self.head is not None

    def data_received(self, data):
        if self.closing:
            return
        self.last = time.monotonic()
        self.buf += data
        srv = self.server
        while not self.closing:
            if self.head is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > srv.max_head:
                        self._fail(431, f"request head over {srv.max_head} bytes")
                    return
                if end > srv.max_head:
                    return self._fail(431, f"request head over {srv.max_head} bytes")
                head = bytes(self.buf[:end])
                del self.buf[:end + 4]
                if not self._parse_head(head):
                    return
            method, target, headers, length, keep = self.head
            if len(self.buf) < length:
                if headers.get("expect", "").lower() == "100-continue" and not self.buf:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers.pop("expect")
                return
            body = bytes(self.buf[:length])
            del self.buf[:length]
            self.head = None
            path, _, query = target.partition("?")
            resp = srv.call(Request(method, path, query, headers, body))
            keep = keep and not srv.stopping
            self.transport.write(encode(resp, not keep))
            if not keep:
                self._close()
                return
            if not self.buf:
                return

    def _parse_head(self, head):
        srv = self.server
        try:
            text = head.decode("latin-1")
            line, *rest = text.split("\r\n")
            method, target, version = line.split(" ")
            if not version.startswith("HTTP/1.") or not target.startswith("/"):
                raise ValueError(line)
            headers = {}
            for h in rest:
                k, sep, v = h.partition(":")
                if not sep or not k or k != k.strip():
                    raise ValueError(h)
                headers[k.lower()] = v.strip()
        except ValueError:
            self._fail(400, "malformed request head (HTTP/1.1 request line and headers)")
            return False
        if "transfer-encoding" in headers:
            self._fail(411, "chunked bodies are not supported: send Content-Length")
            return False
        raw = headers.get("content-length", "0")
        if not raw.isdigit() or len(raw) > 15:
            self._fail(400, f"bad Content-Length {raw[:20]!r}")
            return False
        length = int(raw)
        if length > srv.max_body:
            self._fail(413, f"body of {length} bytes is over the limit of {srv.max_body} "
                            "(--max-body-bytes)")
            return False
        conn = headers.get("connection", "").lower()
        keep = ("close" not in conn) if version == "HTTP/1.1" else ("keep-alive" in conn)
        self.head = (method, target, headers, length, keep)
        return True

    def _fail(self, status, message):
        self.server.count_refused(status)
        self.transport.write(encode(error_response(status, message), True))
        self._close()

    def _close(self):
        self.closing = True
        self.head = None
        self.buf.clear()
        self.transport.close()

    def stop_if_idle(self, now):
        if self.closing:
            return
        if not self.busy or now - self.last > self.server.idle_timeout:
            self._close()


class _Stop(Exception):
    """Raised in a parser callback to stop parsing (the reason is in ``_LlConn.fail``)."""


class _LlConn(_Conn):
    """The same connection, its requests parsed by llhttp (``httptools``: Node's parser,
    what uvicorn uses), the default.  llhttp frames the messages (request line, headers,
    ``Content-Length``: strict, so an ambiguous request is refused rather than read two
    ways); this class keeps the limits and answers of ``_Conn``."""

    def __init__(self, server):
        super().__init__(server)
        self.parser = httptools.HttpRequestParser(self)
        self.msg = None            # [url, headers, body] of the request being read
        self.in_head, self.head_raw, self.head_size = False, 0, 0
        self.done = collections.deque()       # (Request, keep) complete, not yet answered
        self.fail = None                      # (status, message) that ends the connection

    @property
    def busy(self):
        return self.msg is not None or bool(self.done)

    # ------------------------------------------------------------ llhttp callbacks
    def on_message_begin(self):
        self.msg = [b"", {}, bytearray()]
        self.in_head, self.head_raw, self.head_size = True, 0, 0

    def _grow(self, n):
        self.head_size += n
        if self.head_size > self.server.max_head:
            self.fail = (431, f"request head over {self.server.max_head} bytes")
            raise _Stop

    def on_url(self, url):
        self._grow(len(url))
        self.msg[0] += url

    def on_header(self, name, value):
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.server.max_head:
            self._grow(0)
        self.msg[1][name.lower().decode("latin-1")] = value.decode("latin-1")

    def on_headers_complete(self):
        self.in_head = False
        srv, headers = self.server, self.msg[1]
        if self.parser.get_http_version() not in ("1.0", "1.1") or not self.msg[0].startswith(b"/"):
            self.fail = (400, "malformed request head (HTTP/1.1 request line and headers)")
        elif "transfer-encoding" in headers:
            self.fail = (411, "chunked bodies are not supported: send Content-Length")
        elif int(headers.get("content-length", "0") or 0) > srv.max_body:
            self.fail = (413, f"body of {headers['content-length']} bytes is over the limit "
                              f"of {srv.max_body} (--max-body-bytes)")
        if self.fail is not None:
            raise _Stop
        if headers.get("expect", "").lower() == "100-continue" and \
                headers.get("content-length", "0") not in ("0", ""):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body):
        self.msg[2] += body

    def on_message_complete(self):
        url, headers, body = self.msg
        self.msg = None
        path, _, query = url.decode("latin-1").partition("?")
        method = self.parser.get_method().decode("latin-1")
        self.done.append((Request(method, path, query, headers, bytes(body)),
                          self.parser.should_keep_alive()))

    # ------------------------------------------------------------ bytes in, answers out
    def data_received(self, data):
        if self.closing:
            return
        self.last = time.monotonic()
        srv = self.server
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail = self.fail or (400, "protocol upgrades are not supported")
        except httptools.HttpParserError:
            self.fail = self.fail or (400, "malformed request (HTTP/1.1 request line, "
                                           "headers, Content-Length)")
        if self.in_head and self.fail is None:   # a head still not whole after these bytes:
            self.head_raw += len(data)           # they are all head (bar a request before)
            if self.head_raw > srv.max_head:
                self.fail = (431, f"request head over {srv.max_head} bytes")
        while self.done and not self.closing:
            req, keep = self.done.popleft()
            resp = srv.call(req)
            keep = keep and not srv.stopping
            self.transport.write(encode(resp, not keep))
            if not keep:
                self._close()
        if self.fail is not None and not self.closing:
            self._fail(*self.fail)

    def _close(self):
        self.done.clear()
        self.msg = None
        super()._close()


class HttpServer:
    """``await start()``, then ``await stop()``; ``port`` is the bound port.  ``sock``: a
    listening socket to accept from instead of binding ``host:port`` (inherited from the
    process that forked this one; closing it here leaves the others' copies open);
    ``reuse_port``: bind ``host:port`` with SO_REUSEPORT (other processes listen on it too).
    ``conn_class``: the protocol of a connection (default: HTTP/1.1 by ``parser``; the gRPC
    port gives ``mpips.serving.grpc_wire.GrpcConn``, whose ``handler`` is the servicer)."""

    def __init__(self, handler, host="127.0.0.1", port=8500, *, max_body=16 << 20,
                 max_head=16 << 10, idle_timeout=30.0, on_refused=None, sock=None,
                 parser="llhttp", conn_class=None, reuse_port=False):
        if parser not in PARSERS:
            raise ValueError(f"parser must be one of {', '.join(PARSERS)}; got {parser!r}")
        if PARSERS[parser] is None:
            raise ValueError("the llhttp parser needs httptools: pip install httptools")
        self.conn_class = conn_class or PARSERS[parser]
        self.reuse_port = reuse_port
        self.handler, self.host, self.port, self.sock = handler, host, port, sock
        self.max_body, self.max_head, self.idle_timeout = max_body, max_head, idle_timeout
        self.on_refused = on_refused
        self.conns, self.stopping, self._srv, self._event = set(), False, None, None

    def call(self, req):
        try:
            return self.handler(req)
        except Exception as e:  # noqa: BLE001 - a bug answers 500, the server keeps serving
            return error_response(500, f"internal error: {type(e).__name__}: {e}")

    def count_refused(self, status):
        if self.on_refused is not None:
            self.on_refused(status)

    def wake(self):
        if self._event is not None:
            self._event.set()

    async def start(self):
        loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        if self.sock is not None:               # a listening socket shared with other processes
            self._srv = await loop.create_server(lambda: self.conn_class(self), sock=self.sock,
                                                 backlog=1024)
        else:
            self._srv = await loop.create_server(lambda: self.conn_class(self), self.host, self.port,
                                                 backlog=1024, reuse_port=self.reuse_port or None)
        self.port = self._srv.sockets[0].getsockname()[1]
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self):
        """Close connections idle or stalled longer than idle_timeout."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout / 2))
            now = time.monotonic()
            for c in list(self.conns):
                if c.busy and now - c.last > self.idle_timeout:
                    c._fail(408, f"request not complete within {self.idle_timeout:g} s")
                elif not c.busy and now - c.last > self.idle_timeout:
                    c._close()

    async def stop(self, grace=10.0):
        """Stop accepting; finish the requests begun (up to ``grace`` seconds); close."""
        self.stopping = True
        self._srv.close()
        deadline = time.monotonic() + grace
        while True:
            now = time.monotonic()
            for c in list(self.conns):
                if not c.busy or now > deadline:
                    c._close()
            if not self.conns or now > deadline:
                break
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        self._sweeper.cancel()
        await self._srv.wait_closed()


PARSERS = {"llhttp": _LlConn if httptools is not None else None, "builtin": _Conn}
