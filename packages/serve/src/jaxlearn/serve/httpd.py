"""The HTTP/1.1 layer under `InferenceServer`: the stdlib `http.server` (one thread per
connection, so SSE streams, client-disconnect polling and the engine's blocking queues
stay plain code), hardened for a server that any local web page or process can reach.

- Deadlines, not only idle timeouts: a new connection must send its request line and
  headers within `header_timeout` of being accepted (a kept-alive one: within
  `header_timeout` of its next request's first byte, which may take `keep_alive_timeout`),
  else 408 (nothing sent at all: closed quietly); the body within `io_timeout`. Each recv
  waits only until the deadline, so a client trickling bytes cannot hold a thread.
- `max_connections` open connections, of which at most `max_pending_connections` may be
  waiting for a request head (new, kept-alive idle, or half-sent). A connection that would
  exceed either cap closes the oldest waiting one (408 if it had sent part of a request)
  instead of being refused, so connections that send nothing, or only a request line,
  cannot lock out clients with complete requests; only when every connection is busy with
  a request is a new one refused (429 written from the accept loop, then closed).
  Listen backlog `backlog`, TCP_NODELAY, and every response (headers and body) in one
  write, so kept-alive requests do not wait for the client's delayed ACK.
- Every error is an OpenAI-style JSON body with a status line: malformed request lines
  (400), HTTP/0.9 (400) or HTTP/2+ over this port (505), request lines over 16 KiB (414),
  header lines over 64 KiB or over 100 headers (431), unknown methods (501), known but
  unserved ones (405 + Allow), timeouts (408), internal errors (500).
- `Policy`: the Host header parsed strictly as host[:port] (a name or IPv4 address, or
  an IPv6 address in brackets; port digits only; one Host header), else 400, and checked
  against an allowlist (loopback names when bound to loopback: DNS rebinding), `Origin`
  refused (403) unless in `allowed_origins` (then CORS headers and preflights),
  `Authorization: Bearer <api_key>` (401), POST bodies only as `application/json` (415:
  a page cannot send it cross-origin without a preflight), JSON bodies bounded in size
  (413) and depth (`MAX_JSON_DEPTH`; `response_format`, which holds a JSON schema,
  `MAX_SCHEMA_DEPTH`), lone surrogates refused (400).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from jaxlearn.serve.access import (  # noqa: F401  (HTTPError, host_name: re-exported)
    HTTPError,
    Policy,
    host_name,
    is_loopback,
    parse_host,
)
from jaxlearn.serve.protocol import error_body

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 16 << 10
MAX_JSON_DEPTH = 64  # Nesting of a request body outside `response_format`.
# Nesting of `response_format`: llguidance parses a JSON schema nested up to about 125
# levels (serde_json's recursion limit of 128, then its own), so the schema, 3 levels down
# `response_format`, may nest as deep as llguidance accepts.
MAX_SCHEMA_DEPTH = 128
SERVED_METHODS = ("GET", "POST", "OPTIONS")
_HTTP_METHODS = frozenset({"HEAD", "PUT", "DELETE", "PATCH", "CONNECT", "TRACE"})
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what a client can hold (seconds, bytes, counts).

    max_connections: open connections (one thread each); max_pending_connections: of
    those, how many may wait for a request head (None: half of max_connections); see
    `HTTPServer`. header_timeout: a new connection's request line and headers, from
    accept (a kept-alive one's, from the first byte of its next request, which may take
    keep_alive_timeout); io_timeout: a body, and every write. max_active_per_request:
    engine requests one HTTP request keeps in the engine (queued or running) at a time,
    the rest submitted as those finish (None: `InferenceServer` uses max(1, max_batch // 2)),
    so one request of many prompts x best_of cannot take every slot and the whole queue.
    """

    max_connections: int = 64
    backlog: int = 128
    keep_alive_timeout: float = 5.0
    header_timeout: float = 3.0
    io_timeout: float = 30.0
    max_body_bytes: int = 1 << 20
    max_pending_connections: Optional[int] = None
    max_active_per_request: Optional[int] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (v is None and f.default is None) and not v > 0:
                raise ValueError(f"Limits.{f.name}={v!r}: must be > 0")

    @property
    def pending_cap(self) -> int:
        """Connections that may wait for a request head at once (<= max_connections)."""
        n = self.max_pending_connections or max(1, self.max_connections // 2)
        return min(n, self.max_connections)


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most until `deadline` (time.monotonic; None:
    io_timeout per read). Every read restores the socket timeout to io_timeout, which
    bounds writes."""

    def __init__(self, sock: socket.socket, io_timeout: float):
        self.sock, self.io_timeout = sock, io_timeout
        self.deadline: Optional[float] = None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.io_timeout if self.deadline is None else self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("read deadline passed")
        self.sock.settimeout(min(left, self.io_timeout))
        try:
            return self.sock.recv_into(b)
        finally:
            self.sock.settimeout(self.io_timeout)


def _surrogate_path(x: Any, path: str = "") -> Optional[str]:
    """Where in a decoded JSON value a string (or key) holds a lone surrogate."""
    if isinstance(x, str):
        return path if _SURROGATE.search(x) else None
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        p = f"{path}[{k}]" if isinstance(x, list) else f"{path}.{k}" if path else str(k)
        found = p if isinstance(k, str) and _SURROGATE.search(k) else _surrogate_path(v, p)
        if found is not None:
            return found
    return None


def _depth(x: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping at limit + 1."""
    stack, deepest = [(x, 1)], 0
    while stack and deepest <= limit:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, (dict, list)):
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _check_depth(body: Any) -> None:
    """400 when a body nests deeper than MAX_JSON_DEPTH outside `response_format`, or
    `response_format` (holding a JSON schema) deeper than MAX_SCHEMA_DEPTH, naming it.
    Iterative: no recursion on what the client sent (json.loads is bounded by the
    interpreter's recursion limit: RecursionError, a 400)."""
    rest = body
    if isinstance(body, dict) and "response_format" in body:
        rest = {k: v for k, v in body.items() if k != "response_format"}
        if _depth(body["response_format"], MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise HTTPError(400, f"'response_format': JSON nested deeper than "
                                 f"{MAX_SCHEMA_DEPTH} levels", "response_format")
    if _depth(rest, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise HTTPError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _unread(sock: socket.socket) -> bool:
    """Whether bytes (or the peer's EOF) wait in `sock` unread (a closed socket: no)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog, caps on open and waiting connections,
    IPv6 binds, and the `Policy` / `Limits` its handlers read. `count(path, status)` sees
    every response (a refused connection: path "").

    A connection is *waiting* from accept, and again between kept-alive requests, until
    its request head (line + headers) has been read. Waiting connections cost a thread
    and do nothing, and need no API key, so they must not be able to fill the server:
    when a new connection would make more than `Limits.pending_cap` waiting or more than
    `max_connections` open, the oldest waiting one whose thread has read all it was sent
    (blocked in recv: half-open, trickling or idle) is closed for it (its read side shut
    down, which wakes its thread: a 408 if it had sent part of a request, else nothing).
    One whose bytes still sit unread in its socket (a burst of clients faster than their
    threads start) is never closed: then the new one is admitted past pending_cap, or
    refused at max_connections. An attacker holding half-open connections thus only
    pushes out its own older ones (or idle kept-alive ones, which a client may see closed
    at any time anyway), and a client that sends its request promptly gets in. Only when
    no connection can be closed is a new one refused with 429."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, policy: Policy,
                 limits: Limits, count: Callable[[str, int], None] = lambda p, s: None):
        self.policy, self.limits, self.count = policy, limits, count
        self.request_queue_size = limits.backlog
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._lock = threading.Lock()
        self._open: set[Any] = set()  # Counted connections (not closed for others).
        self._waiting: dict[Any, None] = {}  # Waiting ones, oldest first.
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def waiting_connections(self) -> int:
        return len(self._waiting)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            victim = None
            if (len(self._waiting) >= self.limits.pending_cap or
                    len(self._open) >= self.limits.max_connections):
                victim = next((c for c in self._waiting if not _unread(c)), None)
                if victim is not None:
                    self._forget(victim)
            full = len(self._open) >= self.limits.max_connections
            if not full:
                self._open.add(request)
                self._waiting[request] = None
        if victim is not None:
            try:
                victim.shutdown(socket.SHUT_RD)  # Its recv returns EOF at once.
            except OSError:
                pass
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._forget(request)

    def _forget(self, sock: Any) -> None:  # Under _lock.
        self._open.discard(sock)
        self._waiting.pop(sock, None)

    def mark_waiting(self, sock: Any) -> bool:
        """A kept-alive connection waits for its next request (newest of the waiting);
        False if it was closed for others."""
        with self._lock:
            if sock not in self._open:
                return False
            self._waiting.pop(sock, None)
            self._waiting[sock] = None
            return True

    def mark_busy(self, sock: Any) -> bool:
        """A connection's request head was read; False if it was closed for others."""
        with self._lock:
            self._waiting.pop(sock, None)
            return sock in self._open

    def was_closed_for_others(self, sock: Any) -> bool:
        with self._lock:
            return sock not in self._open

    def shutdown_request(self, request: Any) -> None:
        """Closes after reading what the client still sends (at most 1 s / 1 MiB), so an
        error answered before its request was read whole reaches the client instead of
        being lost to the reset that closing with unread data sends."""
        try:
            request.shutdown(socket.SHUT_WR)
            end, left = time.monotonic() + min(1.0, self.limits.io_timeout), 1 << 20
            while left > 0 and (t := end - time.monotonic()) > 0:
                request.settimeout(t)
                got = len(request.recv(min(left, 1 << 16)))
                if not got:
                    break
                left -= got
        except OSError:
            pass
        self.close_request(request)

    def _refuse(self, sock: socket.socket) -> None:
        n = self.limits.max_connections
        body = json.dumps(error_body(429, f"too many open connections (at most {n}); "
                                          f"retry later")).encode()
        head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            sock.setblocking(False)  # Never stall the accept loop.
            sock.send(head.encode() + body)
        except OSError:
            pass
        self.count("", 429)
        super().shutdown_request(sock)  # No lingering in the accept loop.


class Handler(BaseHTTPRequestHandler):
    """Reads requests under the server's deadlines, applies its `Policy`, dispatches to
    `do_GET` / `do_POST` (which raise `HTTPError` for error responses) and answers every
    failure with a JSON error. Subclasses use `send_json`, `send_body`, `read_json`."""

    server: HTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "jaxlearn"
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        io_timeout = self.server.limits.io_timeout
        self.connection.settimeout(io_timeout)
        self.rfile.close()  # Replaced by a reader under deadlines.
        self._reader = _DeadlineReader(self.connection, io_timeout)
        self._buffered = io.BufferedReader(self._reader, 1 << 16)
        self.rfile = self._buffered
        self._accepted, self._first = time.monotonic(), True

    def version_string(self) -> str:
        return self.server_version  # No Python version in the Server header.

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)

    @property
    def route(self) -> str:
        return (self.path or "").split("?")[0]

    # ---- one request ------------------------------------------------------------------

    def handle_one_request(self) -> None:
        lim = self.server.limits
        self.close_connection = True
        self.command, self.path, self.request_version = "", "", "HTTP/1.1"
        self.requestline = ""
        self.cors_origin: Optional[str] = None
        self._started = False
        self._clean = False  # Whether the request was read whole (keep-alive after errors).
        self._waiting = True  # Until the request head is read (see HTTPServer).
        first, self._first = self._first, False
        if not first and not self.server.mark_waiting(self.connection):
            return
        # A new connection has header_timeout from accept for its whole head; a kept-alive
        # one keep_alive_timeout for the first byte, then header_timeout for the head.
        head_by = self._accepted + lim.header_timeout
        try:
            self._reader.deadline = head_by if first else (
                time.monotonic() + lim.keep_alive_timeout)
            if not self._buffered.peek(1):
                return
        except OSError:  # Nothing sent in time, reset, or closed for others.
            return
        self._reader.deadline = head_by if first else time.monotonic() + lim.header_timeout
        try:
            if not self._read_head():
                return
            if not self.server.mark_busy(self.connection):
                raise HTTPError(408, "closed for others")  # Replaced: send_json_error.
            self._waiting = False
            self._reader.deadline = time.monotonic() + lim.io_timeout
            self._dispatch()
        except HTTPError as e:
            self.send_json_error(e)
        except TimeoutError:
            self.send_json_error(HTTPError(408, f"request not received in time (request line "
                                                f"and headers within {lim.header_timeout:g}s, "
                                                f"body within {lim.io_timeout:g}s)"))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:
            log.exception("internal error on %s %s", self.command, self.route)
            self.send_json_error(HTTPError(500, "internal server error"))

    def _read_head(self) -> bool:
        """Request line and headers; False once an error has been sent by parse_request."""
        raw = self.rfile.readline(MAX_REQUEST_LINE + 1)
        if raw in (b"\r\n", b"\n"):  # One empty line before a request is tolerated.
            raw = self.rfile.readline(MAX_REQUEST_LINE + 1)
        if len(raw) > MAX_REQUEST_LINE:
            raise HTTPError(414, f"request line over {MAX_REQUEST_LINE} bytes")
        line = raw.decode("latin-1").rstrip("\r\n")
        self.requestline = line[:200]
        words = line.split()
        if not raw.endswith(b"\n") or len(words) != 3 or not words[2].startswith("HTTP/"):
            raise HTTPError(400, f"malformed request line {line[:100]!r}: expected "
                                 f"'METHOD /path HTTP/1.1'")
        if words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            raise HTTPError(505, f"{words[2][:20]} is not supported; use HTTP/1.1")
        self.raw_requestline = raw
        return self.parse_request()  # Headers (431 on long lines / too many).

    def _dispatch(self) -> None:
        self._check_access()
        self._clean = not (self.headers.get("Content-Length") or
                           self.headers.get("Transfer-Encoding"))
        if self.command not in SERVED_METHODS:
            if self.command in _HTTP_METHODS:
                raise HTTPError(405, f"method {self.command} is not allowed",
                                headers={"Allow": "GET, POST"})
            raise HTTPError(501, f"method {self.command[:20]!r} is not implemented")
        if self.command == "OPTIONS":
            self._preflight()
        else:
            getattr(self, "do_" + self.command)()

    def _check_access(self) -> None:
        """Host, Origin, API key (not for preflights) and a POST's Content-Type."""
        p = self.server.policy
        p.check_host(self.headers.get_all("Host") or [])
        self.cors_origin = p.cors_origin(self.headers.get("Origin"))
        if self.command == "OPTIONS":
            return
        p.check_key(self.route, self.headers.get("Authorization"), self.headers.get("x-api-key"))
        ctype = self.headers.get("Content-Type", "")
        if self.command == "POST" and ctype.split(";")[0].strip().lower() != "application/json":
            raise HTTPError(415, f"Content-Type {ctype[:60]!r} is not supported; send "
                                 f"'Content-Type: application/json'")

    def _preflight(self) -> None:
        if self.cors_origin is None or "Access-Control-Request-Method" not in self.headers:
            raise HTTPError(405, "method OPTIONS is not allowed (CORS preflights only, with "
                                 "--allowed_origins)", headers={"Allow": "GET, POST"})
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, POST")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.end_headers()
        self.server.count(self.route, 204)

    # ---- responses --------------------------------------------------------------------

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        super().send_response(code, message)
        self._started = True
        if self.cors_origin is not None:
            self.send_header("Access-Control-Allow-Origin", self.cors_origin)
            self.send_header("Vary", "Origin")

    def send_body(self, status: int, body: bytes, ctype: str,
                  headers: Optional[dict[str, str]] = None) -> None:
        """The whole response in one write."""
        if self.command == "HEAD":  # Refused with a body: the client must not reuse it.
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self._headers_buffer.append(b"\r\n" + body)  # type: ignore[attr-defined]
        self.flush_headers()
        self.server.count(self.route, status)

    def send_json(self, status: int, obj: Any, headers: Optional[dict[str, str]] = None) -> None:
        self.send_body(status, json.dumps(obj).encode(), "application/json", headers)

    def send_json_error(self, e: HTTPError) -> None:
        if self._waiting and self.server.was_closed_for_others(self.connection):
            lim = self.server.limits  # Whatever its partial head looked like when cut.
            e = HTTPError(408, f"request line and headers not received: the connection was "
                               f"closed for newer ones (at most {lim.pending_cap} may wait "
                               f"for their request at a time)")
        if not self._clean:
            self.close_connection = True  # The rest of the request was not read.
        if self._started:  # Mid-response: all that is left is to close.
            self.close_connection = True
            return
        headers = {"Retry-After": "1", **e.headers} if e.status == 429 else e.headers
        try:
            self.send_json(e.status, self.error_json(e), headers)
        except OSError:
            self.close_connection = True

    def error_json(self, e: HTTPError) -> Any:
        """The body of an error response (an API with its own error shape overrides it)."""
        return error_body(e.status, e.message, e.param)

    def send_error(self, code: int, message: Optional[str] = None,
                   explain: Optional[str] = None) -> None:
        """http.server's own errors (header limits), as JSON."""
        text = message or self.responses.get(code, ("error",))[0]
        self.send_json_error(HTTPError(code, f"{text}: {explain}" if explain else text))

    def handle_expect_100(self) -> bool:
        """Refuses a request before its body is sent (Expect: 100-continue)."""
        self._check_access()
        return super().handle_expect_100()

    # ---- request bodies ---------------------------------------------------------------

    def read_json(self) -> Any:
        """The JSON body: Content-Length required (411), at most max_body_bytes (413),
        valid UTF-8 JSON without NaN / Infinity, nested at most MAX_JSON_DEPTH (its
        `response_format` MAX_SCHEMA_DEPTH), no lone surrogates (400)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            raise HTTPError(411, "chunked bodies are not supported; send Content-Length")
        if not lengths:
            raise HTTPError(411, "Content-Length is required")
        try:
            n = int(lengths[0])
            if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
                raise ValueError
        except ValueError:
            raise HTTPError(400, f"bad Content-Length {', '.join(lengths)[:60]!r}") from None
        limit = self.server.limits.max_body_bytes
        if n > limit:
            left = n if n <= 8 * limit else 0  # Drain it, so the client reads the 413.
            while left > 0 and (got := len(self.rfile.read(min(1 << 16, left)))):
                left -= got
            raise HTTPError(413, f"body of {n} bytes; at most {limit}")
        raw = self.rfile.read(n)
        if len(raw) != n:
            raise HTTPError(400, "body shorter than Content-Length")
        self._clean = True
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise HTTPError(400, f"malformed JSON body: {e}") from None
        _check_depth(body)
        where = _surrogate_path(body) if _SURROGATE_ESCAPE.search(raw) else None
        if where is not None:
            raise HTTPError(400, f"{where or 'body'}: a lone UTF-16 surrogate is not valid "
                                 f"text", re.split(r"[.\[]", where)[0] or None)
        return body
