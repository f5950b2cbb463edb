"""A fault-injecting HTTP proxy between pt2flow's S3 client and the moto server.

A real threading HTTP server on 127.0.0.1. Requests whose method and path match a plan take
the plan's next action, in order; everything else (and a plan's requests once it is used up)
is forwarded to moto unchanged. Actions:

  500         500 InternalError (S3 XML error body)
  503         503 ServiceUnavailable
  slowdown    503 SlowDown (S3's throttling answer)
  429         429 TooManyRequests (throttling)
  drop        close the connection without answering (the request never reaches moto)
  drop_after  forward to moto, then close the connection without answering (the request DID
              take effect: a retry must be idempotent)
  pass        forward normally
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterator
from urllib.parse import urlsplit

ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "429": (429, "TooManyRequests", "Too many requests, please slow down."),
}
ACTIONS = (*ERRORS, "drop", "drop_after", "pass")
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "content-length",
}


@dataclass
class Plan:
    method: str
    path_contains: str
    actions: list[str]
    seen: list[tuple[float, str]] = field(default_factory=list)  # (time, action taken) per matching request

    @property
    def attempts(self) -> int:
        return len(self.seen)

    @property
    def injected(self) -> int:
        return sum(1 for _, action in self.seen if action != "pass")


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.plans: list[Plan] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self._body()
                action = proxy._take(self.command, self.path)
                if action in ERRORS:
                    status, code, message = ERRORS[action]
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                        f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
                    ).encode()
                    self.send_response_only(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if action == "drop":
                    self._drop()
                    return
                status, headers, data = self._forward(body)
                if action == "drop_after":
                    self._drop()
                    return
                self.send_response_only(status)
                for key, value in headers:
                    if key.lower() not in _HOP:
                        self.send_header(key, value)
                length = dict((k.lower(), v) for k, v in headers).get("content-length")
                self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for key, value in self.headers.items():
                        if key.lower() not in _HOP:
                            conn.putheader(key, value)
                    if body or self.command in ("PUT", "POST"):
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body or None)
                    response = conn.getresponse()
                    data = response.read()
                    return response.status, list(response.getheaders()), data
                finally:
                    conn.close()

            def _drop(self) -> None:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def plan(self, method: str, path_contains: str, actions: list[str]) -> Plan:
        unknown = set(actions) - set(ACTIONS)
        assert not unknown, f"unknown fault actions {unknown}"
        plan = Plan(method, path_contains, list(actions))
        with self.lock:
            self.plans.append(plan)
        return plan

    def clear(self) -> None:
        with self.lock:
            self.plans.clear()

    def _take(self, method: str, path: str) -> str:
        with self.lock:
            for plan in self.plans:
                if plan.method == method and plan.path_contains in path:
                    action = plan.actions[plan.attempts] if plan.attempts < len(plan.actions) else "pass"
                    plan.seen.append((time.time(), action))  # wall clock: comparable with log records' `created`
                    return action
        return "pass"


def run_proxy(upstream: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
