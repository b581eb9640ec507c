"""The HTTP backend of `jaxlearn serve`: OpenAI-compatible endpoints on the stdlib
`http.server.ThreadingHTTPServer` (no extra dependency).

    POST /v1/completions        prompt (text or ids) -> text; "stream": true -> SSE
    POST /v1/chat/completions   messages -> assistant message; "stream": true -> SSE
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text (engine + HTTP counters)

Threads: HTTP handler threads parse and validate, then enqueue the request's engine
requests (one per prompt and candidate: `completions.Group`) on the engine's scheduler
and wait on their private queue; one engine thread (`Engine.start`) runs the
scheduler loop. Every problem with a request is a 4xx with an OpenAI-style error body:
malformed or non-object JSON, unknown fields, wrong types, out-of-range sampling values,
prompts over max_seq_len (400), bodies over `max_body_bytes` (413), missing length (411),
unknown paths (404), wrong methods (405), a full queue or too many connections (429 with
Retry-After). A client that disconnects (detected on write for streams, by polling the
socket otherwise) has its request cancelled, which frees its slot at the next step.

Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from jaxlearn.inference.completions import Candidate, Group
from jaxlearn.inference.engine import Engine
from jaxlearn.inference.errors import QueueFullError, RequestError
from jaxlearn.inference.protocol import (
    ParsedRequest,
    chunk,
    error_body,
    new_id,
    parse_chat,
    parse_completion,
    response,
)
from jaxlearn.text.detokenize import Delta

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth(x: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping at limit + 1."""
    stack = [(x, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return deepest


class InferenceServer:
    """An OpenAI-compatible HTTP server over `engine` (see module docstring).

    port 0 picks a free port (see `address`). max_connections bounds the requests being
    handled at once (beyond it: 429); the engine's `max_queue` bounds those waiting
    for a slot.
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_body_bytes: int = 1 << 20,
        max_connections: Optional[int] = None,
        socket_timeout: float = 30.0,
    ):
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        limit = max_connections or (engine.max_batch + engine.scheduler.max_queue + 16)
        self._slots = threading.BoundedSemaphore(limit)
        self.socket_timeout = socket_timeout
        handler = type("Handler", (_Handler,), {"app": self, "timeout": socket_timeout})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: Optional[threading.Thread] = None
        m = engine.metrics
        m.describe("http_requests_total", "HTTP requests answered, by path and status.")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> "InferenceServer":
        """Starts the engine thread and serves in a background thread."""
        self.engine.start()
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="jaxlearn-http", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Starts the engine thread and serves in this thread until shutdown()."""
        self.engine.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.engine.stop()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    app: InferenceServer
    protocol_version = "HTTP/1.1"
    server_version = "jaxlearn"

    # ---- plumbing -------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)

    def _count(self, status: int) -> None:
        path = self.path.split("?")[0]
        known = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
        self.app.engine.metrics.inc(
            "http_requests_total", path=path if path in known else "other", code=str(status)
        )

    def _send(self, status: int, body: bytes, ctype: str, headers: Optional[dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self._count(status)

    def _json(self, status: int, obj: Any, headers: Optional[dict] = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _error(self, e: _HTTPError) -> None:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        self._json(e.status, error_body(e.status, e.message, e.param), headers)

    def _guarded(self, fn: Any) -> None:
        if not self.app._slots.acquire(blocking=False):
            self.close_connection = True
            self._error(_HTTPError(429, "too many concurrent requests; retry later"))
            return
        try:
            fn()
        except _HTTPError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception:
            log.exception("internal error on %s %s", self.command, self.path)
            self.close_connection = True
            try:
                self._json(500, error_body(500, "internal server error"))
            except OSError:
                pass
        finally:
            self.app._slots.release()

    # ---- routing --------------------------------------------------------------------

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _not_allowed(self) -> None:
        self.close_connection = True
        self._guarded(self._refuse_method)

    def _refuse_method(self) -> None:
        raise _HTTPError(405, f"method {self.command} is not allowed")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    def _get(self) -> None:
        path = self.path.split("?")[0]
        eng = self.app.engine
        if path == "/health":
            ok = eng.running
            self._json(200 if ok else 503, {"status": "ok" if ok else "engine not running"})
        elif path == "/metrics":
            body = eng.metrics.render().encode()
            self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{
                "id": eng.model_name, "object": "model", "created": 0, "owned_by": "jaxlearn",
                "max_model_len": eng.max_seq_len}]})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            raise _HTTPError(405, f"use POST for {path}")
        else:
            raise _HTTPError(404, f"no route {path}")

    def _read_body(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            self.close_connection = True
            raise _HTTPError(411, "chunked bodies are not supported; send Content-Length")
        if length is None:
            self.close_connection = True
            raise _HTTPError(411, "Content-Length is required")
        try:
            n = int(length)
        except ValueError:
            self.close_connection = True
            raise _HTTPError(400, f"bad Content-Length {length!r}") from None
        if n < 0 or n > self.app.max_body_bytes:
            self.close_connection = True
            if 0 < n <= 8 * self.app.max_body_bytes:  # Drain it, so the client reads our 413.
                left = n
                while left > 0:
                    got = len(self.rfile.read(min(1 << 16, left)))
                    if not got:
                        break
                    left -= got
            raise _HTTPError(413, f"body of {n} bytes; at most {self.app.max_body_bytes}")
        raw = self.rfile.read(n)
        if len(raw) != n:
            self.close_connection = True
            raise _HTTPError(400, "body shorter than Content-Length")
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _HTTPError(400, f"malformed JSON body: {e}") from None
        if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise _HTTPError(400, f"JSON nested deeper than {MAX_JSON_DEPTH}")
        return body

    def _post(self) -> None:
        path = self.path.split("?")[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self.close_connection = True
            raise _HTTPError(404, f"no route {path}")
        body = self._read_body()
        eng = self.app.engine
        parse = parse_chat if path.endswith("chat/completions") else parse_completion
        try:
            req = parse(body, vocab_size=eng.vocab_size, max_seq_len=eng.max_seq_len)
        except RequestError as e:
            raise _HTTPError(400, str(e), e.param) from None
        if req.model is not None and req.model != eng.model_name:
            raise _HTTPError(404, f"model {req.model!r} not found; serving {eng.model_name!r}",
                             "model")
        self._generate(req)

    # ---- generation -----------------------------------------------------------------

    def _generate(self, parsed: ParsedRequest) -> None:
        try:
            group = Group(self.app.engine, parsed)
        except RequestError as e:
            raise _HTTPError(400, str(e), e.param) from None
        rid = new_id(parsed.kind)
        try:
            if parsed.stream:
                self._stream(parsed, rid, group)
            else:
                self._collect(parsed, rid, group)
        except QueueFullError as e:
            raise _HTTPError(429, str(e)) from None
        finally:
            group.cancel()

    def _client_gone(self) -> bool:
        """Whether the peer closed its end (readable with no data pending)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next(self, group: Group) -> Optional[tuple[Candidate, Delta]]:
        """The group's next event, or None once the client is gone."""
        while True:
            event = group.poll(0.1)
            if event is not None:
                return event
            if self._client_gone():
                self.close_connection = True
                return None

    def _collect(self, parsed: ParsedRequest, rid: str, group: Group) -> None:
        while not group.done:
            if self._next(group) is None:
                return
        if any(c.finish == "error" for c in group.candidates):
            raise _HTTPError(500, "generation failed on the device")
        model = self.app.engine.model_name
        self._json(200, response(parsed.kind, rid, model, group.choices(), group.usage()))

    def _stream(self, parsed: ParsedRequest, rid: str, group: Group) -> None:
        model = self.app.engine.model_name
        group.submit()  # A full queue is a 429 before the stream starts.
        self.close_connection = True  # The body ends when the connection closes.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._count(200)

        def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        while not group.done:
            event = self._next(group)
            if event is None:
                return
            part = group.stream_choice(*event)
            if part is not None:
                send(chunk(parsed.kind, rid, model, [part]))
        if parsed.include_usage:
            send(chunk(parsed.kind, rid, model, [], use=group.usage()))
        send("[DONE]")
        time.sleep(0)  # Let the final write go out before the socket closes.
