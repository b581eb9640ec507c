"""Probes of the HTTP layer against a live server on a free port (raw sockets for
malformed request lines and slow clients): JSON errors with a status line for every
failure, header deadlines, the connection cap, half-open connections closed for newer
ones, the listen backlog, one-write responses, API key, Host syntax and allowlist,
Origin / CORS, JSON content type, lone surrogates."""

import json
import select
import shutil
import socket
import subprocess
import threading
import time

import pytest
from conftest import call, sse_events

from jaxlearn.serve import httpd
from jaxlearn.serve.httpd import (
    Handler,
    HTTPError,
    HTTPServer,
    Limits,
    Policy,
    host_name,
    parse_host,
)
from jaxlearn.serve.server import InferenceServer

KEY = "sk-probe"
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH_LINE = f"Authorization: Bearer {KEY}\r\n".encode()
LIMITS = Limits(max_connections=6, keep_alive_timeout=3.0, header_timeout=0.6,
                io_timeout=5.0, max_body_bytes=4096)


@pytest.fixture(scope="module")
def server(engine):
    srv = InferenceServer(engine, port=0, api_key=KEY, allowed_hosts=["api.example"],
                          allowed_origins=["http://ui.example"], limits=LIMITS).start()
    yield srv
    srv.shutdown()


@pytest.fixture()
def plain(engine):
    """A server with the defaults (no key, loopback hosts, CORS off); HTTP thread only."""
    srv = InferenceServer(engine, port=0)
    t = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def exchange(srv, data: bytes, *, timeout=10.0) -> bytes:
    """Sends data, returns everything the server sends until it closes."""
    with socket.create_connection(srv.address, timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock)


def read_all(sock) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def parse(resp: bytes):
    """(status, {lowercased header: value}, body) of one HTTP/1.1 response."""
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split(" ")[:2]
    assert version == "HTTP/1.1", lines[0]
    headers = dict((k.lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:]))
    return int(status), headers, body


def error_of(resp: bytes, status: int) -> dict:
    got, headers, body = parse(resp)
    assert got == status, resp[:300]
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == status
    return err


def request(method="GET", path="/v1/models", host="localhost", extra=b"", body=b"",
            close=True) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n".encode() + extra
            + (b"Connection: close\r\n" if close else b"") + AUTH_LINE + b"\r\n" + body)


@pytest.mark.parametrize("data,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /v1/models\r\n\r\n", 400),  # HTTP/0.9: no status line would come back.
    (b"GET /v1/models HTTP/2.0\r\nHost: localhost\r\n\r\n", 505),
    (b"GET /v1/models FTP/1.1\r\n\r\n", 400),
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
    (request("FOO"), 501),
    (request("DELETE"), 405),
    (request("OPTIONS"), 405),  # Not a preflight (no Origin / Request-Method).
    (request(path="/nope"), 404),
    (request("GET", "/v1/completions"), 405),
    (request("POST", "/v1/completions", extra=b"Content-Type: application/json\r\n"), 411),
    (request("POST", "/v1/completions", extra=b"Content-Type: application/json\r\n"
             b"Content-Length: 5000\r\n", body=b"x" * 5000), 413),
    (request("POST", "/v1/completions", extra=b"Content-Type: application/json\r\n"
             b"Content-Length: 2\r\nContent-Length: 3\r\n", body=b"{}"), 400),
])
def test_every_error_is_json_with_a_status_line(server, data, status):
    error_of(exchange(server, data), status)
    if status == 405:
        _, headers, _ = parse(exchange(server, data))
        assert "GET" in headers["allow"] or "POST" in headers["allow"]


def test_slow_headers_get_408_within_the_deadline(server):
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        t0 = time.monotonic()
        for i in range(100):  # Trickle header lines until the server answers.
            if select.select([sock], [], [], 0.1)[0]:
                break
            sock.sendall(b"X-%d: 1\r\n" % i)
        resp = read_all(sock)
        assert time.monotonic() - t0 < 5  # Far below 100 x 0.1 s of trickling.
    assert "in time" in error_of(resp, 408)["message"]


def test_idle_connection_is_closed_quietly(server):
    with socket.create_connection(server.address, timeout=10) as sock:
        assert read_all(sock) == b""  # After keep_alive_timeout, without a response.


@pytest.fixture()
def capped(engine):
    """The probe's connection cap with deadlines far from a loaded CI machine's scheduling
    delays (the module server's 0.6 s head deadline can pass before a held connection's
    head is read); HTTP thread only."""
    limits = Limits(max_connections=LIMITS.max_connections, keep_alive_timeout=3.0,
                    header_timeout=20.0, io_timeout=30.0, max_body_bytes=4096)
    srv = InferenceServer(engine, port=0, api_key=KEY, limits=limits)
    t = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def test_connection_cap_answers_429_and_recovers(capped):
    """429 once every connection is busy with a request (here: waiting for a body)."""
    server = capped
    httpd = server.httpd
    assert httpd.open_connections == 0 or _wait(lambda: httpd.open_connections == 0)
    held: list[socket.socket] = []
    try:
        # One at a time, each head read before the next connects: a connection accepted
        # while earlier ones still wait for their heads could close one of them (at most
        # pending_cap may wait), which is the half-open defence, not what this probes.
        for i in range(LIMITS.max_connections):
            held.append(socket.create_connection(server.address))
            held[-1].sendall(request("POST", "/v1/completions", close=False, extra=(
                b"Content-Type: application/json\r\nContent-Length: 10\r\n")))
            assert _wait(lambda n=i + 1: httpd.open_connections == n
                         and httpd.waiting_connections == 0), (i, httpd.open_connections)
        with socket.create_connection(server.address, timeout=10) as extra:
            resp = read_all(extra)
        _, headers, _ = parse(resp)
        assert error_of(resp, 429) and headers["retry-after"] == "1"
    finally:
        for s in held:
            s.close()
    assert _wait(lambda: httpd.open_connections == 0)
    assert call(server, "GET", "/v1/models", headers=AUTH)[0] == 200
    # The server counts that connection closed only after the client has its response.
    assert _wait(lambda: httpd.open_connections == 0)
    metrics = call(server, "GET", "/metrics", headers=AUTH)[1].decode()
    assert 'jaxlearn_http_requests_total{code="429",path="other"}' in metrics
    assert "jaxlearn_http_connections_open 1" in metrics  # The /metrics request itself.
    assert "jaxlearn_http_connections_waiting 0" in metrics  # Its head was read.


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listen_backlog(server):
    out = subprocess.run(["ss", "-ltnH", f"sport = :{server.address[1]}"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "LISTEN" and int(out[2]) == LIMITS.backlog, out  # Send-Q: the backlog


def test_keep_alive_responses_come_in_one_write(server):
    with socket.create_connection(server.address, timeout=10) as sock:
        for _ in range(5):
            sock.sendall(request(close=False))
            status, headers, body = parse(sock.recv(65536))  # Whole response at once.
            assert status == 200 and len(body) == int(headers["content-length"])
            assert json.loads(body)["data"][0]["id"] == "tiny"


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        status, out, resp = call(server, "GET", "/v1/models", headers=headers)
        assert status == 401 and resp.getheader("WWW-Authenticate") == "Bearer"
        assert json.loads(out)["error"]["type"] == "authentication_error"
    assert call(server, "POST", "/v1/completions", {"prompt": "a"})[0] == 401
    assert call(server, "GET", "/metrics")[0] == 401
    assert call(server, "GET", "/health")[0] == 200  # Probes need no key.
    assert call(server, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    # Expect: 100-continue is refused before the body is sent.
    resp = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 10\r\n"
                    b"Expect: 100-continue\r\n\r\n")
    error_of(resp, 401)


@pytest.mark.parametrize("pending", [3, 6])
def test_half_open_connections_cannot_lock_out_requests(server, engine, pending):
    """Connections that send only a request line (no key needed) are closed, oldest
    first, for newer ones: with more of them than the caps, a keyed request and /health
    are still served long before the header deadline, and the oldest half-open one gets
    a 408. pending 6 == max_connections: the connection cap itself closes them."""
    limits = Limits(max_connections=6, max_pending_connections=pending, header_timeout=60.0,
                    keep_alive_timeout=60.0, io_timeout=5.0)
    srv = InferenceServer(engine, port=0, api_key=KEY, limits=limits)
    threading.Thread(target=srv.httpd.serve_forever, daemon=True).start()
    half_open = []
    try:
        for _ in range(20):
            half_open.append(socket.create_connection(srv.address, timeout=10))
            half_open[-1].sendall(b"GET /v1/models HTTP/1.1\r\n")
        # Their threads have read their request lines (so they are closable).
        assert _wait(lambda: srv.httpd.waiting_connections == pending and not any(
            httpd._unread(s) for s in list(srv.httpd._waiting)))
        assert call(srv, "GET", "/v1/models", headers=AUTH, timeout=10)[0] == 200
        assert call(srv, "GET", "/health", timeout=10)[0] == 200
        err = error_of(read_all(half_open[0]), 408)
        assert "closed for newer" in err["message"], err
        assert srv.httpd.open_connections <= 6 and srv.httpd.waiting_connections <= pending
        # The newest half-open connection was not closed: nothing to read on it yet.
        assert not select.select([half_open[-1]], [], [], 0)[0]
    finally:
        for s in half_open:
            s.close()
        srv.httpd.shutdown()
        srv.httpd.server_close()


class _GatedHandler(Handler):
    """Reads nothing until `gate` is set (threads slower than their clients)."""

    gate = threading.Event()

    def setup(self):
        self.gate.wait(30)
        super().setup()

    def do_GET(self):
        self.send_json(200, {"ok": True})


def test_connections_with_unread_requests_are_not_closed():
    """A burst of complete requests that their threads have not read yet is admitted
    past max_pending_connections (nothing is closed for it) and served."""
    limits = Limits(max_connections=10, max_pending_connections=2, header_timeout=30.0)
    srv = HTTPServer(("127.0.0.1", 0), _GatedHandler, Policy.for_bind("127.0.0.1"), limits)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    clients = []
    try:
        for _ in range(6):
            clients.append(socket.create_connection(srv.server_address[:2], timeout=10))
            clients[-1].sendall(request(close=True))
        assert _wait(lambda: srv.open_connections == 6)
        _GatedHandler.gate.set()
        for c in clients:
            assert parse(read_all(c))[0] == 200
    finally:
        _GatedHandler.gate.set()
        for c in clients:
            c.close()
        srv.shutdown()
        srv.server_close()


def test_limits_defaults():
    assert Limits().header_timeout <= 3.0
    assert Limits(max_connections=10).pending_cap == 5
    assert Limits(max_connections=4, max_pending_connections=9).pending_cap == 4
    assert Limits().max_active_per_request is None  # InferenceServer: max_batch // 2.
    for field in ("max_pending_connections", "max_active_per_request"):
        with pytest.raises(ValueError, match=f"Limits.{field}=0"):
            Limits(**{field: 0})


BAD_HOSTS = ("127.0.0.1:80@evil", "[::1]evil.com", "[::1]:80evil", "localhost@evil.example",
             "evil.example#localhost", "localhost:", "localhost:8o", "localhost:99999",
             "localhost:80:80", "[::1", "[zz::1]", "[127.0.0.1]", "local host", "localhost/x",
             "..", "a..b", "")


def test_malformed_host_is_400(server, plain):
    """Host is host[:port] exactly: no userinfo, nothing after "]" but ":port", port
    digits only; refused with or without an allowlist."""
    for host in BAD_HOSTS:
        for srv in (server, plain):
            err = error_of(exchange(srv, request(host=host)), 400)
            assert "Host" in err["message"] and "malformed" in err["message"], (host, err)
        with pytest.raises(HTTPError, match="malformed"):  # Also where any Host is allowed.
            Policy.for_bind("0.0.0.0").check_host([host])


def test_two_host_headers_are_400(server, plain):
    for srv in (server, plain):
        err = error_of(exchange(srv, request(extra=b"Host: localhost\r\n")), 400)
        assert "2 Host headers" in err["message"], err
    with pytest.raises(HTTPError, match="Host headers"):
        Policy.for_bind("0.0.0.0").check_host(["a.example", "a.example"])


def test_host_allowlist(server, plain):
    for srv in (server, plain):
        err = error_of(exchange(srv, request(host="evil.example")), 400)
        assert "evil.example" in err["message"]
        error_of(exchange(srv, b"GET /v1/models HTTP/1.0\r\n" + AUTH_LINE + b"\r\n"), 400)
        for host in ("localhost:8000", "127.0.0.1", "[::1]:1234", "LOCALHOST", "localhost.",
                     "[0:0:0:0:0:0:0:1]:80", "127.0.0.1:65535"):
            assert parse(exchange(srv, request(host=host)))[0] == 200, host
    assert parse(exchange(server, request(host="api.example:443")))[0] == 200
    error_of(exchange(plain, request(host="api.example")), 400)


def test_policy_for_non_loopback_binds():
    assert Policy.for_bind("0.0.0.0").allowed_hosts is None  # Any Host, as documented.
    assert Policy.for_bind("0.0.0.0", allowed_hosts=["a.example"]).allowed_hosts == {"a.example"}
    assert Policy.for_bind("::1").allowed_hosts >= {"localhost", "::1", "127.0.0.1"}
    assert Policy.for_bind("127.0.0.1", allowed_hosts=["*"]).allowed_hosts is None
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM.:8000") == "example.com"
    assert parse_host("[::1]:80") == "::1" and parse_host("Example.COM.:8000") == "example.com"
    assert parse_host("my_svc-1.internal") == "my_svc-1.internal"
    with pytest.raises(ValueError, match="api_key"):
        Policy.for_bind("127.0.0.1", api_key=" ")
    with pytest.raises(ValueError, match="Limits.header_timeout"):
        Limits(header_timeout=0)


def test_cors(server, plain):
    ui = {"Origin": "http://ui.example"}
    status, _, resp = call(server, "GET", "/v1/models", headers={**AUTH, **ui})
    assert status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://ui.example"
    status, _, resp = call(server, "OPTIONS", "/v1/completions", headers={
        **ui, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and resp.getheader("Access-Control-Allow-Origin") == "http://ui.example"
    assert "Authorization" in resp.getheader("Access-Control-Allow-Headers")
    status, out, _ = call(server, "GET", "/v1/models", headers={**AUTH, "Origin": "http://evil"})
    assert status == 403 and json.loads(out)["error"]["type"] == "permission_error"
    # CORS off by default: a request with any Origin (so every preflight) is refused.
    assert call(plain, "GET", "/v1/models", headers={"Origin": "http://localhost:3000"})[0] == 403
    assert call(plain, "GET", "/v1/models")[0] == 200


def test_post_needs_json_content_type(server):
    body = {"prompt": "ab", "max_tokens": 1, "temperature": 0}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, out, _ = call(server, "POST", "/v1/completions", body,
                              headers={**AUTH, "Content-Type": ctype})
        assert status == 415 and ctype in json.loads(out)["error"]["message"]
    status, _, _ = call(server, "POST", "/v1/completions", body,
                        headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\uDFFF"], "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 1}', "messages"),
])
def test_lone_surrogate_is_400(server, path, raw, param):
    status, out, _ = call(server, "POST", path, raw=raw, headers=AUTH)
    err = json.loads(out)["error"]
    assert status == 400 and err["param"] == param and "surrogate" in err["message"], err


def test_surrogate_pair_and_keep_alive_after_400(server):
    """A valid pair (an emoji) is text; a 400 after a whole body keeps the connection."""
    ok = b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 1, "temperature": 0}'
    bad = b'{"prompt": "a", "temperature": -1}'
    with socket.create_connection(server.address, timeout=60) as sock:
        for raw, want in ((bad, 400), (ok, 200), (bad, 400)):
            sock.sendall(request("POST", "/v1/completions", extra=b"Content-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n" % len(raw),
                                 body=raw, close=False))
            status, headers, body = parse(_read_response(sock))
            assert status == want, body
            assert headers.get("connection") != "close"


def test_stream_with_key_and_cors(server):
    status, payload, resp = call(server, "POST", "/v1/completions", {
        "prompt": "ab", "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True},
        headers={**AUTH, "Origin": "http://ui.example"})
    assert status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://ui.example"
    assert sse_events(payload)[-1] == "[DONE]"


def _read_response(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    _, headers, body = parse(data)
    while len(body) < int(headers["content-length"]):
        more = sock.recv(65536)
        body += more
        data += more
    return data


def _wait(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False
