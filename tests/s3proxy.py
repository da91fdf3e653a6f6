"""A fault-injecting HTTP proxy between s3fs and the S3 server, on 127.0.0.1.

Every request is forwarded to the upstream server unless the proxy decides (seeded
random, per request) to

* answer ``503 SlowDown`` (throttling) with probability ``fail``,
* drop the connection without an answer with probability ``drop``,
* answer only after ``delay_s`` with probability ``slow``,
* send a GET's answer with its full ``Content-Length`` but only half its body, then
  close the connection, with probability ``cut``;
* forward the request, then drop the connection without passing the answer on (the
  request took effect, its answer was lost) with probability ``lose``.

Requests are forwarded exactly as signed: the proxy never edits a header the client
signed (SigV4 covers them; a server that checks signatures would refuse the request).
A server that ignores ``Range`` is played from the proxy's side (``ignore_range``): a
ranged GET of an object whose whole answer passed through earlier is answered with that
whole answer, as such a server would.

``counts`` tells what it did, ``ranged`` how many requests asked for a byte range.
Bounded: it serves only while the test runs and listens on 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate"}


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        split = urlsplit(upstream)
        self.upstream = (split.hostname, split.port)
        self.fail = self.drop = self.slow = self.cut = self.lose = 0.0
        self.ignore_range = False  # answer ranged GETs with the whole object, as some servers do
        self._whole: dict[str, tuple[list[tuple[str, str]], bytes]] = {}  # path -> a 200 GET's answer
        self.delay_s = 0.2
        self.counts: Counter[str] = Counter()
        self.ranged = 0
        self._rng = random.Random(seed)
        self._script: list[str] = []  # actions for the next requests, before the rates
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                if self.headers.get("Range"):
                    with proxy._lock:
                        proxy.ranged += 1
                action = proxy._decide()
                if action == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if action == "fail":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if action == "slow":
                    time.sleep(proxy.delay_s)
                cut = action == "cut" and self.command == "GET"
                whole = (proxy._whole.get(self.path) if proxy.ignore_range
                         and self.command == "GET" and self.headers.get("Range") else None)
                if whole is not None:
                    status, reason, answer_headers, data = 200, "OK", *whole
                else:
                    status, reason, answer_headers, data = self._forward(body)
                    if action == "lose":
                        self.close_connection = True
                        self.connection.close()
                        return
                    if status == 200 and self.command == "GET" and not self.headers.get("Range"):
                        proxy._whole[self.path] = (answer_headers, data)
                self.send_response(status, reason)
                head = self.command == "HEAD"  # keeps the upstream Content-Length (object size)
                for k, v in answer_headers:
                    if k.lower() not in HOP_BY_HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if cut:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.close()
                elif self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                """The request, headers as signed, to the server; its answer."""
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    return resp.status, resp.reason, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _decide(self) -> str:
        with self._lock:
            r = self._rng.random()
            if self._script:
                action = self._script.pop(0)
            else:  # each action takes its rate's share of [0, 1); the rest is forwarded
                action, upto = "forward", 0.0
                for name in ("fail", "drop", "slow", "cut", "lose"):
                    upto += getattr(self, name)
                    if r < upto:
                        action = name
                        break
            self.counts[action] += 1
            return action

    def set(self, *, fail: float = 0.0, drop: float = 0.0, slow: float = 0.0,
            cut: float = 0.0, lose: float = 0.0) -> None:
        with self._lock:
            self.fail, self.drop, self.slow, self.cut, self.lose = fail, drop, slow, cut, lose
            self.counts.clear()
            self.ranged = 0

    def script(self, *actions: str) -> None:
        """Take ``actions`` ("lose", "drop", "fail", ...) for the next requests, in order."""
        with self._lock:
            self._script += actions

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
