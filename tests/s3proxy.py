"""A fault-injecting HTTP proxy between s3fs/botocore and the moto server (issue 24): object stores
answer 503 SlowDown, 500s, reset connections mid-body, stall, and lose responses; moto does none of it.

Point a store at it with ``storage_options=proxy.options(opts)`` (the same credentials, the proxy's
endpoint). Each request goes to the first rule that matches and fires; with none it is forwarded as is.

Rules (``Rule(action, ...)``):

    slowdown        503 SlowDown; not forwarded
    internal        500 InternalError; not forwarded
    reset_request   the connection reset after ``after_bytes`` of the request body; not forwarded
    reset_response  forwarded (moto applies it), then the status, headers and ``after_bytes`` of the
                    body, then a reset
    stall           held ``stall_s`` (make it longer than the client's read timeout), then closed;
                    not forwarded
    short_body      forwarded, then the response with its body cut to ``after_bytes`` and Content-Length
                    rewritten to match (the client sees a whole, short response)
    lost            forwarded (moto applies it), then a reset: the client sees no response at all
    corrupt         forwarded with one bit of its body flipped (at payload byte ``after_bytes``, default
                    the middle; inside aws-chunked framing, the payload's byte, never the framing):
                    moto checks neither Content-MD5 nor x-amz-checksum-*, stores the damaged body and
                    answers its MD5 as the ETag, as a store behind a faulty middlebox would;
                    PUTs only (an object's or a part's body: what a server stores; a damaged XML
                    request, a complete or a bulk delete, is refused as malformed, not stored)

Matching: ``method`` (None: any), ``op`` (the S3 operation told from method and query, :func:`s3_op`:
``put``, ``get``, ``head``, ``delete``, ``list``, or by query ``_QUERY_OPS``: ``create_multipart``,
``upload_part``, ``complete_multipart``, ``abort_multipart``, ``list_uploads``...; None: any), ``key``
(an fnmatch pattern on the object key, bucket dropped, so ``"*/LATEST"``),
``part`` (the ``partNumber``; None: any), ``attempts`` (which requests of that operation, key and part
fire, counted by the proxy from 1, retries included, whichever rule answered them; None: every one),
``times`` (at most this many fires), ``probability`` drawn from the rule's own
``random.Random(seed)``. A rule counts ``seen`` (matched) and ``fired``; ``log`` lists every request
with its operation, part, the action taken and moto's status.

Every wait is bounded: idle client connections time out, moto is called with a timeout, a stall waits
on the proxy's stop event, and ``stop`` shuts every connection and joins its threads with a deadline.
"""

from __future__ import annotations

import fnmatch
import http.client
import random
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

ACTIONS = frozenset("slowdown internal reset_request reset_response stall short_body lost corrupt".split())

_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                  "upgrade", "expect", "content-length"})
_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "internal": (500, "InternalError", "We encountered an internal error. Please try again.")}
_UPSTREAM_TIMEOUT_S = 30.0
_IDLE_TIMEOUT_S = 30.0
#: method -> (query parameter, operation), the first present wins; see :func:`s3_op`
_QUERY_OPS = {"POST": (("uploads", "create_multipart"), ("uploadId", "complete_multipart"),
                       ("delete", "delete_objects")),
              "PUT": (("partNumber", "upload_part"),), "DELETE": (("uploadId", "abort_multipart"),),
              "GET": (("uploads", "list_uploads"), ("uploadId", "list_parts"))}


def s3_op(method: str, key: str, query: dict[str, list[str]]) -> str:
    """The S3 operation a request is, by its method and query (what botocore names it, shortened)."""
    for name, op in _QUERY_OPS.get(method, ()):
        if name in query:
            return op
    if method == "GET":
        return "list" if not key or "list-type" in query else "get"
    return {"PUT": "put", "DELETE": "delete", "HEAD": "head"}.get(method, "other")


OPS = frozenset({op for pairs in _QUERY_OPS.values() for _, op in pairs} | {"put", "get", "head", "delete", "list",
                                                                             "other"})


@dataclass
class Rule:
    action: str
    method: str | None = None
    key: str = "*"
    op: str | None = None
    part: int | None = None
    attempts: frozenset[int] | set[int] | None = None
    times: int | None = None
    probability: float = 1.0
    seed: int = 0
    after_bytes: int | None = None  # None: 0, but the middle of the body for ``corrupt``
    stall_s: float = 0.0
    seen: int = 0
    fired: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {sorted(ACTIONS)}")
        if self.op is not None and self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; one of {sorted(OPS)}")
        self._rng = random.Random(self.seed)

    def decide(self, method: str, op: str, key: str, part: int | None, n: int) -> bool:
        """Whether this rule fires for the ``n``-th request of ``op`` on ``key`` and ``part`` (the
        caller holds the proxy's lock)."""
        if (self.method is not None and method != self.method or self.op is not None and op != self.op
                or self.part is not None and part != self.part or not fnmatch.fnmatchcase(key, self.key)):
            return False
        if self.action == "corrupt" and method != "PUT":
            return False  # a damaged XML request (a complete, a bulk delete) is refused, never stored
        self.seen += 1
        if self.attempts is not None and n not in self.attempts:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        if self.probability < 1.0 and self._rng.random() >= self.probability:
            return False
        self.fired += 1
        return True


@dataclass(frozen=True)
class Seen:
    """One request as the proxy answered it: ``status`` is moto's (0 when not forwarded)."""

    method: str
    key: str
    action: str | None
    status: int
    op: str = "other"  # the S3 operation (:func:`s3_op`)
    part: int | None = None  # its partNumber
    range: str | None = None  # its Range header ("bytes=START-END"), None for a whole object


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rules: list[Rule] = []
        self.log: list[Seen] = []
        self._begun = 0  # requests taken up (``settle``)
        self._attempts: dict[tuple[str, str, int | None], int] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._serve: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def options(self, opts: dict[str, Any], **config: Any) -> dict[str, Any]:
        """``opts`` (s3fs storage options) reaching moto through this proxy; ``config`` goes to
        botocore's Config (``read_timeout=2`` for a stall)."""
        out = {**opts, "client_kwargs": {**opts.get("client_kwargs", {}), "endpoint_url": self.url}}
        if config:
            out["config_kwargs"] = {**opts.get("config_kwargs", {}), **config}
        return out

    def add(self, rule: Rule) -> Rule:
        with self._cond:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._cond:
            self.rules.clear()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Waits (bounded) until ``predicate`` holds, looked at after each answered request."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def settle(self, timeout: float = 10.0) -> bool:
        """Waits (bounded) until every request taken up is in ``log``, where a handler puts it after its
        response: a call's last request may be missing when the call returns (issue 21)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._begun == len(self.log), timeout)

    def requests(self, method: str | None = None, pattern: str = "*", *, op: str | None = None) -> list[Seen]:
        """The logged requests of ``method`` (None: any) and ``op`` (None: any) on keys ``pattern``."""
        with self._cond:
            return [s for s in self.log if (method is None or s.method == method) and (op is None or s.op == op)
                    and fnmatch.fnmatchcase(s.key, pattern)]

    def start(self) -> "FaultProxy":
        self._serve = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="s3proxy", daemon=True)
        self._serve.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._serve is not None:
            self._server.shutdown()
            self._serve.join(timeout)
        with self._cond:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:  # wakes handlers blocked reading an idle keep-alive connection
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._server.server_close()
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"s3proxy handlers still running after {timeout} s: {alive}"

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # used by the handler -------------------------------------------------------------------------
    def _decide(self, method: str, op: str, key: str, part: int | None) -> Rule | None:
        with self._cond:
            self._begun += 1
            n = self._attempts[(op, key, part)] = self._attempts.get((op, key, part), 0) + 1
            for rule in self.rules:
                if rule.decide(method, op, key, part, n):
                    return rule
        return None

    def _record(self, seen: Seen) -> None:
        with self._cond:
            self.log.append(seen)
            self._cond.notify_all()

    def _forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, str, list, bytes]:
        conn = http.client.HTTPConnection(*self._upstream, timeout=_UPSTREAM_TIMEOUT_S)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in _HOP:
                    conn.putheader(name, value)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()


def flip_bit(body: bytes, at: int | None = None, *, aws_chunked: bool = False) -> bytes:
    """``body`` with the low bit of payload byte ``at`` (default: the middle) flipped. In aws-chunked
    framing (each chunk a hex size line, its data and CRLF; then a 0-size chunk and the trailers: the
    x-amz-checksum-* botocore sends over TLS) the byte is counted in the chunks' data only, so the
    framing (and a trailing checksum) stays intact and the server stores a damaged payload instead of
    refusing a malformed request."""
    spans = _chunk_spans(body) if aws_chunked else [(0, len(body))]
    size = sum(end - start for start, end in spans)
    at = size // 2 if at is None else min(max(at, 0), size - 1)
    for start, end in spans:  # (no span when there is no payload: returned as it is)
        if at < end - start:
            return body[:start + at] + bytes([body[start + at] ^ 0x01]) + body[start + at + 1:]
        at -= end - start
    return body


def _chunk_spans(body: bytes) -> list[tuple[int, int]]:
    """The (start, end) offsets of the data of each chunk of an aws-chunked body."""
    spans, pos = [], 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0].strip(), 16)
        if size == 0:
            return spans
        spans.append((eol + 2, eol + 2 + size))
        pos = eol + 2 + size + 2


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False  # FaultProxy.stop joins the handlers itself, with a deadline
    allow_reuse_address = True
    proxy: FaultProxy

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=f"s3proxy-{client_address[1]}", daemon=True)
        with self.proxy._cond:
            self.proxy._threads.append(thread)
            self.proxy._conns.add(request)
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self.proxy._cond:
            self.proxy._conns.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's pool expects
    disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms delayed-ACK stall each
    timeout = _IDLE_TIMEOUT_S
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        proxy = self.server.proxy
        url = urllib.parse.urlsplit(self.path)
        key = urllib.parse.unquote(url.path).lstrip("/").partition("/")[2]
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        op = s3_op(self.command, key, query)
        part = int(query["partNumber"][0]) if query.get("partNumber", [""])[0].isdigit() else None
        rule = proxy._decide(self.command, op, key, part)
        action = rule.action if rule is not None else None
        after = (rule.after_bytes or 0) if rule is not None else 0
        status = 0
        try:
            if action == "reset_request":
                self._read_body(limit=after)
                return self._reset()
            body = self._read_body()
            if action == "corrupt":
                body = flip_bit(body, rule.after_bytes, aws_chunked=self._aws_chunked())
            if action in _ERRORS:
                return self._error(*_ERRORS[action])
            if action == "stall":
                proxy._stop.wait(rule.stall_s)
                self.close_connection = True
                return None
            try:
                status, reason, headers, payload = proxy._forward(self.command, self.path, self.headers, body)
            except OSError:
                return self._error(502, "BadGateway", "the proxy could not reach the server")
            if action == "lost":
                return self._reset()
            if action == "reset_response":
                self._respond(status, reason, headers, payload[:after], length=len(payload))
                return self._reset()
            if action == "short_body":
                payload = payload[:after]
            self._respond(status, reason, headers, payload)
        finally:
            proxy._record(Seen(self.command, key, action, status, op, part, self.headers.get("Range")))

    def _aws_chunked(self) -> bool:
        """Whether the body is aws-chunked (botocore's trailing checksums: over TLS only, never here)."""
        return ("aws-chunked" in self.headers.get("Content-Encoding", "").lower()
                or self.headers.get("X-Amz-Content-SHA256", "").startswith("STREAMING-"))

    def _read_body(self, limit: int | None = None) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024).strip():  # trailers
                        pass
                    return b"".join(chunks)[:limit]
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length if limit is None else min(limit, length))

    def _error(self, status: int, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                f"<RequestId>s3proxy</RequestId></Error>").encode()
        self._respond(status, code, [("Content-Type", "application/xml")], body)

    def _respond(self, status: int, reason: str, headers: list, payload: bytes, length: int | None = None) -> None:
        self.send_response_only(status, reason)
        upstream_length = None
        for name, value in headers:
            if name.lower() == "content-length":
                upstream_length = value
            elif name.lower() not in _HOP:
                self.send_header(name, value)
        bodiless = self.command == "HEAD" or status in (204, 304)
        if bodiless:
            if upstream_length is not None:
                self.send_header("Content-Length", upstream_length)
        else:
            self.send_header("Content-Length", str(len(payload) if length is None else length))
        self.end_headers()
        if not bodiless and payload:
            self.wfile.write(payload)

    def _reset(self) -> None:
        """Closes the connection with an RST (SO_LINGER 0), as a crashed server or a middlebox does."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.rfile.close()  # the file's reference would keep the socket open past close()
        self.connection.close()
