"""LoRA adapters over HTTP: output tok/s of a batch mixing adapters against the base model
alone at the same concurrency, on running `jaxlearn serve` processes (as a user starts
them), rounds interleaved.

    tools/jaxlearn serve --model M --max_batch 8 --port 8124 --lora a0=DIR0 ... --lora a3=DIR3
    tools/jaxlearn serve --model M --max_batch 8 --port 8125          # no adapters
    python tools/bench/multi_lora_serve.py --lora_url http://127.0.0.1:8124 \\
        --base_url http://127.0.0.1:8125 --adapters a0,a1,a2,a3 -c 8 -n 32 --rounds 3

Each pass sends N completions (seeded English prompts of 16-256 words, max_tokens 64,
ignore_eos, temperature 0, no streaming) from C worker threads; the model of request i
is `adapters[i % k]` ("mixed"), or the base model's name ("base"). Passes per round:
mixed and base-only on the adapter server, base on the plain server (when given), the
order rotating each round; a warm-up pass with other prompts first. Prompts differ
between passes (no prefix-cache hits across them). Prints one JSON line per pass and a
summary with the medians and ratios, the host's CPU flags included.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_cpu  # noqa: E402

WORDS = ("the a of to and in is for on with that as by this from at be are it an or was "
         "which model server batch token cache layer weight query value key adapter data "
         "river mountain city garden window music story letter morning evening").split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 256))) for _ in range(n)]


def models(url: str) -> list[str]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/v1/models")
    out = [m["id"] for m in json.loads(conn.getresponse().read())["data"]]
    conn.close()
    return out


def run_pass(url: str, names: list[str], texts: list[str], concurrency: int,
             max_tokens: int) -> dict[str, Any]:
    u = urllib.parse.urlparse(url)
    todo = list(enumerate(texts))
    lock = threading.Lock()
    tokens, errors = [0], [0]

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, text = todo.pop(0)
            body = {"model": names[i % len(names)], "prompt": text, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            with lock:
                if resp.status != 200:
                    errors[0] += 1
                else:
                    tokens[0] += json.loads(data)["usage"]["completion_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"tokens": tokens[0], "errors": errors[0], "seconds": round(wall, 3),
            "tok_s": round(tokens[0] / wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lora_url", required=True)
    ap.add_argument("--base_url", default=None, help="a server of the base model alone")
    ap.add_argument("--adapters", required=True, help="comma-separated adapter names")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=32)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    adapters = args.adapters.split(",")
    base_name = models(args.lora_url)[0]
    passes: list[tuple[str, str, list[str]]] = [
        ("mixed", args.lora_url, adapters), ("base_on_lora_server", args.lora_url, [base_name])]
    if args.base_url:
        passes.append(("base_plain_server", args.base_url, [models(args.base_url)[0]]))
    for label, url, names in passes:  # Warm-up: other prompts.
        run_pass(url, names, prompts(args.concurrency, 1000), args.concurrency, 8)
    results: dict[str, list[float]] = {label: [] for label, _, _ in passes}
    seed = 0
    for r in range(args.rounds):
        order = passes[r % len(passes):] + passes[: r % len(passes)]
        for label, url, names in order:
            seed += 1
            out = run_pass(url, names, prompts(args.requests, seed), args.concurrency,
                           args.max_tokens)
            results[label].append(out["tok_s"])
            print(json.dumps({"bench": "multi_lora_serve", "pass": label, "round": r, **out}),
                  flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    summary: dict[str, Any] = {"bench": "multi_lora_serve", "summary": True,
                               "host": host_cpu(), "concurrency": args.concurrency,
                               "requests": args.requests, "max_tokens": args.max_tokens,
                               "adapters": adapters, "tok_s_median": med}
    ref: Optional[float] = med.get("base_plain_server")
    if ref:
        summary["mixed_over_plain_base"] = round(med["mixed"] / ref, 3)
        summary["base_on_lora_server_over_plain_base"] = round(
            med["base_on_lora_server"] / ref, 3)
    summary["mixed_over_base_same_server"] = round(med["mixed"] / med["base_on_lora_server"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
