"""Test setup: 8 fake CPU devices, persistent compilation cache, the tiny engines of
`engine_testing` (inference tests), HTTP helpers."""

import os

import jax
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("JAXLEARN_COMPILATION_CACHE") or "/tmp/jaxlearn-jax-cache",
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
settings.register_profile("jaxlearn", deadline=None, max_examples=20, derandomize=True)
settings.load_profile("jaxlearn")

# ---- HTTP helpers ----------------------------------------------------------------------
import http.client  # noqa: E402
import json  # noqa: E402

from engine_testing import (  # noqa: E402,F401  (fixtures and helpers the tests import)
    ALPHABET,
    CharTokenizer,
    cfg,
    engine,
    make_engine,
    params,
    prompt_pool,
    reference_greedy,
    tiny_config,
    tiny_params,
    tok,
)
from schema_testing import byte_engine  # noqa: E402,F401  (a fixture)


def call(srv, method, path, body=None, *, raw=None, headers=None, timeout=120):
    host, port = srv.address
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                    **(headers or {})})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    return resp.status, out, resp


def sse_events(payload: bytes) -> list:
    events = []
    for block in payload.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
