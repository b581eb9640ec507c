"""Request latency of the `jaxlearn serve` HTTP layer, kept-alive connections against a
fresh connection per request (the peer, measured in the same run).

    tools/jaxlearn python tools/bench/jl_http_latency.py [--requests 200] [--completions 40]

A tiny random Llama (vocab 320, dim 64, 2 layers) behind `InferenceServer` on a free
loopback port. Timed, after warm-up: `GET /v1/models` and a 1-token greedy
`POST /v1/completions`, each over one kept-alive `http.client` connection and over a new
connection per request. Prints one JSON line per case (median / p90 milliseconds) and the
ratio kept-alive / fresh. On a server whose responses go out in two writes without
TCP_NODELAY, the kept-alive case waits for the client's delayed ACK (~40 ms on Linux).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from typing import Any, Callable

import jax

from jaxlearn.inference import Engine
from jaxlearn.layers import llama_config
from jaxlearn.serve.server import InferenceServer
from jaxlearn.text.tokenizers import ByteTokenizer

BODY = json.dumps({"prompt": "hello", "max_tokens": 1, "temperature": 0}).encode()
HEADERS = {"Content-Type": "application/json"}


def _timed(n: int, fn: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _request(conn: http.client.HTTPConnection, method: str, path: str) -> None:
    conn.request(method, path, body=BODY if method == "POST" else None, headers=HEADERS)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200, resp.status


def _case(addr: tuple[str, int], method: str, path: str, n: int) -> dict[str, Any]:
    keep = http.client.HTTPConnection(*addr, timeout=60)
    _request(keep, method, path)  # Connect outside the timed calls.

    def fresh() -> None:
        conn = http.client.HTTPConnection(*addr, timeout=60)
        _request(conn, method, path)
        conn.close()

    kept, new = [], []
    for _ in range(2):  # Interleaved halves, so load changes hit both.
        kept += _timed(n // 2, lambda: _request(keep, method, path))
        new += _timed(n // 2, fresh)
    keep.close()

    def stats(xs: list[float]) -> dict[str, float]:
        return {"median_ms": round(statistics.median(xs), 3),
                "p90_ms": round(statistics.quantiles(xs, n=10)[-1], 3)}

    k, f = stats(kept), stats(new)
    return {"case": f"{method} {path}", "requests": len(kept), "keep_alive": k, "fresh": f,
            "keep_alive_over_fresh": round(k["median_ms"] / f["median_ms"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--completions", type=int, default=40)
    args = ap.parse_args()
    cfg = llama_config(320, 64, 2, 4, 2, 128, rope_theta=1e4, tie_embeddings=True)
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    engine = Engine.default_config().set(max_seq_len=64, max_batch=2, prefill_chunk=16).instantiate(
        model_cfg=cfg, params=params, tokenizer=ByteTokenizer())
    server = InferenceServer(engine, port=0).start()
    try:
        addr = server.address
        for _ in range(3):  # Compile the 1-token programs.
            _request(http.client.HTTPConnection(*addr, timeout=120), "POST", "/v1/completions")
        for method, path, n in [("GET", "/v1/models", args.requests),
                                ("POST", "/v1/completions", args.completions)]:
            print(json.dumps(_case(addr, method, path, n)), flush=True)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
