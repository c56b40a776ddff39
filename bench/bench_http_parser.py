"""The HTTP parser alone: CPU time per request of mpips' HTTP layer with llhttp
(httptools, the default) and with the hand-written parser, no socket, no model.

    python bench/bench_http_parser.py [--requests 20000] [--rounds 5]

Each round feeds the same requests, in chunks as a socket would hand them over, to one
connection object of each parser (``mpips.serving.http``) with a transport that keeps
nothing, the handler answering a constant; the two parsers alternate, and the CPU time
(``time.process_time``) per request is the median over the rounds.  Requests: a batch-1
``:lines`` POST as the load bench sends it, and the same with a tritonclient-sized head
(eight more headers).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpips.serving.http import PARSERS, HttpServer, Response  # noqa: E402

LINE = b"0\t1\t5\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64\t80e26c9b\tfb936136\t7b4723c4" + \
    b"\t25c83c98\t7e0ccccf\tde7995b8\t1f89b562\ta73ee510\ta8cd5504\tb2cb9c98\t37c9c164\t2824a5f6" + \
    b"\t1adce6ef\t8ba8b39a\t891b62e7\te5ba7672\tf54016b9\t21ddcdc9\tb1252a9d\t07b5194c\t\t3a171ecb" + \
    b"\tc5c50484\te8b83407\t9727dd16\n"
EXTRA = b"".join(b"X-Header-%d: value-%d\r\n" % (k, k) for k in range(8))


class _Null:
    """A transport that takes the answers and keeps nothing."""

    def write(self, data):
        pass

    def close(self):
        pass

    def get_extra_info(self, name):
        return None


def request(extra=b""):
    return (b"POST /v1/models/ctr:lines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"text/plain\r\n%sContent-Length: %d\r\n\r\n" % (extra, len(LINE))) + LINE


def run(parser, data, n, chunk):
    srv = HttpServer(lambda req: Response(200, b"0.5\n", "text/plain"), parser=parser)
    conn = PARSERS[parser](srv)
    conn.connection_made(_Null())
    t0 = time.process_time()
    for lo in range(0, len(data), chunk):
        conn.data_received(data[lo:lo + chunk])
    return (time.process_time() - t0) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    for what, req in (("batch-1 :lines", request()), ("with 8 more headers", request(EXTRA))):
        data = req * a.requests
        chunk = len(req)                           # one request per read, as in a closed loop
        times = {p: [] for p in PARSERS}
        for _ in range(a.rounds):
            for p in PARSERS:
                times[p].append(run(p, data, a.requests, chunk))
        med = {p: statistics.median(t) * 1e6 for p, t in times.items()}
        print(f"{what} ({len(req)} bytes): " + ", ".join(
            f"{p} {med[p]:.2f} us/request" for p in PARSERS)
            + f"; llhttp / builtin {med['llhttp'] / med['builtin']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
