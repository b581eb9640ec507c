"""The HTTP backend of `jaxlearn serve`: OpenAI-compatible endpoints on `httpd` (the
stdlib `http.server`, hardened: deadlines, connection cap, Host / Origin / API-key
checks, JSON errors; see httpd.py).

    POST /v1/completions        prompt (text or ids) -> text; "stream": true -> SSE
    POST /v1/chat/completions   messages -> assistant message; "stream": true -> SSE
    POST /v1/responses          OpenAI Responses API (stateless; `responses_api`)
    POST /v1/messages           Anthropic Messages API (`messages_api`; its error shape)
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread runs, else 503 (no API key)
    GET  /metrics               Prometheus text (engine + HTTP counters)

Threads: HTTP handler threads parse and validate, then enqueue the request's engine
requests (one per prompt and candidate: `completions.Group`) on the engine's scheduler
and wait on their private queue; one engine thread (`Engine.start`) runs the
scheduler loop. One HTTP request keeps at most `Limits.max_active_per_request` engine
requests in the engine at a time (default max(1, max_batch // 2)), submitting the next
as one finishes, so other clients' requests queue between them: a request of 64 prompts
x best_of 4 takes a bounded share of the slots and queue instead of all of them.

Every problem with a request is a 4xx with an OpenAI-style error body (the request
checks of `protocol`, httpd's limits and policy; a full queue: 429 with Retry-After). A
client that disconnects (detected on write for streams, by polling the socket otherwise)
has its request cancelled, which frees its slot at the next step.

Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable, Optional

from jaxlearn.inference.engine import Engine
from jaxlearn.inference.errors import InferenceError, QueueFullError, RequestError
from jaxlearn.serve import messages_api, responses_api
from jaxlearn.serve.api_common import new_id as api_id
from jaxlearn.serve.api_common import reply_blocks
from jaxlearn.serve.completions import Candidate, Group
from jaxlearn.serve.httpd import Handler, HTTPError, HTTPServer, Limits, Policy
from jaxlearn.serve.protocol import (
    ParsedRequest,
    chunk,
    new_id,
    parse_chat,
    parse_completion,
    response,
)
from jaxlearn.text.detokenize import Delta

PARSERS = {
    "/v1/completions": parse_completion,
    "/v1/chat/completions": parse_chat,
    "/v1/responses": responses_api.parse_responses,
    "/v1/messages": messages_api.parse_messages_request,
}
# Runtime LoRA adapter loading (vLLM's routes), when the server has an adapter loader.
ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
PATHS = (*PARSERS, *ADAPTER_PATHS, "/v1/models", "/health", "/metrics")


class InferenceServer:
    """An OpenAI-compatible HTTP server over `engine` (see module docstring).

    port 0 picks a free port (see `address`). `api_key`: required as
    `Authorization: Bearer <key>` on every path but /health. `allowed_hosts` extends
    the Host allowlist (loopback names when bound to loopback; otherwise any Host
    unless given); `allowed_origins` turns CORS on for those origins. `limits`: see
    `httpd.Limits`; its max_connections defaults to max_batch + max_queue + 16 here, its
    max_active_per_request (when None) to max(1, max_batch // 2). `adapter_loader(path) ->
    (rank, alpha, params)` turns on the runtime adapter routes (POST
    /v1/load_lora_adapter {"lora_name", "lora_path"}, /v1/unload_lora_adapter
    {"lora_name"}); without one they answer 404. The engine needs `max_loras` > 0.
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        api_key: Optional[str] = None,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        limits: Optional[Limits] = None,
        adapter_loader: Optional[Callable[[str], tuple[int, float, Any]]] = None,
    ):
        self.engine = engine
        self.adapter_loader = adapter_loader
        limits = limits or self.default_limits(engine)
        if limits.max_active_per_request is None:
            limits = dataclasses.replace(limits,
                                         max_active_per_request=max(1, engine.max_batch // 2))
        self.limits = limits
        self.policy = Policy.for_bind(host, api_key=api_key, allowed_hosts=allowed_hosts,
                                      allowed_origins=allowed_origins)
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = HTTPServer((host, port), handler, self.policy, self.limits, self._count)
        self._thread: Optional[threading.Thread] = None
        engine.metrics.describe("http_requests_total",
                                "HTTP requests answered, by path and status.")
        engine.metrics.describe("http_connections_open", "Open HTTP connections.")
        engine.metrics.gauge("http_connections_open", lambda: self.httpd.open_connections)
        engine.metrics.describe("http_connections_waiting",
                                "Open HTTP connections waiting for a request head.")
        engine.metrics.gauge("http_connections_waiting",
                             lambda: self.httpd.waiting_connections)

    @staticmethod
    def default_limits(engine: Engine, max_connections: Optional[int] = None,
                       **fields: Any) -> Limits:
        """`Limits(**fields)`, max_connections by default max_batch + max_queue + 16
        (max_active_per_request: see `InferenceServer`)."""
        n = max_connections or engine.max_batch + engine.scheduler.max_queue + 16
        return Limits(max_connections=n, **fields)

    def _count(self, path: str, status: int) -> None:
        self.engine.metrics.inc("http_requests_total", path=path if path in PATHS else "other",
                                code=str(status))

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


class _Handler(Handler):
    app: InferenceServer

    def do_GET(self) -> None:
        path, eng = self.route, self.app.engine
        if path == "/health":
            ok = eng.running
            self.send_json(200 if ok else 503, {"status": "ok" if ok else "engine not running"})
        elif path == "/metrics":
            body = eng.metrics.render().encode()
            self.send_body(200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            models = [{"id": eng.model_name, "object": "model", "created": 0,
                       "owned_by": "jaxlearn", "root": eng.model_name, "parent": None,
                       "max_model_len": eng.max_seq_len}]
            models += [{"id": name, "object": "model", "created": 0, "owned_by": "jaxlearn",
                        "root": name, "parent": eng.model_name,
                        "max_model_len": eng.max_seq_len} for name in eng.adapter_names()]
            self.send_json(200, {"object": "list", "data": models})
        elif path in PARSERS:
            raise HTTPError(405, f"use POST for {path}", headers={"Allow": "POST"})
        else:
            raise HTTPError(404, f"no route {path[:200]}")

    def error_json(self, e: HTTPError) -> Any:
        if self.route == "/v1/messages":
            return messages_api.error_shape(e.status, e.message)
        return super().error_json(e)

    def do_POST(self) -> None:
        path = self.route
        if path in ADAPTER_PATHS:
            return self._adapters(path, self.read_json())
        parse = PARSERS.get(path)
        if parse is None:
            raise HTTPError(404, f"no route {path[:200]}")
        body = self.read_json()
        eng = self.app.engine
        try:
            req = parse(body, vocab_size=eng.vocab_size, max_seq_len=eng.max_seq_len)
        except RequestError as e:
            raise HTTPError(400, str(e), e.param) from None
        if req.model is not None and req.model != eng.model_name:
            names = eng.adapter_names()
            if req.model not in names:
                served = ", ".join(repr(n) for n in [eng.model_name, *names])
                raise HTTPError(404, f"model {req.model!r} not found; serving {served}",
                                "model")
            req.adapter = req.model
        if path in ("/v1/responses", "/v1/messages"):
            self._generate_api(path, req, body)
        else:
            self._generate(req)

    # ---- generation -----------------------------------------------------------------

    def _generate(self, parsed: ParsedRequest) -> None:
        try:
            group = Group(self.app.engine, parsed, self.app.limits.max_active_per_request)
        except RequestError as e:
            raise HTTPError(400, str(e), e.param) from None
        rid = new_id(parsed.kind)
        try:
            if parsed.stream:
                self._stream(parsed, rid, group)
            else:
                self._collect(parsed, rid, group)
        except QueueFullError as e:
            raise HTTPError(429, str(e)) from None
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
            raise HTTPError(500, "generation failed on the device")
        model = parsed.adapter or self.app.engine.model_name
        self.send_json(200, response(parsed.kind, rid, model, group.choices(), group.usage()))

    def _open_stream(self, group: Group) -> None:
        group.submit()  # A full queue is a 429 before the stream starts.
        self.close_connection = True  # The body ends when the connection closes.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.server.count(self.route, 200)

    def _send_events(self, events: list[tuple[str, Any]]) -> None:
        """Server-sent events with names (`event: NAME`), as the Responses and Messages
        APIs stream."""
        for name, obj in events:
            self.wfile.write(f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _stream(self, parsed: ParsedRequest, rid: str, group: Group) -> None:
        model = parsed.adapter or self.app.engine.model_name
        self._open_stream(group)

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

    # ---- LoRA adapters at run time ---------------------------------------------------

    def _adapters(self, path: str, body: Any) -> None:
        app, eng = self.app, self.app.engine
        if app.adapter_loader is None:
            raise HTTPError(404, f"{path}: runtime adapter loading is off (jaxlearn serve "
                                 "--allow_runtime_lora turns it on)")
        fields = {"lora_name"} | ({"lora_path"} if path.endswith("/load_lora_adapter") else set())
        if not isinstance(body, dict) or set(body) != fields or not all(
                isinstance(body[k], str) and body[k] for k in fields):
            raise HTTPError(400, f"the body must be {{{', '.join(sorted(fields))}}} (strings)",
                            "lora_name")
        name = body["lora_name"]
        try:
            if path.endswith("/unload_lora_adapter"):
                if name not in eng.adapter_names():
                    raise HTTPError(404, f"no adapter {name!r} is loaded", "lora_name")
                eng.unload_adapter(name)
            else:
                if name == eng.model_name or name in eng.adapter_names():
                    raise HTTPError(400, f"the name {name!r} is taken", "lora_name")
                rank, alpha, params = app.adapter_loader(body["lora_path"])
                eng.load_adapter(name, rank, alpha, params)
        except HTTPError:
            raise
        except RequestError as e:
            raise HTTPError(400, str(e), "lora_name") from None
        except InferenceError as e:  # In use by queued or running requests.
            raise HTTPError(409, str(e), "lora_name") from None
        except (ValueError, OSError) as e:  # What the loader refused (InteropError too).
            raise HTTPError(400, str(e), "lora_path" if "lora_path" in body else "lora_name"
                            ) from None
        self.send_json(200, {"status": "ok", "lora_name": name,
                             "loaded": eng.adapter_names()})

    # ---- the Responses and Messages APIs ----------------------------------------------

    def _generate_api(self, path: str, parsed: ParsedRequest, body: Any) -> None:
        try:
            group = Group(self.app.engine, parsed, self.app.limits.max_active_per_request)
        except RequestError as e:
            raise HTTPError(400, str(e), e.param) from None
        try:
            if parsed.stream:
                self._stream_api(path, parsed, body, group)
            else:
                self._collect_api(path, parsed, body, group)
        except QueueFullError as e:
            raise HTTPError(429, str(e)) from None
        finally:
            group.cancel()

    def _collect_api(self, path: str, parsed: ParsedRequest, body: Any, group: Group) -> None:
        while not group.done:
            if self._next(group) is None:
                return
        (c,) = group.candidates
        if c.finish == "error":
            raise HTTPError(500, "generation failed on the device")
        assert c.reply is not None
        events = c.reply.events("".join(c.text), last=True)
        blocks = reply_blocks(events, {k.id for k in c.reply.out.calls})
        model = parsed.adapter or self.app.engine.model_name
        if path == "/v1/responses":
            echo = responses_api.body_echo(parsed, body, model)
            status = "incomplete" if c.finish == "length" else "completed"
            self.send_json(200, responses_api.response_object(
                api_id("resp"), echo, blocks, responses_api.item_ids(blocks), status,
                c.finish, group.usage()))
        else:
            self.send_json(200, messages_api.message_object(
                api_id("msg"), model, blocks, c.finish, c.request.output.stop_reason,
                group.usage()))

    def _stream_api(self, path: str, parsed: ParsedRequest, body: Any, group: Group) -> None:
        model = parsed.adapter or self.app.engine.model_name
        stream: Any
        if path == "/v1/responses":
            stream = responses_api.ResponsesStream(
                api_id("resp"), responses_api.body_echo(parsed, body, model))
        else:
            stream = messages_api.MessagesStream(api_id("msg"), model,
                                                 len(group.prompt_ids[0]))
        self._open_stream(group)
        self._send_events(stream.open())
        (c,) = group.candidates
        assert c.reply is not None
        while not group.done:
            event = self._next(group)
            if event is None:
                return
            _, delta = event
            self._send_events(stream.on(c.reply.events(delta.text,
                                                       last=delta.finish_reason is not None)))
        if path == "/v1/responses":
            self._send_events(stream.close(c.finish, group.usage()))
        else:
            self._send_events(stream.close(c.finish, c.request.output.stop_reason,
                                           group.usage()))
        time.sleep(0)
