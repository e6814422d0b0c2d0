"""Object stores on 127.0.0.1 for the remote-shard tests: moto's S3 server and a plain HTTP file server, each able to
drop a share of its requests or answer late, as a real network does (`Faults`)."""

from __future__ import annotations

import collections
import http.server
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "imba-test-key", "AWS_SECRET_ACCESS_KEY": "imba-test-secret-never-logged",
               "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Faults:
    """What the server does to requests: `drop` a share of them (S3: 503 SlowDown; HTTP: the connection closed
    without an answer), drop the `first` requests to each path (more than a client's own retries absorb), fail every
    request whose path contains one of `broken`, wait `delay_s` before each answer and `trickle_s` between each 64 kB
    of a GET's body (S3 only: a download that lasts).
    `requests` counts the answered ones by (method, path), `bytes_sent` the bodies of GETs (S3 only)."""

    drop: float = 0.0
    first: int = 0
    broken: tuple[str, ...] = ()
    delay_s: float = 0.0
    trickle_s: float = 0.0
    seed: int = 0
    requests: collections.Counter = field(default_factory=collections.Counter)
    bytes_sent: int = 0
    dropped: int = 0

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._seen: collections.Counter = collections.Counter()

    def fails(self, method: str, path: str) -> bool:
        """Whether this request is to fail (counted in `dropped`); otherwise it is counted in `requests`."""
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self._seen[path] += 1
            failed = (any(b in path for b in self.broken) or self._seen[path] <= self.first
                      or self._rng.random() < self.drop)
            if failed:
                self.dropped += 1
            else:
                self.requests[method, path] += 1
            return failed

    def gets(self, part: str = "") -> int:
        """GET requests answered for paths containing `part`."""
        return sum(n for (method, path), n in self.requests.items() if method == "GET" and part in path)


class S3Server:
    """moto's S3 server on 127.0.0.1 (a free port) behind `faults`; `env` is what a client needs to reach it."""

    def __init__(self, faults: Faults | None = None):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.faults = faults or Faults()
        moto = DomainDispatcherApplication(create_backend_app)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if self.faults.fails(environ["REQUEST_METHOD"], path):
                start_response("503 Slow Down", [("Content-Type", "application/xml")])
                return [] if environ["REQUEST_METHOD"] == "HEAD" else [b"<Error><Code>SlowDown</Code></Error>"]
            body = moto(environ, start_response)
            if environ["REQUEST_METHOD"] == "GET":
                body = b"".join(body)
                self.faults.bytes_sent += len(body)
                if self.faults.trickle_s:
                    return self._trickle(body)
                return [body]
            return body

        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _trickle(self, body: bytes):
        for start in range(0, len(body), 1 << 16):
            yield body[start:start + (1 << 16)]
            time.sleep(self.faults.trickle_s)

    def upload(self, bucket: str, prefix: str, paths: list[str]) -> list[str]:
        """`paths` put under s3://bucket/prefix/ (the bucket made if needed); their s3:// URLs."""
        return self.upload_to(self.endpoint, bucket, prefix, paths)

    @staticmethod
    def upload_to(endpoint: str, bucket: str, prefix: str, paths: list[str]) -> list[str]:
        """`upload` to the server at `endpoint` (one in another process)."""
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=bucket)
        urls = []
        for path in paths:
            key = f"{prefix}/{os.path.basename(path)}"
            with open(path, "rb") as f:
                client.put_object(Bucket=bucket, Key=key, Body=f.read())
            urls.append(f"s3://{bucket}/{key}")
        return urls

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join()


class _Handler(http.server.SimpleHTTPRequestHandler):
    faults: Faults

    def log_message(self, *args) -> None:
        pass

    def _answer(self, send) -> None:
        if self.faults.fails(self.command, self.path):
            self.close_connection = True  # dropped: the connection closes with no answer
            return
        send()

    def do_GET(self) -> None:
        self._answer(super().do_GET)

    def do_HEAD(self) -> None:
        self._answer(super().do_HEAD)


class HTTPServer:
    """`folder` served over plain HTTP on 127.0.0.1 (Python's file server: Content-Length and Last-Modified, no
    ETag, no ranges) behind `faults`."""

    def __init__(self, folder: str, faults: Faults | None = None):
        self.faults = faults or Faults()
        handler = type("Handler", (_Handler,), {"faults": self.faults})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=folder))
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join()
