"""A fault-injecting HTTP proxy on 127.0.0.1, put in front of the tests' S3 and HTTP servers (`remote_servers`): the
client is pointed at the proxy (AWS_ENDPOINT_URL, or the proxy's URL for HTTP), which forwards each request to the
server and does to the answer what the store of a bad day does.

Modes (`FaultProxy.set(mode, ...)`):

  refuse    nothing listens on the port any more, and the open connections are cut: connections are refused
            (`heal()` listens again)
  hang      the connection is accepted and the request read, but no answer ever comes
  error     a share of the requests is answered 503 SlowDown
  reset     the answer's headers and half its body, then a TCP reset
  truncate  the answer's headers (the full Content-Length) and half its body, then a clean close
  delay     every answer waits `delay_s` first
  flip      one byte of the body flipped (size, headers and ETag unchanged)
  swap      the body of another object (`other`: a path on the same server), headers unchanged

A spoiled answer loses its `x-amz-checksum-*` headers, as from an S3-compatible store that sends none (with them,
botocore's own check would find a flipped byte before the project's checksum is asked).

Faults apply to the requests whose path contains `path` (default every path), body faults (reset, truncate, flip,
swap) to GETs only; `times`
bounds how many answers a mode spoils (default no bound), `share` how many of them (seeded). `spoiled` counts the
spoiled answers, `requests` every request by (method, path).
"""

from __future__ import annotations

import collections
import http.client
import http.server
import random
import socket
import struct
import threading
import time

MODES = ("none", "refuse", "hang", "error", "reset", "truncate", "delay", "flip", "swap")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class FaultProxy:
    """A reverse proxy on 127.0.0.1 to `upstream` (http://127.0.0.1:PORT); `url` is where clients go instead."""

    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream.split("://", 1)[1].rstrip("/")
        self.requests: collections.Counter = collections.Counter()
        self.spoiled = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._healed = threading.Event()
        self._connections: set[socket.socket] = set()
        self.set("none")
        self._server = self._listen(0)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def set(self, mode: str, path: str = "", share: float = 1.0, times: int | None = None, delay_s: float = 0.0,
            other: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"fault mode {mode!r}: one of {MODES}")
        with self._lock:
            self.mode, self.path, self.share, self.times = mode, path, share, times
            self.delay_s, self.other = delay_s, other
        if mode == "refuse":
            self._stop()
        elif mode != "hang":
            self._healed.set()
        if mode == "hang":
            self._healed.clear()

    def heal(self) -> None:
        """Back to forwarding every request untouched (listening again after `refuse`)."""
        refused = self.mode == "refuse"
        self.set("none")
        if refused:
            self._server = self._listen(self.port)

    def close(self) -> None:
        self._healed.set()
        self._stop()

    def _listen(self, port: int):
        handler = type("Handler", (_Handler,), {"proxy": self})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        server.thread = thread
        return server

    def _stop(self) -> None:
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            server.shutdown()
            server.server_close()
            server.thread.join()
        with self._lock:
            for connection in list(self._connections):  # kept-alive connections would still be served
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _spoils(self, method: str, path: str, body_fault: bool) -> bool:
        """Whether this answer gets the current mode's fault (counted)."""
        with self._lock:
            if self.mode in ("none", "delay") or (self.times is not None and self.times <= 0):
                return False
            if self.path not in path or body_fault and method != "GET":
                return False
            if self._rng.random() >= self.share:
                return False
            if self.times is not None:
                self.times -= 1
            self.spoiled += 1
            return True

    def fetch(self, method: str, path: str, headers: dict, body: bytes | None):
        """(status, reason, headers, body) of the upstream's answer."""
        conn = http.client.HTTPConnection(self.upstream, timeout=300)  # a hang guard for the upstream server
        try:
            conn.request(method, path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            return answer.status, answer.reason, [(k, v) for k, v in answer.getheaders()
                                                  if k.lower() not in _HOP], data
        finally:
            conn.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.proxy._lock:
            self.proxy._connections.add(self.connection)

    def finish(self) -> None:
        with self.proxy._lock:
            self.proxy._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _forward(self) -> None:
        proxy = self.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        with proxy._lock:
            proxy.requests[self.command, self.path] += 1
            mode = proxy.mode
        if mode == "refuse":  # a request that raced the cut on a kept-alive connection
            self.close_connection = True
            return
        if mode == "hang" and proxy._spoils(self.command, self.path, False):
            proxy._healed.wait()  # an answer that never comes (until the test heals the proxy or closes it)
            self.close_connection = True
            return
        if mode == "delay":
            time.sleep(proxy.delay_s)
        if mode == "error" and proxy._spoils(self.command, self.path, False):
            data = b"" if self.command == "HEAD" else b"<Error><Code>SlowDown</Code><Message>Reduce</Message></Error>"
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        status, reason, answer_headers, data = proxy.fetch(self.command, self.path, headers, body)
        spoil = mode in ("reset", "truncate", "flip", "swap") and 200 <= status < 300 and data and \
            proxy._spoils(self.command, self.path, True)
        if spoil and mode == "flip":
            at = len(data) // 2
            data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
        elif spoil and mode == "swap":
            _, _, _, other = proxy.fetch("GET", proxy.other, headers={}, body=None)
            data = other[:len(data)].ljust(len(data), b"\0")
        self.send_response(status, reason)
        for key, value in answer_headers:
            if not (spoil and key.lower().startswith("x-amz-checksum")):
                self.send_header(key, value)
        if not any(k.lower() == "content-length" for k, _ in answer_headers):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if spoil and mode in ("reset", "truncate"):
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            if mode == "reset":  # SO_LINGER 0: the close sends a RST instead of a FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward
